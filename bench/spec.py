"""Speculative decoding on this machine: plain decoding vs fixed gamma, measured in one run.

For each scenario and prompt: greedy decoding of --tokens tokens with gamma 0 (plain) and each fixed
gamma. Per run: decode tokens/s (prefill excluded), acceptance rate alpha, mean accepted drafts per
cycle, draft and verify time per cycle, whether the output equals plain greedy, and Leviathan et
al.'s prediction from the measured alpha and times:

    tokens per cycle  E = (1 - alpha^(gamma+1)) / (1 - alpha)
    predicted tok/s   = sum of E over the cycles / (time drafting + time verifying, measured in this run)

alpha is Leviathan's per-token acceptance probability, estimated as accepted / (accepted + rejected)
(a cycle that stops at a rejection never looks at its later drafts); `acceptance_rate` in the JSON
is edgerun's accepted / drafted. A cycle's gamma is what the drafter actually drafted (prompt
lookup drafts fewer tokens, or none, when it finds no match).

so `measured / predicted` shows what the loop spends outside drafting and verifying.

Scenarios (all registry models, pulled into the cache on first use):
  code      qwen2.5-coder-1.5b-instruct + qwen2.5-coder-0.5b-instruct drafter, code-completion prompts
  prose     the same pair on chat (prose) prompts
  q4draft   the same pair with the drafter requantized to Q4_0 by llama.cpp's llama-quantize (--tools)
  lookup    smollm2-135m-instruct + the prompt-lookup drafter on a summarise-this-text prompt
  selfcheck each model as its own drafter (gamma 4): accepts 100% and equals plain greedy only where
            batched and single-token logits agree bit for bit (flash attention, non-K-quant weights)
  peer      llama.cpp's llama-speculative-simple (--tools) on the code/prose pair, prompts, threads and
            gammas; ratio = edgerun tok/s / llama.cpp tok/s

    nice python bench/spec.py [--tokens 128] [--threads 2] [--gammas 1,2,3,4,6,8]
        [--scenarios code,prose,q4draft,lookup,selfcheck,peer] [--tools DIR_WITH_LLAMA_CPP_BINARIES]

The llama.cpp tools are built (never committed) from the llama-cpp-python sdist's vendored tree:
`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36`, then in vendor/llama.cpp
`cmake -B build -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF && cmake --build build -j2 --target
llama-speculative-simple llama-quantize`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from harness import arg_parser, print_table, write_result  # noqa: E402
from workloads import CODE_PROMPTS, DRAFT, SMALL, TARGET, summarise_prompt  # noqa: E402

PROSE_MESSAGES = [
    [{"role": "user", "content": "Explain in a few paragraphs what a hash table is, how it handles "
                                 "collisions, and when a programmer should prefer a balanced tree instead."}],
    [{"role": "user", "content": "Write a short essay about why software projects are often late, and "
                                 "what teams can do about it."}],
]


def summarise_messages() -> list[list[dict]]:
    return [[{"role": "user", "content": summarise_prompt()}]]


# ---------------------------------------------------------------------------------- edgerun runs

def leviathan_tokens_per_cycle(alpha: float, gamma: int) -> float:
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def cycles_of(steps) -> list[tuple[int, int]]:
    """(gamma, n_accepted) of each cycle, read back from the Steps (a cycle yields n_accepted + 1)."""
    out, i = [], 0
    while i < len(steps):
        out.append((steps[i].gamma, steps[i].n_accepted))
        i += steps[i].n_accepted + 1
    return out


def run_one(rt, prompt_tokens: list[int], n: int, gamma: int) -> dict:
    from edgerun.generate import GenStats

    st = GenStats()
    steps = list(rt.stream_tokens(prompt_tokens, max_tokens=n, temperature=0.0, gamma=gamma, stats=st))
    r = {"gamma": gamma, "n_tokens": st.n_tokens, "tok_s": st.tokens_per_s, "n_cycles": st.n_cycles,
         "acceptance_rate": st.acceptance_rate, "mean_accepted_per_cycle": st.mean_accepted_per_cycle,
         "accept_histogram": st.accept_histogram, "t_decode_s": st.t_total_s - st.t_prefill_s,
         "t_draft_s": st.t_draft_s, "t_verify_s": st.t_verify_s, "tokens": [x.token for x in steps]}
    if gamma > 0 and st.n_cycles:
        cyc = cycles_of(steps)
        # Leviathan's alpha: probability that a drafted token is accepted given the earlier ones were;
        # each cycle shows its accepted drafts plus one rejection unless it accepted all it drafted
        n_acc = sum(a for _, a in cyc)
        n_rej = sum(1 for g, a in cyc if a < g)
        alpha = n_acc / (n_acc + n_rej) if n_acc + n_rej else 0.0
        e = sum(leviathan_tokens_per_cycle(alpha, g) for g, _ in cyc)      # predicted tokens, all cycles
        t_cycles = st.t_draft_s + st.t_verify_s
        r.update(alpha=alpha, mean_drafted_per_cycle=sum(g for g, _ in cyc) / len(cyc),
                 t_draft_cycle_ms=1e3 * st.t_draft_s / st.n_cycles, t_verify_cycle_ms=1e3 * st.t_verify_s / st.n_cycles,
                 tokens_per_cycle=len(steps) / len(cyc), predicted_tokens_per_cycle=e / len(cyc),
                 predicted_tok_s=e / t_cycles)
        r["measured_over_predicted"] = r["tok_s"] / r["predicted_tok_s"]
    return r


def sweep(rt, name: str, prompts: list[list[int]], gammas: list[int], n: int, peer=None) -> list[dict]:
    """Per prompt: a plain run right before each speculative run (the machine's speed drifts; each
    speedup is against its neighbour), and the peer right after it."""
    import statistics

    rows = []
    for pi, prompt in enumerate(prompts):
        run_one(rt, prompt, 8, 0)                              # warm-up: page in weights, fill the prefix cache
        plains, spec_rows = [], []
        for g in gammas:
            plain = run_one(rt, prompt, n, 0)
            plains.append(plain)
            r = run_one(rt, prompt, n, g)
            r.update(scenario=name, prompt=pi, plain_tok_s=plain["tok_s"], speedup=r["tok_s"] / plain["tok_s"],
                     predicted_speedup=r["predicted_tok_s"] / plain["tok_s"],
                     same_as_plain=r["tokens"] == plain["tokens"][:len(r["tokens"])])
            if peer is not None:
                p = peer(pi, g)
                r["peer"] = p
                if p.get("tok_s"):
                    r["edgerun_over_peer"] = r["tok_s"] / p["tok_s"]
            spec_rows.append(r)
            log_row(r)
        base = dict(plains[0])
        base.update(scenario=name, prompt=pi, tok_s=statistics.median(x["tok_s"] for x in plains),
                    plain_tok_s_runs=[x["tok_s"] for x in plains], speedup=1.0, same_as_plain=True)
        rows += [base, *spec_rows]
    return rows


def log_row(r: dict) -> None:
    extra = ""
    if r["gamma"]:
        extra = (f" alpha {r['alpha']:.2f} pred {r['predicted_tok_s']:.1f} "
                 f"meas/pred {r['measured_over_predicted']:.2f} same {r['same_as_plain']}")
        if "peer" in r:
            extra += f" peer {r['peer'].get('tok_s', float('nan')):.1f}"
    print(f"  [{r['scenario']} p{r['prompt']} g{r['gamma']}] {r['tok_s']:.1f} tok/s (plain {r['plain_tok_s']:.1f}){extra}",
          file=sys.stderr,
          flush=True)


# ---------------------------------------------------------------------------------- llama.cpp peer

def peer_runner(tools: Path, target: Path, draft: Path, prompt_texts: list[str], n: int, threads: int):
    exe = tools / "llama-speculative-simple"

    def run(pi: int, gamma: int) -> dict:
        cmd = [str(exe), "-m", str(target), "-md", str(draft), "-p", prompt_texts[pi], "-n", str(n),
               "-t", str(threads), "-tb", str(threads), "-c", "4096", "-fa", "on", "--temp", "0",
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0",
               "--spec-draft-p-min", "0", "-ngl", "0", "-ngld", "0", "--seed", "1"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        out = proc.stdout + proc.stderr
        res = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0}
        m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s", out)
        if m:
            res.update(n_tokens=int(m.group(1)), t_s=float(m.group(2)), tok_s=float(m.group(3)))
        for key in ("n_drafted", "n_accept", "accept"):
            m = re.search(rf"\b{key}\s*=\s*([\d.]+)", out)
            if m:
                res[key] = float(m.group(1))
        if proc.returncode != 0 or "tok_s" not in res:
            res["log_tail"] = out[-1500:]
        return res

    return run


def batched_vs_single(backend, tokens: list[int], n: int = 8) -> float:
    """Largest |logit difference| between one batched eval of the last n positions and n single-token evals."""
    import numpy as np

    k = len(tokens) - n
    backend.truncate(0)
    backend.eval(tokens[:k], n_logits=0)
    batched = backend.eval(tokens[k:])                                   # [n, V]
    backend.truncate(k)
    single = np.concatenate([backend.eval([t]) for t in tokens[k:]])     # [n, V]
    backend.truncate(0)
    return float(np.abs(batched - single).max())


def requantize_q4_0(tools: Path, src: Path, dst: Path, threads: int) -> Path:
    if not dst.exists():
        tmp = dst.with_suffix(".tmp.gguf")
        subprocess.run([str(tools / "llama-quantize"), "--allow-requantize", str(src), str(tmp), "Q4_0",
                        str(threads)], check=True, capture_output=True)
        os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------------------------- main

def main() -> None:
    ap = arg_parser(__doc__, tokens=128, threads=2, ctx=4096, gammas="1,2,3,4,6,8", out="spec")
    ap.add_argument("--scenarios", default="code,prose,q4draft,lookup,selfcheck,peer")
    ap.add_argument("--tools", default=None, help="directory with llama-speculative-simple and llama-quantize")
    ap.add_argument("--summarise", metavar="JSON", help="only print the markdown summary of an earlier run")
    a = ap.parse_args()
    if a.summarise:
        print(summary_markdown(json.loads(Path(a.summarise).read_text())))
        return
    gammas = [int(g) for g in a.gammas.split(",")]
    scen = set(a.scenarios.split(","))
    tools = Path(a.tools) if a.tools else None
    if tools is None and scen & {"q4draft", "peer"}:
        print("note: --tools not given: skipping q4draft and peer", file=sys.stderr)
        scen -= {"q4draft", "peer"}

    import edgerun
    from edgerun.registry.cache import cache_dir
    from edgerun.resolve import resolve_model

    # a fixed gamma at load time: no gamma tuner (and no cost-curve probe); each run sets its own gamma
    common = dict(n_threads=a.threads, n_ctx=a.ctx, flash_attn=True, profile="generic-x86_64-cpu", gamma=4)
    result: dict = {"threads": a.threads, "tokens": a.tokens, "gammas": gammas, "greedy": True,
                    "loadavg_start": os.getloadavg(), "rows": [], "selfcheck": []}
    t_start = time.perf_counter()

    if scen & {"code", "prose", "q4draft", "peer"}:
        rt = edgerun.load(TARGET, draft=DRAFT, **common)
        code = [rt.tokenize(p) for p in CODE_PROMPTS]
        prose_text = [rt.tokenizer.apply_chat_template(m) for m in PROSE_MESSAGES]
        prose = [rt.tokenizer.chat_prompt_tokens(m) for m in PROSE_MESSAGES]
        if "peer" in scen:
            peer_code = peer_runner(tools, resolve_model(TARGET), resolve_model(DRAFT), CODE_PROMPTS, a.tokens,
                                    a.threads)
            peer_prose = peer_runner(tools, resolve_model(TARGET), resolve_model(DRAFT), prose_text, a.tokens,
                                     a.threads)
        if "code" in scen or "peer" in scen:
            result["rows"] += sweep(rt, "code", code, gammas, a.tokens, peer_code if "peer" in scen else None)
        if "prose" in scen or "peer" in scen:
            result["rows"] += sweep(rt, "prose", prose, gammas, a.tokens, peer_prose if "peer" in scen else None)
        rt.close()
        if "q4draft" in scen:
            q4 = requantize_q4_0(tools, resolve_model(DRAFT), cache_dir() / "models" / "bench-qwen2.5-coder-0.5b-q4_0.gguf",
                                 a.threads)
            rt = edgerun.load(TARGET, draft=str(q4), **common)
            result["rows"] += sweep(rt, "q4draft-code", code, gammas, a.tokens)
            result["rows"] += sweep(rt, "q4draft-prose", prose, gammas, a.tokens)
            rt.close()

    if "lookup" in scen:
        rt = edgerun.load(SMALL, draft="lookup", **common)
        prompts = [rt.tokenizer.chat_prompt_tokens(m) for m in summarise_messages()]
        result["rows"] += sweep(rt, "lookup", prompts, gammas, a.tokens)
        rt.close()

    if "selfcheck" in scen:
        models = [SMALL, DRAFT, TARGET]
        q4 = cache_dir() / "models" / "bench-qwen2.5-coder-0.5b-q4_0.gguf"
        if q4.exists():
            models.append(str(q4))
        for m in models:
            rt = edgerun.load(m, draft=str(resolve_model(m)), **common)
            prompt = rt.tokenize(CODE_PROMPTS[0])
            plain = run_one(rt, prompt, 64, 0)
            r = run_one(rt, prompt, 64, 4)
            row = {"model": m, "acceptance_rate": r["acceptance_rate"], "same_as_plain": r["tokens"] == plain["tokens"],
                   "first_divergence": next((i for i, (x, y) in enumerate(zip(r["tokens"], plain["tokens"])) if x != y),
                                            None),
                   "max_logit_diff_batched_vs_single": batched_vs_single(rt.target, prompt + plain["tokens"])}
            print(f"  [selfcheck {m}] {row}", file=sys.stderr, flush=True)
            result["selfcheck"].append(row)
            rt.close()

    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t_start
    for r in result["rows"]:
        r.pop("tokens", None)
    write_result(Path(a.out), result)
    print_tables(result)
    print()
    print(summary_markdown(result))


def summary_markdown(result: dict) -> str:
    """Per scenario and gamma, over its prompts: median speedup, mean alpha, measured/predicted range,
    runs equal to plain greedy, median edgerun/llama.cpp ratio."""
    import statistics

    lines = ["| scenario | gamma | speedup vs plain (median) | alpha | measured / Leviathan | = plain greedy "
             "| edgerun / llama.cpp |", "|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["scenario"], r["gamma"]), []).append(r)
    for (scen, g), rows in groups.items():
        if g == 0:
            lines.append(f"| {scen} | 0 (plain) | 1.00 ({statistics.median(r['tok_s'] for r in rows):.1f} tok/s) "
                         f"| | | | |")
            continue
        mp = [r["measured_over_predicted"] for r in rows]
        ratios = [r["edgerun_over_peer"] for r in rows if "edgerun_over_peer" in r]
        lines.append(f"| {scen} | {g} | {statistics.median(r['speedup'] for r in rows):.2f} "
                     f"| {statistics.mean(r['alpha'] for r in rows):.2f} | {min(mp):.2f}-{max(mp):.2f} "
                     f"| {sum(r['same_as_plain'] for r in rows)}/{len(rows)} "
                     f"| {f'{statistics.median(ratios):.2f}' if ratios else '-'} |")
    return "\n".join(lines)


def print_tables(result: dict) -> None:
    print(f"threads {result['threads']}, {result['tokens']} tokens greedy; load average "
          f"{result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}")
    rows = []
    for r in result["rows"]:
        spec = [r["alpha"], r["mean_accepted_per_cycle"], r["t_draft_cycle_ms"], r["t_verify_cycle_ms"],
                r["predicted_tok_s"], r["measured_over_predicted"], "yes" if r["same_as_plain"] else "NO"] \
            if r["gamma"] else [None] * 7
        peer = r.get("peer", {})
        rows.append([r["scenario"], str(r["prompt"]), str(r["gamma"]), r["tok_s"], r["speedup"], *spec,
                     peer.get("tok_s"), r.get("edgerun_over_peer") if peer.get("tok_s") else None])
    print_table(["scenario", "p", "g", "tok/s", "speedup", "alpha", "acc/cyc", "draft ms", "verify ms", "pred tok/s",
                 "meas/pred", "=plain", "llama.cpp", "ratio"], rows)
    for s in result["selfcheck"]:
        print(f"self-draft {s['model']}: acceptance {s['acceptance_rate']:.3f}, equals plain: {s['same_as_plain']}, "
              f"max |batched - single-token logit| {s['max_logit_diff_batched_vs_single']:.3g}"
              + (f" (first divergence at token {s['first_divergence']})" if s["first_divergence"] is not None else ""))


if __name__ == "__main__":
    main()
