"""Per-cycle cost of the gamma tuner and the prompt-lookup hint, on a 700-token SmolLM2-like context.

    python bench/tuner_overhead.py [--cycles 2000]

Prints microseconds per call of: the lookup hint with its index rebuilt (what a new generation pays
once), the incremental hint (one token appended per cycle, as in the
decode loop), GammaTuner.choose and GammaTuner.observe. No model is loaded; pure Python/numpy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgerun.device.cost import CostCurve# noqa: E402
from edgerun.spec.drafters import PromptLookupDrafter# noqa: E402
from edgerun.spec.gamma import GammaTuner# noqa: E402


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=2000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    text = rng.integers(0, 49152, size=350).tolist()
    ctx = text + text[:350]                     # 700 tokens, copy-heavy like a summarise prompt
    d = PromptLookupDrafter()

    def rescan():
        d.reset()
        d.hint(ctx)

    grow = list(ctx)

    def incremental():
        grow.append(int(rng.integers(0, 49152)))
        d.hint(grow)

    t = GammaTuner(CostCurve(tuple(0.01 * (1 + 0.9 * i) for i in range(9)), 6e-5), 8, n_classes=6)
    rows = {"hint, index rebuilt": per_call(rescan, max(a.cycles // 10, 10)),
            "hint, incremental": per_call(incremental, a.cycles),
            "GammaTuner.choose": per_call(lambda: t.choose(3), a.cycles),
            "GammaTuner.observe": per_call(lambda: t.observe(0, 0, 0.0, 0.01), a.cycles)}
    for k, v in rows.items():
        print(f"{k:<22}{v:>8.1f} us")


if __name__ == "__main__":
    main()
