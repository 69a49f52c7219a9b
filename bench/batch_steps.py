"""Where a batched server's time goes: every batched evaluation of N concurrent chat requests (in one
process, no HTTP), against the same evaluation shape measured alone.

    python bench/batch_steps.py [--model smollm2-135m-instruct] [--slots 4] [--threads 2] [--rounds 3]

Part 1 runs `--slots` concurrent greedy chat requests (bench/serve.py's prompts, 2 per slot, 64 tokens)
through `Runtime.slots()` and records, per batched evaluation, its shape (sequences, rows) and the time in
`eval_rows` and in `llama_decode` itself; it prints the wall time, the share inside llama_decode and the
median time per shape. Part 2 evaluates the most frequent shape (one row per sequence) on the same
backend twice, with sequences at 40-130 positions, with
nothing else running, and a few uneven shapes (one sequence verifying 4 rows beside single rows: two
passes in llama.cpp), and sequence ids with a gap (filled by the backend, against split at the gap).
Writes bench/results/batch_steps.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from serve import PROMPTS  # noqa: E402

from edgerun import llama_lib  # noqa: E402
from edgerun.runtime import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="none", help="drafter (a model: its batched evaluations are shown too)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_steps.json"))
    a = ap.parse_args()
    rt = load(a.model, draft=a.draft, n_threads=a.threads, n_ctx=1024, parallel=a.slots, pull=False)
    slots = rt.slots()
    group = slots[0].group
    be = group.backends[-1]                    # the target (a drafter's context comes first)
    L = llama_lib.lib()
    decode = L.llama_decode
    originals = {id(b): b.eval_rows for b in group.backends}
    log: list = []
    dec: list = []

    def timed_decode(ctx, batch):
        t = time.perf_counter()
        rc = decode(ctx, batch)
        dec.append(time.perf_counter() - t)
        return rc

    def timed(b, label):
        def timed_eval(rows):
            t = time.perf_counter()
            out = originals[id(b)](rows)
            log.append((label, len(rows), sum(len(r[1]) for r in rows), time.perf_counter() - t))
            return out
        return timed_eval

    L.llama_decode = timed_decode
    for b in group.backends:
        b.eval_rows = timed(b, "target" if b is be else "drafter")
    res: dict = {"args": vars(a), "rounds": []}

    def serve(i: int, s) -> None:
        for j in range(2):
            s.chat([{"role": "user", "content": PROMPTS[(2 * i + j) % len(PROMPTS)]}], max_tokens=64, temperature=0)

    for r in range(a.rounds):
        log.clear()
        dec.clear()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=serve, args=(i, s)) for i, s in enumerate(slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        shapes = collections.defaultdict(list)
        for label, seqs, rows, dt in log:
            shapes[(label, seqs, rows)].append(dt)
        row = {"wall_s": wall, "eval_s": sum(x[3] for x in log), "decode_s": sum(dec), "evals": len(log),
               "shapes": {f"{k[0]}: {k[1]} seqs x {k[2]} rows": {"n": len(v), "median_ms": 1e3 * float(np.median(v)),
                                                                  "total_s": float(np.sum(v))}
                          for k, v in sorted(shapes.items())}}
        res["rounds"].append(row)
        print(f"round {r}: wall {wall:.2f} s, {row['decode_s'] / wall:.0%} inside llama_decode, {len(log)} evals")
        for k, v in row["shapes"].items():
            if v["n"] > 2 or v["total_s"] > 0.05 * wall:
                print(f"   {k}: {v['n']} evals, median {v['median_ms']:.2f} ms, total {v['total_s']:.2f} s")
    L.llama_decode = decode
    for b in group.backends:
        b.eval_rows = originals[id(b)]
    rng = np.random.default_rng(0)
    alone = {}
    # (eval_rows of a multi-sequence context always runs on the engine thread: engine/thread.py on_engine)
    for where in ("once", "again"):
        for s in range(a.slots):
            be.truncate_seq(s, 0)
            be.eval_rows([(s, [int(x) for x in rng.integers(100, 20000, 40)], 1)])
        ts = []
        for _ in range(90):
            rows = [(s, [int(rng.integers(100, 20000))], 1) for s in range(a.slots)]
            t = time.perf_counter()
            be.eval_rows(rows)
            ts.append(time.perf_counter() - t)
        alone[where] = 1e3 * float(np.median(ts))
        print(f"alone, {where}: {a.slots} seqs x 1 row, median {alone[where]:.2f} ms")
    res["alone_ms"] = alone
    # uneven rows: llama.cpp's split_equal gives every sequence of a ubatch the same rows, so a sequence
    # verifying 4 rows beside 3 single rows costs about two passes (4 x 1, then 3 rows of one sequence)
    shapes = {"4 seqs x 1 row": [(0, 1), (1, 1), (2, 1), (3, 1)], "1 seq x 3 rows": [(0, 3)],
              "seq 0 x 4 rows + 3 seqs x 1 row": [(0, 4), (1, 1), (2, 1), (3, 1)],
              "4 seqs x 2 rows (one pass)": [(0, 2), (1, 2), (2, 2), (3, 2)]}
    uneven = {}
    if a.slots >= 4:
        for name, shape in shapes.items():
            ts = []
            for _ in range(40):
                rows = [(s, [int(x) for x in rng.integers(100, 20000, k)], k) for s, k in shape]
                t = time.perf_counter()
                be.eval_rows(rows)
                ts.append(time.perf_counter() - t)
                for s, _k in shape:
                    be.truncate_seq(s, 40)
            uneven[name] = 1e3 * float(np.median(ts))
            print(f"alone, {name}: median {uneven[name]:.2f} ms")
    res["uneven_ms"] = uneven
    # ids with a gap (an idle slot between busy ones): llama.cpp would start a new ubatch at the gap; the
    # backend fills it with throw-away rows instead (one pass). Measured both ways, interleaved.
    # what the backend's GapChooser learned in the concurrent runs above, then both ways forced (fill_gaps
    # True / False), interleaved
    res["gap_learned"] = be.gaps.learned()
    print(f"gap shapes timed in the concurrent runs: {res['gap_learned'] or 'none (no gap in the busy ids)'}")
    gaps = {}
    if a.slots >= 4:
        for name, ids in {"seqs 0, 1, 3 x 1 row": [0, 1, 3], "seqs 0, 3 x 1 row": [0, 3],
                          "seqs 0, 2 x 1 row": [0, 2]}.items():
            ts = {"gap filled": [], "split at the gap": []}
            for i in range(80):
                how = "gap filled" if i % 2 == 0 else "split at the gap"
                be.fill_gaps = how == "gap filled"
                rows = [(s, [int(rng.integers(100, 20000))], 1) for s in ids]
                t = time.perf_counter()
                be.eval_rows(rows)
                ts[how].append(time.perf_counter() - t)
                for s in ids:
                    be.truncate_seq(s, 40)
            gaps[name] = {k: 1e3 * float(np.median(v)) for k, v in ts.items()}
            print(f"alone, {name}: gap filled {gaps[name]['gap filled']:.2f} ms, split at the gap "
                  f"{gaps[name]['split at the gap']:.2f} ms (medians, interleaved)")
        be.fill_gaps = None
    res["gap_ms"] = gaps
    rt.close()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
