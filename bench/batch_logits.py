"""One-token against batched logits: why greedy speculative output can leave plain greedy's path.

For each model file: the same n positions after a 60-token code prefix, evaluated one at a time and as
one batch of n (the shape verification uses), at the given threads: the largest |logit difference| and
whether every argmax agrees. llama.cpp's repacked CPU kernels compute one row (gemv) and several rows
(gemm) differently for some types; where they differ, greedy speculative decoding may leave plain
greedy's path at a near-tie (sampling stays exact with respect to the logits the verification sees).

    python bench/batch_logits.py FILE.gguf [FILE.gguf ...] [--threads 1] [--ns 2,3,4,5,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workloads import CODE_PROMPTS  # noqa: E402


def measure(path: str, threads: int, ns: list[int]) -> list[dict]:
    import edgerun

    rt = edgerun.load(path, draft="none", n_threads=threads, n_ctx=1024)
    try:
        t = rt.target
        toks = rt.tokenize(CODE_PROMPTS[0] * 4)[:60 + max(ns)]
        pre, nxt = toks[:60], toks[60:]
        out = []
        for n in ns:
            t.truncate(0)
            t.eval(pre, n_logits=0)
            one = np.concatenate([t.eval([x]) for x in nxt[:n]])      # [n, V], one position per eval
            t.truncate(len(pre))
            bat = t.eval(nxt[:n])                                    # [n, V], one eval
            out.append({"n": n, "max_abs_diff": float(np.abs(one - bat).max()),
                        "argmax_equal": bool((one.argmax(1) == bat.argmax(1)).all())})
        return out
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ns", default="2,3,4,5,8")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_logits.json"))
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    res = {f: measure(f, args.threads, ns) for f in args.files}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "results": res}, indent=1))
    print(f"\n| file ({args.threads} thread(s)) | " + " | ".join(f"n={n}" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for f, rows in res.items():
        print(f"| {Path(f).name} | " + " | ".join(f"{r['max_abs_diff']:.3f}{'' if r['argmax_equal'] else ' (argmax differs)'}"
                                              for r in rows) + " |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
