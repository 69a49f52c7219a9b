"""Decode speed on one thread while another thread's OpenMP team is alive (the reason for engine/thread.py on_engine).

llama.cpp's CPU backend runs each call on an OpenMP team of the calling thread; the team lives as long as
that thread. This times greedy one-token decode steps of one context on this thread three ways, in order:
alone; while a second thread that has evaluated once (so it has its own team, idle) is alive; after that
thread has ended. With libgomp and more of its threads than cores, waiting at a barrier spins only briefly
before sleeping, so the middle reading is expected to be the slow one on a small board.

    python bench/omp_teams.py --model smollm2-135m-instruct [--threads 2] [--steps 96] [--reps 3]
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from harness import arg_parser   # bench/harness.py (the script's directory is first on the path)

from edgerun.backends.llamacpp import LlamaCppBackend
from edgerun.config import BackendArgs
from edgerun.resolve import resolve_model


def main() -> None:
    ap = arg_parser(__doc__.split("\n")[0], model="smollm2-135m-instruct", threads=2, reps=3)
    ap.add_argument("--steps", type=int, default=96)
    args = ap.parse_args()
    be = LlamaCppBackend(resolve_model(args.model, pull=False),
                         BackendArgs(n_ctx=1024, n_threads=args.threads, flash_attn=True))
    prompt = be.tokenizer.tokenize("Write a short story about a robot who learns to paint. Once upon a time")

    def speed() -> float:
        be.truncate(0)
        be.eval(prompt, 1)
        tok, t0 = 100, time.perf_counter()
        for _ in range(args.steps):
            tok = int(np.argmax(be.eval([tok], 1)[-1]))
        return args.steps / (time.perf_counter() - t0)

    out = {"one team": [speed() for _ in range(args.reps)]}
    hold, ready = threading.Event(), threading.Event()

    def other() -> None:
        speed()                     # this thread now has a team of its own
        ready.set()
        hold.wait()
    th = threading.Thread(target=other)
    th.start()
    ready.wait()
    time.sleep(0.5)                 # past any spinning of that team
    out["another thread's team alive"] = [speed() for _ in range(args.reps)]
    hold.set()
    th.join()
    time.sleep(0.5)
    out["that thread ended"] = [speed() for _ in range(args.reps)]
    be.close()
    print("| condition | tok/s (each run) |\n|---|---|")
    for k, v in out.items():
        print(f"| {k} | {' / '.join(f'{x:.1f}' for x in v)} |")
    print(json.dumps({"model": args.model, "threads": args.threads, "steps": args.steps, "tok_s": out}))


if __name__ == "__main__":
    main()
