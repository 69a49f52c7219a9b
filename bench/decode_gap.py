"""The time between two evaluations of one streaming sequence: edgerun's Python on the critical path.

A lone client of `edgerun serve --parallel N` is one sequence generating alone in a batching group; between
two of its llama_decode calls run the engine's epilogue (logits), the hand-back to the slot's decode loop,
sampling, the Step and its hand-off to the event loop, and the next evaluation's set-up. For a 135M model
that is a few percent of a ~10 ms step (docs/batching.md, "Between two evaluations"). This bench loads the
model with `parallel` sequences in a fresh process per run, generates greedily on one slot with each Step
handed to a uvloop event loop as the server does, times every llama_decode call (a wrapper around it), and
reports the median gap between one decode's return and the next one's call, the median decode, and the CPU
time per generated token of the slots' threads and of the event loop's thread (thread CPU clocks): Python
that, on a 2-core board whose cores both run the model, comes out of the evaluations beside it.
With --clients N, N slots generate at once (the batch's gap). Each slot's stream runs as the server runs it
(`TokenStream.run` with a callback where the tree has it, iterated before that).

With several --src trees (e.g. a git worktree of an earlier commit), runs alternate between them (one
process each), so the machine's drift hits all alike. Writes JSON (--out) and prints a table.

    python bench/decode_gap.py [--model smollm2-135m-instruct] [--tokens 256] [--runs 6] [--threads 2]
        [--clients 1] [--parallel 4] [--src DIR] [--src DIR2] [--out bench/results/decode_gap.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a robot who learns to paint."


def child(src: str, model: str, tokens: int, threads: int, parallel: int, repeats: int, clients: int = 1) -> dict:
    """One process: `repeats` rounds of `clients` generations at once (slots 0..clients-1, a thread each);
    per round the median gap and decode, and the round's tokens per second of wall time."""
    sys.path.insert(0, src)
    import asyncio
    import threading
    import time

    import numpy as np
    import uvloop

    import edgerun
    from edgerun import llama_lib

    try:                                       # trees before engine/ kept the hand-offs in util/
        from edgerun.engine.handoff import defer, flush
    except ImportError:
        try:
            from edgerun.util.handoff import defer, flush
        except ImportError:                    # trees before the hand-offs hand each Step over at once
            def defer(fn):
                fn()

            def flush():
                pass

    L = llama_lib.lib()
    raw = L.llama_decode
    times = {"gaps": [], "decodes": [], "last": None, "on": False}

    def timed(ctx, batch):
        t = time.perf_counter()
        if times["last"] is not None and times["on"]:
            times["gaps"].append(t - times["last"])
        try:
            return raw(ctx, batch)
        finally:
            times["last"] = time.perf_counter()
            if times["on"]:
                times["decodes"].append(times["last"] - t)

    L.llama_decode = timed
    rt = edgerun.load(model, draft=None, n_ctx=1024, n_threads=threads, pull=False, parallel=parallel)
    slots = rt.slots()[:clients]
    prompt = rt.tokenize(PROMPT)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    got: list = []
    out = []

    def run(slot, counts: list, lead: bool, cpu: list) -> None:
        slot.reset()
        c0 = time.thread_time()
        n = [0]

        def on_step(step) -> None:
            if n[0] == 4 and lead:             # past the prompts and the first steps
                times["on"] = True
            if n[0] == tokens - 8 and lead:    # before the first sequence ends (the batch stays full)
                times["on"] = False
            n[0] += 1
            defer(lambda st=step: loop.call_soon_threadsafe(got.append, st))

        stream = slot.stream_tokens(prompt, max_tokens=tokens, temperature=0)
        if hasattr(stream, "run"):             # as the server runs a slot's stream (trees since TokenStream)
            stream.run(on_step)
        else:
            for step in stream:
                on_step(step)
        flush()
        cpu.append(time.thread_time() - c0)
        counts.append(n[0])

    async def loop_cpu() -> float:
        return time.thread_time()

    for _ in range(repeats):
        times["gaps"].clear()
        times["decodes"].clear()
        times["last"] = None
        counts: list = []
        cpu: list = []
        ths = [threading.Thread(target=run, args=(s, counts, i == 0, cpu)) for i, s in enumerate(slots)]
        lc0 = asyncio.run_coroutine_threadsafe(loop_cpu(), loop).result()
        t0 = time.perf_counter()
        for th in ths:                             # as slot threads: not the thread that loaded
            th.start()
        for th in ths:
            th.join()
        wall = time.perf_counter() - t0
        lc1 = asyncio.run_coroutine_threadsafe(loop_cpu(), loop).result()
        out.append({"gap_us": 1e6 * float(np.median(times["gaps"])),
                    "decode_ms": 1e3 * float(np.median(times["decodes"])), "n": len(times["gaps"]),
                    "tok_s": sum(counts) / wall, "slot_cpu_us_per_token": 1e6 * sum(cpu) / sum(counts),
                    "loop_cpu_us_per_token": 1e6 * (lc1 - lc0) / sum(counts)})
    rt.close()
    return {"src": src, "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=6, help="processes per source tree (alternating)")
    ap.add_argument("--repeats", type=int, default=3, help="generations per process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", type=int, default=1, help="slots generating at once (at most --parallel)")
    ap.add_argument("--src", action="append", default=None, help="an edgerun source tree (default: this one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_gap.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.model, a.tokens, a.threads, a.parallel, a.repeats, a.clients)))
        return
    if not 1 <= a.clients <= a.parallel:
        print(f"error: --clients must be 1..--parallel ({a.parallel}), got {a.clients}", file=sys.stderr)
        raise SystemExit(2)
    srcs = [str(Path(s).resolve()) for s in (a.src or [str(ROOT)])]
    for s in srcs:
        if not (Path(s) / "edgerun" / "__init__.py").is_file():
            print(f"error: {s} is not an edgerun source tree (no edgerun/__init__.py)", file=sys.stderr)
            raise SystemExit(2)
    results: dict[str, list] = {s: [] for s in srcs}
    for r in range(a.runs):
        for s in (srcs if r % 2 == 0 else srcs[::-1]):
            cmd = [sys.executable, __file__, "--child", s, "--model", a.model, "--tokens", str(a.tokens),
                   "--threads", str(a.threads), "--parallel", str(a.parallel), "--repeats", str(a.repeats),
                   "--clients", str(a.clients)]
            p = subprocess.run(cmd, cwd=s, capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"the run of {s} failed")
            runs = json.loads(p.stdout.strip().splitlines()[-1])["runs"]
            results[s].extend(runs)
            print(f"run {r + 1}/{a.runs} {s}: gaps " + " ".join(f"{x['gap_us']:.0f}" for x in runs) + " us, "
                  + " ".join(f"{x['tok_s']:.1f}" for x in runs) + " tok/s", flush=True)
    summary = {s: {"gap_us_median": statistics.median(x["gap_us"] for x in v),
                   "slot_cpu_us_median": statistics.median(x.get("slot_cpu_us_per_token", float("nan")) for x in v),
                   "loop_cpu_us_median": statistics.median(x.get("loop_cpu_us_per_token", float("nan")) for x in v),
                   "decode_ms_median": statistics.median(x["decode_ms"] for x in v),
                   "tok_s_median": statistics.median(x["tok_s"] for x in v), "runs": v}
               for s, v in results.items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": summary}, indent=2))
    print(f"\n{a.model}, {a.threads} threads, parallel {a.parallel}, {a.clients} client(s) x {a.tokens} tokens, "
          f"{a.runs} processes x {a.repeats} generations per tree\n")
    print("| source | median gap between decodes (us) | median decode (ms) | gap / decode | tok/s (median) "
          "| slot threads' CPU per token (us) | event loop's CPU per token (us) |")
    print("|---|---|---|---|---|---|---|")
    for s, v in summary.items():
        print(f"| {s} | {v['gap_us_median']:.0f} | {v['decode_ms_median']:.2f} | "
              f"{v['gap_us_median'] / 1e3 / v['decode_ms_median']:.1%} | {v['tok_s_median']:.1f} "
              f"| {v['slot_cpu_us_median']:.0f} | {v['loop_cpu_us_median']:.0f} |")
    if len(srcs) == 2:
        # paired by round: the runs of the two trees alternate, so the i-th of each share the machine's drift
        ratios = [b["tok_s"] / a_["tok_s"] for a_, b in zip(summary[srcs[0]]["runs"], summary[srcs[1]]["runs"])]
        g = float(np.exp(np.mean(np.log(ratios))))
        print(f"tok/s second / first tree, geometric mean of {len(ratios)} paired rounds: {g:.3f} "
              f"({sum(r >= 1 for r in ratios)}/{len(ratios)} >= 1)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
