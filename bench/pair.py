"""Two running OpenAI-compatible servers, measured pairwise: single requests alternating between them.

On a shared 2-core machine one reading of a server scatters by 7-11% (coefficient of variation of 128-token
requests), but two readings taken back to back share most of it (their log speeds correlate 0.6-0.8), so a
ratio of adjacent readings resolves a few percent where separate runs do not. Each pair is one greedy
streaming chat request (bench/batch.py's) to each server, the order alternating pair by pair; both servers
get the same prompt in a pair. Reported: the geometric mean of B / A over the pairs with its standard error
and 95% interval, the correlation of the pair's readings, and each server's median speed, time to first
token and decode rate after it. Start the servers yourself (bench/batch.py's commands, or any others),
then:

    python bench/pair.py --a http://127.0.0.1:8001 --b http://127.0.0.1:8002 [--pairs 20] [--max-tokens 128]
        [--clients 1] [--warmup 2] [--thread-cpu] [--out results.json]

The model id each server serves is read from its /v1/models. --thread-cpu (servers on this machine) also
reports each server's threads' CPU time as a share of its readings' wall time (from /proc; the thread that
started the process is "main"): where a server's work per token goes besides the model's evaluation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from batch import one_request  # noqa: E402  (bench/batch.py: one greedy streaming chat request)
from serve import PROMPTS  # noqa: E402


async def reading(url: str, model: str, prompt_index: int, clients: int, max_tokens: int) -> dict:
    """`clients` concurrent requests (prompts from prompt_index on): aggregate tok/s, TTFT, decode rate."""
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_request(client, model, PROMPTS[(prompt_index + c) % len(PROMPTS)], max_tokens)
                                    for c in range(clients)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rs)
    ttft = max(r["ttft"] or 0.0 for r in rs)
    return {"tok_s": tokens / wall, "ttft_s": ttft,
            "decode_tok_s": (tokens - clients) / (wall - ttft) if wall > ttft else None}


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def listening_pid(url: str) -> int | None:
    """The pid of the local process listening on the URL's port (None if not found or not allowed)."""
    import psutil
    from urllib.parse import urlparse

    port = urlparse(url).port
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process ("main" for the thread that started it, else "name-tid")."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out["main" if int(tid) == pid else f"{name}-{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="base URL of server A (the denominator)")
    ap.add_argument("--b", required=True, help="base URL of server B (the numerator)")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=1, help="concurrent requests per reading")
    ap.add_argument("--warmup", type=int, default=2, help="untimed readings of each server first")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="also report each local server's threads' CPU time as a share of wall time (/proc)")
    ap.add_argument("--out", default=None, help="write the readings and the summary as JSON here")
    args = ap.parse_args()
    if args.pairs < 2:
        ap.error("--pairs must be at least 2 (an interval needs two pairs)")
    urls = {"a": args.a.rstrip("/"), "b": args.b.rstrip("/")}
    models = {}
    for k, url in urls.items():
        try:
            models[k] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            die(f"server {k.upper()} at {url} does not answer GET /v1/models with a model ({e}); start it first")
    for i in range(args.warmup):
        for k in urls:
            asyncio.run(reading(urls[k], models[k], i, args.clients, args.max_tokens))
    pids = {k: listening_pid(u) for k, u in urls.items()} if args.thread_cpu else {}
    if args.thread_cpu and None in pids.values():
        die("--thread-cpu needs both servers listening on this machine (and the right to see their sockets); "
            "no pid found for " + ", ".join(k.upper() for k, p in pids.items() if p is None))
    cpu: dict[str, dict[str, float]] = {"a": {}, "b": {}}
    wall = {"a": 0.0, "b": 0.0}
    got: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(args.pairs):
        for k in (("a", "b") if i % 2 == 0 else ("b", "a")):
            c0, t0 = (thread_cpu(pids[k]) if pids else {}), time.perf_counter()
            got[k].append(asyncio.run(reading(urls[k], models[k], i, args.clients, args.max_tokens)))
            wall[k] += time.perf_counter() - t0
            if pids:
                for th, sec in thread_cpu(pids[k]).items():
                    cpu[k][th] = cpu[k].get(th, 0.0) + sec - c0.get(th, 0.0)
        print(f"pair {i + 1}/{args.pairs}: A {got['a'][-1]['tok_s']:.1f}  B {got['b'][-1]['tok_s']:.1f} tok/s",
              flush=True)
    from scipy import stats

    la = np.log([r["tok_s"] for r in got["a"]])
    lb = np.log([r["tok_s"] for r in got["b"]])
    d = lb - la
    se = float(d.std(ddof=1) / np.sqrt(len(d)))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * se
    summary = {"ratio_b_over_a": float(np.exp(d.mean())), "se_log": se,
               "ci95": [float(np.exp(d.mean() - half)), float(np.exp(d.mean() + half))],
               "pairs_b_ge_a": int((d >= 0).sum()), "corr": float(np.corrcoef(la, lb)[0, 1])}
    for k in urls:
        rs = got[k]
        summary[k] = {"url": urls[k], "model": models[k],
                      "tok_s_median": float(np.median([r["tok_s"] for r in rs])),
                      "cv": float(np.std([r["tok_s"] for r in rs]) / np.mean([r["tok_s"] for r in rs])),
                      "ttft_ms_median": 1e3 * float(np.median([r["ttft_s"] for r in rs])),
                      "decode_tok_s_median": float(np.median([r["decode_tok_s"] for r in rs
                                                              if r["decode_tok_s"] is not None]))}
    print("\n| server | median tok/s | cv | TTFT p50 ms | decode tok/s |\n|---|---|---|---|---|")
    for k in urls:
        s = summary[k]
        print(f"| {k.upper()} {s['url']} | {s['tok_s_median']:.1f} | {s['cv']:.3f} | {s['ttft_ms_median']:.1f} | "
              f"{s['decode_tok_s_median']:.1f} |")
    if pids:
        for k in urls:
            shares = {th: sec / wall[k] for th, sec in cpu[k].items() if sec / wall[k] >= 0.002}
            summary[k]["thread_cpu_share"] = shares
            print(f"{k.upper()} threads, CPU time / wall time: " +
                  ", ".join(f"{th} {v:.1%}" for th, v in sorted(shares.items(), key=lambda kv: -kv[1])))
    print(f"\nB / A = {summary['ratio_b_over_a']:.3f} ± {se:.3f} (standard error of the log ratio), 95% interval "
          f"[{summary['ci95'][0]:.3f}, {summary['ci95'][1]:.3f}], {summary['pairs_b_ge_a']}/{args.pairs} pairs B ≥ A, "
          f"correlation of a pair's readings {summary['corr']:.2f} ({args.pairs} pairs, {args.clients} client(s), "
          f"{args.max_tokens} tokens)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "summary": summary, "readings": got}, indent=2))
        print(f"written {out}")


if __name__ == "__main__":
    main()
