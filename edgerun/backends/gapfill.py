"""GapChooser: whether to fill a gap in a batch's sequence ids or let llama.cpp split there, learned by timing.

With one KV stream per sequence llama.cpp cuts a batch into ubatches with split_equal(sequential), which
starts a new ubatch at every gap in the ids: single rows of sequences 0, 1 and 3 run as two passes over
the weights. The backend can instead give the idle sequence in the gap throw-away rows (one pass of a few
more rows). Which is faster depends on the device and the model, and the probe's cost curve does not say
(it prices rows *with* logits; filler rows have none): on the 2-core AMD Zen 3 development CPU, filling won
for SmolLM2 in every shape measured and for Qwen-1.5B in two of three (bench/batch_steps.py). So each
shape is timed both ways a few times, then the faster median is used, with a re-check now and then.
"""

from __future__ import annotations

import statistics
from collections import deque

Shape = tuple[int, int, int]          # (sequences with rows, sequences in the gaps, rows per sequence)


class GapChooser:
    def __init__(self, trials: int = 3, recheck_every: int = 64, window: int = 8) -> None:
        self.trials = trials                  # timed decodes of each way before choosing
        self.recheck_every = recheck_every    # then the other way once every this many decodes of the shape
        self._times: dict[Shape, dict[bool, deque]] = {}
        self._seen: dict[Shape, int] = {}
        self._window = window

    def _of(self, shape: Shape) -> dict[bool, deque]:
        return self._times.setdefault(shape, {True: deque(maxlen=self._window), False: deque(maxlen=self._window)})

    def fill(self, shape: Shape) -> bool:
        """True: fill the gap for this decode; False: let llama.cpp split."""
        t = self._of(shape)
        n = self._seen[shape] = self._seen.get(shape, 0) + 1
        if len(t[True]) < self.trials or len(t[False]) < self.trials:
            return len(t[True]) <= len(t[False])                    # alternate until both have their trials
        best = statistics.median(t[True]) < statistics.median(t[False])
        return (not best) if n % self.recheck_every == 0 else best

    def observe(self, shape: Shape, filled: bool, seconds: float) -> None:
        self._of(shape)[filled].append(seconds)

    def learned(self) -> dict[str, dict]:
        """What was measured, per shape (for benches and logs)."""
        return {f"{s[0]} seqs + {s[1]} gap x {s[2]} rows": {
            "fill_ms": 1e3 * statistics.median(t[True]) if t[True] else None,
            "split_ms": 1e3 * statistics.median(t[False]) if t[False] else None}
            for s, t in self._times.items()}
