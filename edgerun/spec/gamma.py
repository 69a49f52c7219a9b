"""Draft-length policies. The decode loop asks `choose()` before each cycle and reports with `observe()`.

FixedGamma is the trivial policy; GammaTuner (cost model + online acceptance) lives here too.
"""

from __future__ import annotations


class FixedGamma:
    """Always draft `gamma` tokens (0 = plain decoding)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def choose(self) -> int:
        return self.gamma

    def observe(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float) -> None:
        pass
