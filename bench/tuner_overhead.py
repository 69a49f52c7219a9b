"""Per-cycle cost of the gamma tuner and the prompt-lookup hint, on a 700-token SmolLM2-like context.

    python bench/tuner_overhead.py [--cycles 2000]

Prints microseconds per call of: the lookup hint with its index rebuilt (what a new generation pays
once), the incremental hint (one token appended per cycle, as in the
decode loop), GammaTuner.choose and GammaTuner.observe. Then one cycle of a model drafter's sequence in a
batch of 4 (the Qwen2.5-Coder-1.5B@spec pair's curve probed on a 2-core Zen 3, where no draft pays in such a
batch), both ways: asking the drafter's hint (margin_class over 151,936 logits) and BatchedGamma.choose, and
BatchedGamma.plain_cycle, which answers first (docs/batching.md). No model is loaded; pure Python/numpy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgerun.device.cost import CostCurve# noqa: E402
from edgerun.speculative.drafters import PromptLookupDrafter, margin_class  # noqa: E402
from edgerun.speculative.gamma import BatchedGamma, GammaTuner  # noqa: E402

QWEN_SPEC_CURVE = CostCurve((0.0405, 0.0713, 0.1008, 0.1014, 0.1314, 0.1589, 0.1910, 0.2019, 0.2209), 0.0145)


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

    logits = rng.standard_normal(151936).astype(np.float32)
    asked = BatchedGamma(GammaTuner(QWEN_SPEC_CURVE, 8, n_classes=4), lambda: 4)
    plain = BatchedGamma(GammaTuner(QWEN_SPEC_CURVE, 8, n_classes=4), lambda: 4)

    def cycle_asked():
        g = asked.choose(margin_class(logits), 1)
        asked.observe(g, 0, 0.0, 0.1)

    def cycle_plain():
        g = 0 if plain.plain_cycle(1) else plain.choose(margin_class(logits), 1)
        plain.observe(g, 0, 0.0, 0.1)

    for _ in range(3):                          # alternating, so the machine's drift hits both alike
        rows["batch of 4: hint + choose"] = min(rows.get("batch of 4: hint + choose", 1e9), per_call(cycle_asked, a.cycles))
        rows["batch of 4: plain_cycle"] = min(rows.get("batch of 4: plain_cycle", 1e9), per_call(cycle_plain, a.cycles))
    for k, v in rows.items():
        print(f"{k:<28}{v:>8.1f} us")


if __name__ == "__main__":
    main()
