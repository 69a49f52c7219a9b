"""Continuous batching: `edgerun serve --parallel N` against llama.cpp's `llama-server --parallel N`.

Same model files, threads, context per slot and requests (greedy streaming chat, the same prompts, the same
max_tokens). For each model configuration both servers run side by side (loaded once, idle while the other
is measured); each concurrency level is measured on both back to back, alternating which goes first.
Reported per level: aggregate completion tokens/s (all tokens / wall time of the level) and p50/p95 time to
first token. A third server, edgerun with --parallel 1 (one generation at a time, the pre-batching
scheduler), gives the single-client baseline. With a drafter (qwen-spec) two more edgerun servers without
it (--parallel N and 1) give speculation's own speedup at 1 and 2 clients, batched and alone.

Single runs of a level scatter by 10-20% on a shared 2-core machine, so every ratio is measured --trials
times as a pair: its two servers back to back (adjacent readings share the machine's drift), the pair's
order alternating and the pairs' order rotating trial by trial. The table gives each server's median and,
per ratio, the geometric mean of the paired ratios with its 95% interval and how many pairs are >= 1.
(Runs before this measured all servers in one sequence per trial; a server read 0.96 of another there and
1.00 of it measured pairwise, docs/batching.md.)
Writes bench/results/batch.json and prints the tables.

    nice python bench/batch.py --llama-bin <llama.cpp build>/bin [--threads 2] [--parallel 4]
        [--clients 1,2,4,8] [--rounds 2] [--trials 3] [--max-tokens 48] [--configs smollm2,qwen,qwen-spec]
        [--llama-cache-ram 0] [--also-no-prompt-cache] [--also-asyncio] [--also-baseline SRC_DIR]

The prompts repeat (10 prompts; a level of 8 clients x 2 requests sends 6 of them twice, and earlier levels
and trials sent them too): both servers keep finished prompts' KV in host memory (llama-server --cache-ram,
edgerun --prompt-cache) and restore a repeated prompt instead of evaluating it. --llama-cache-ram 0 and
--also-no-prompt-cache measure without them. edgerun serves on uvloop where it is installed (the serve
extra); --also-asyncio adds an edgerun with uvloop hidden from it (the standard asyncio loop) at every level.

--also-baseline SRC_DIR adds an edgerun run from another source tree (first on PYTHONPATH; the same Python and
packages) at every level, so a change is measured side by side against the code before it:
`git worktree add /tmp/base <commit>`, then `--also-baseline /tmp/base`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from harness import Proc, free_port, llama_server as peer_llama_server, print_table, write_result  # noqa: E402
from serve import PROMPTS, pct  # noqa: E402  (bench/serve.py: the load test's prompts and percentile)

CONFIGS = {
    "smollm2": ("smollm2-135m-instruct", None),
    "qwen": ("qwen2.5-coder-1.5b-instruct", None),
    # the pair as stored for speed (README Models: the @spec variants, the pair --draft auto makes of a @spec
    # target): stored as the registry files are, a verification costs so much more on a CPU than a step
    # that speculation does not pay there (docs/speculative.md), batched or not
    "qwen-spec": ("qwen2.5-coder-1.5b-instruct@spec", "qwen2.5-coder-0.5b-instruct@spec"),
}


def edgerun_server(model: str, draft: str | None, args, parallel: int, prompt_cache: int | None = None,
                   asyncio_loop: bool = False, src: str | None = None) -> Proc:
    port = free_port()
    first: list[str] = []
    if asyncio_loop:
        # uvicorn's loop="auto" takes uvloop when it imports; a module of that name that refuses to import,
        # first on the path, leaves it the standard asyncio loop
        shadow = tempfile.mkdtemp(prefix="edgerun-bench-")
        Path(shadow, "uvloop.py").write_text("raise ImportError('hidden by bench/batch.py --also-asyncio')\n")
        first.append(shadow)
    if src:
        # another checkout's edgerun package, found before the installed (editable) one; run in that tree, as
        # `python -m` puts the working directory first on the path
        if not (Path(src) / "edgerun" / "__init__.py").is_file():
            raise SystemExit(f"--also-baseline {src}: no edgerun package there (expected {src}/edgerun/__init__.py)")
        first.append(str(Path(src).resolve()))
    env = None
    if first:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*first, *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "edgerun", "serve", "--model", model, "--draft", draft or "none",
           *(["--prompt-cache", str(prompt_cache)] if prompt_cache is not None else []),
           "--parallel", str(parallel), "--threads", str(args.threads), "--ctx", str(args.ctx),
           "--port", str(port), "--queue", "64", "--timeout", "900", "--no-pull"]
    return Proc(f"edgerun --parallel {parallel}" + (f" ({src})" if src else ""), cmd, f"http://127.0.0.1:{port}",
                env=env, cwd=str(Path(src).resolve()) if src else None)


def llama_server(model: str, draft: str | None, args) -> Proc:
    from edgerun.resolve import resolve_model

    extra = ["-c", str(args.ctx * args.parallel), "-np", str(args.parallel), "-fa", "on", "-ngl", "0"]
    if draft:
        extra += ["-md", str(resolve_model(draft, pull=False)), "-ngld", "0"]
    if args.llama_cache_ram is not None:
        # llama-server keeps finished prompts' KV in a host-memory cache (--cache-ram, 8192 MiB by default) and
        # restores a repeated prompt instead of evaluating it; edgerun reuses only what a slot still holds
        extra += ["--cache-ram", str(args.llama_cache_ram)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(args.llama_bin))}
    return peer_llama_server(Path(args.llama_bin) / "llama-server", resolve_model(model, pull=False),
                             threads=args.threads, extra=extra, env=env, name=f"llama-server -np {args.parallel}")


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streaming chat request: time to first content and completion tokens (usage, else chunks)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return {"ttft": ttft, "tokens": usage if usage is not None else chunks}


BATCH_COUNTERS = ("edgerun_batch_steps_total", "edgerun_batch_rows_total", "edgerun_batch_eval_seconds_total")


async def _batch_counters(client: httpx.AsyncClient) -> tuple[float, float, float]:
    """edgerun's (batched evaluations, rows in them, seconds inside them) so far; zeros for a server
    without them."""
    r = await client.get("/metrics")
    text = r.text if r.status_code == 200 else ""
    vals = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.split(" ")[0] in BATCH_COUNTERS}
    return tuple(vals.get(k, 0.0) for k in BATCH_COUNTERS)


async def level(url: str, model: str, clients: int, rounds: int, max_tokens: int) -> dict:
    """`clients` concurrent clients, each sending `rounds` requests one after another."""
    # no kept-alive connections: llama-server closes an idle one after a few seconds, and a request sent on
    # it as it closes fails with "Server disconnected"; a new connection per request costs both servers alike
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        steps0, rows0, eval0 = await _batch_counters(client)
        async def one_client(c: int) -> list[dict]:
            return [await one_request(client, model, PROMPTS[(c * rounds + i) % len(PROMPTS)], max_tokens)
                    for i in range(rounds)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
        steps1, rows1, eval1 = await _batch_counters(client)
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95),
            "rows_per_batch": (rows1 - rows0) / (steps1 - steps0) if steps1 > steps0 else None,
            "eval_share": (eval1 - eval0) / wall if steps1 > steps0 else None}


def summarize(trials: list[dict]) -> dict:
    """One server's level over its trials: the medians (tok/s, TTFT p50 / p95), the mean rows per batch."""
    med = lambda key: float(np.median([t[key] for t in trials if t[key] is not None]))  # noqa: E731
    rows = [t["rows_per_batch"] for t in trials if t["rows_per_batch"] is not None]
    share = [t["eval_share"] for t in trials if t["eval_share"] is not None]
    return {"tok_s": med("tok_s"), "ttft_p50_s": med("ttft_p50_s"), "ttft_p95_s": med("ttft_p95_s"),
            "rows_per_batch": float(np.mean(rows)) if rows else None,
            "eval_share": float(np.mean(share)) if share else None}


def ratio_cell(ratios: list[float]) -> str:
    """The geometric mean of the trials' paired ratios with its 95% interval (t over the log ratios), and how
    many pairs are at or above 1."""
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    from scipy import stats

    logs = np.log(ratios)
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return (f"{np.exp(logs.mean()):.2f} [{np.exp(logs.mean() - half):.2f}, {np.exp(logs.mean() + half):.2f}] "
            f"{sum(r >= 1.0 for r in ratios)}/{len(ratios)} ≥ 1")


def versus_table(report: dict, other: str, ratios: str, label: str) -> None:
    """edgerun beside one of its variants (another server measured at every level), level by level."""
    rows = [[name, str(row["clients"]), row["edgerun"]["tok_s"], row[other]["tok_s"], ratio_cell(row[ratios]),
             f"{row['edgerun']['rows_per_batch'] or 0:.2f} / {row[other]['rows_per_batch'] or 0:.2f}"]
            for name, cfg in report["configs"].items() for row in cfg["levels"]]
    print()
    print_table(["config", "clients", "edgerun tok/s", f"{label} tok/s", "ratio",
                 f"rows per batch (edgerun / {label})"], rows, fmt=".1f", markdown=True)


def print_tables(report: dict) -> None:
    """The tables of one run (from its report: a fresh run or a saved JSON)."""
    opts = report["args"]          # .get: a run saved before an --also-* option existed has no such key
    rows = []
    for name, cfg in report["configs"].items():
        for row in cfg["levels"]:
            e, ls = row["edgerun"], row["llama-server"]
            rows.append([name, str(row["clients"]), e["tok_s"], ls["tok_s"], ratio_cell(row["ratios"]),
                         f"{e['ttft_p50_s']:.2f} / {e['ttft_p95_s']:.2f}", f"{ls['ttft_p50_s']:.2f} / {ls['ttft_p95_s']:.2f}",
                         f"{e['rows_per_batch'] or 0:.2f}", f"{e.get('eval_share') or 0:.0%}"])
        p1 = cfg["levels"][0].get("edgerun-p1")
        if p1:
            rows.append([name, "1 (edgerun --parallel 1)", p1["tok_s"], "",
                         f"{ratio_cell(cfg['levels'][0]['p1_ratios'])} (--parallel {opts['parallel']} / 1)",
                         f"{p1['ttft_p50_s']:.2f} / {p1['ttft_p95_s']:.2f}", "", "", ""])
    print()
    print_table(["config", "clients", "edgerun tok/s", "llama-server tok/s", "ratio", "edgerun TTFT p50 / p95 s",
                 "llama-server TTFT p50 / p95 s", "edgerun rows per batch", "edgerun wall in batched evals"],
                rows, fmt=".1f", markdown=True)
    spec = [[name, str(row["clients"]), ratio_cell(row["spec_ratios"]),
             ratio_cell(row["spec_alone_ratios"]) if "spec_alone_ratios" in row else ""]
            for name, cfg in report["configs"].items() if cfg["draft"] for row in cfg["levels"] if "spec_ratios" in row]
    if spec:
        print()
        print_table(["config", "clients", "edgerun with the drafter / without it (--parallel N)",
                     "--parallel 1 with / without it (speculation alone)"], spec, markdown=True)
    if opts.get("also_no_prompt_cache"):
        versus_table(report, "edgerun-nocache", "cache_ratios", "edgerun --prompt-cache 0")
    if opts.get("also_asyncio"):
        versus_table(report, "edgerun-asyncio", "uvloop_ratios", "edgerun on the asyncio loop")
    if opts.get("also_baseline"):
        versus_table(report, "edgerun-baseline", "baseline_ratios", f"edgerun from {opts['also_baseline']}")


def level_pairs(clients: int, draft: str | None, servers: dict) -> list[tuple[str, str, str]]:
    """The ratios measured at a level: (report key, numerator server, denominator server)."""
    pairs = [("ratios", "edgerun", "llama-server")]
    if clients == 1:
        pairs.append(("p1_ratios", "edgerun", "edgerun-p1"))
    if draft and clients <= 2:
        pairs.append(("spec_ratios", "edgerun", "edgerun-nodraft"))
    if draft and clients == 1:
        pairs.append(("spec_alone_ratios", "edgerun-p1", "edgerun-p1-nodraft"))
    for key, who in (("cache_ratios", "edgerun-nocache"), ("uvloop_ratios", "edgerun-asyncio"),
                     ("baseline_ratios", "edgerun-baseline")):
        if who in servers:
            pairs.append((key, "edgerun", who))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", help="directory of a llama.cpp build with llama-server "
                                                      "(built from the llama-cpp-python source package)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="context positions per slot (both servers)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3,
                    help="times each ratio's two servers are measured back to back, in alternating order; the "
                         "table gives medians and the geometric mean of the paired ratios with its 95%% interval")
    ap.add_argument("--configs", default="smollm2,qwen,qwen-spec")
    ap.add_argument("--llama-cache-ram", type=int, default=None,
                    help="llama-server --cache-ram MiB (0: no host prompt cache; default: llama-server's own)")
    ap.add_argument("--also-no-prompt-cache", action="store_true",
                    help="also measure edgerun with --prompt-cache 0 at every level (the cache's own effect)")
    ap.add_argument("--also-asyncio", action="store_true",
                    help="also measure edgerun on the standard asyncio loop (uvloop hidden) at every level")
    ap.add_argument("--also-baseline", metavar="SRC_DIR", default=None,
                    help="also measure an edgerun run from this source tree (a worktree of the commit before a change)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch.json"))
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="print the tables of a saved run (its --out file) and exit; nothing is measured")
    args = ap.parse_args()
    if args.report:
        print_tables(json.loads(Path(args.report).read_text()))
        return
    if not args.llama_bin:
        ap.error("--llama-bin is required (a llama.cpp build directory with llama-server)")
    levels = [int(x) for x in args.clients.split(",")]
    report: dict = {"args": vars(args), "configs": {}}
    for name in args.configs.split(","):
        model, draft = CONFIGS[name]
        start = {"edgerun": lambda: edgerun_server(model, draft, args, args.parallel),
                 "llama-server": lambda: llama_server(model, draft, args),
                 "edgerun-p1": lambda: edgerun_server(model, draft, args, 1)}
        if draft:
            # the speedup speculation gives alone (--parallel 1 with / without the drafter) and in the batching
            # server (--parallel N with / without it), measured at 1 and 2 clients
            start["edgerun-nodraft"] = lambda: edgerun_server(model, None, args, args.parallel)
            start["edgerun-p1-nodraft"] = lambda: edgerun_server(model, None, args, 1)
        if args.also_no_prompt_cache:
            start["edgerun-nocache"] = lambda: edgerun_server(model, draft, args, args.parallel, prompt_cache=0)
        if args.also_asyncio:
            start["edgerun-asyncio"] = lambda: edgerun_server(model, draft, args, args.parallel, asyncio_loop=True)
        if args.also_baseline:
            start["edgerun-baseline"] = lambda: edgerun_server(model, draft, args, args.parallel, src=args.also_baseline)
        servers: dict[str, Proc] = {}
        try:
            for who, make in start.items():
                # one at a time: an edgerun server measures its cost probes (cached) as it starts, and five
                # started together measured each other (a drafter's step cached at twice its cost)
                servers[who] = make()
                servers[who].wait_ready()
            for s in servers.values():          # warm-up: every slot once (its cached chat-template prefix,
                asyncio.run(level(s.url, model, args.parallel, 1, args.max_tokens))   # the tuner's first cycles)
            rows = []
            for i, c in enumerate(levels):
                pairs = level_pairs(c, draft, servers)
                row = {"clients": c, "trials": []}
                seen: dict[str, list[dict]] = {}
                for t in range(args.trials):
                    # each ratio's two servers are measured back to back (adjacent readings share the machine's
                    # drift: their log speeds correlate 0.6-0.8, readings further apart much less), the pair's
                    # order alternating trial by trial, and the pairs' order rotating, so no server is always
                    # first, last or after the same one
                    trial = {}
                    k = (i + t) % len(pairs)
                    for j, (key, a, b) in enumerate(pairs[k:] + pairs[:k]):
                        got = {}
                        for who in ((a, b) if (i + t + j) % 2 == 0 else (b, a)):
                            got[who] = asyncio.run(level(servers[who].url, model, c, args.rounds, args.max_tokens))
                            seen.setdefault(who, []).append(got[who])
                            print(f"{name} {c} clients trial {t + 1}/{args.trials} {key} {who}: "
                                  f"{got[who]['tok_s']:.1f} tok/s, TTFT p50 {got[who]['ttft_p50_s']:.2f} s", flush=True)
                        trial[key] = got
                    row["trials"].append(trial)
                for who, results in seen.items():
                    row[who] = summarize(results)
                for key, a, b in pairs:
                    row[key] = [tr[key][a]["tok_s"] / tr[key][b]["tok_s"] for tr in row["trials"]]
                rows.append(row)
            report["configs"][name] = {"model": model, "draft": draft, "levels": rows}
        finally:
            for s in servers.values():
                s.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report, indent=2)
    print_tables(report)
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
