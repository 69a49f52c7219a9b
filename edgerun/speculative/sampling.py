"""Logits -> next-token distributions, and sampling from them.

The same transforms are applied to the target's and the drafter's logits, so speculative
decoding reproduces exactly the *transformed* target distribution.
Order (as llama.cpp's default chain): repetition penalty, top-k, temperature, top-p, min-p.

A distribution is a `Dist`: its support (ascending token ids) and their probabilities. After top-k
(the default keeps 40 of Qwen's 151,936 ids) or greedy decoding (one id) that is a few dozen numbers,
so neither the loop nor the drafter builds, scans or copies a vocabulary-sized float64 array per
position; `probs()` gives the same distribution as a dense vector where one is wanted (tests).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..config import SamplingArgs

log = logging.getLogger(__name__)

# top-k first finds a threshold from every _TOPK_STRIDE-th logit: the k-th largest of that subsample has
# at least k logits of the row at or above it, so those candidates (about k x stride of them) hold the k
# largest, and only they are partitioned. One comparison pass over the row instead of a partition of
# all of it; where the threshold is not finite (masked rows) or lets much of the row through, the whole
# row is partitioned. Either way the kept set is exactly the k largest.
_TOPK_STRIDE = 16


class Dist:
    """A distribution over V token ids kept as its support: idx [k] ascending ids (int64), w [k] their
    probabilities (float64, summing to 1; zeros allowed). Sampling from it draws what sampling from
    the dense vector draws, with the same one uniform."""

    __slots__ = ("idx", "w", "V")

    def __init__(self, idx: np.ndarray, w: np.ndarray, V: int) -> None:
        self.idx, self.w, self.V = idx, w, V

    @classmethod
    def point(cls, x: int, V: int) -> "Dist":
        return cls(np.array([x], dtype=np.int64), np.ones(1), V)

    @classmethod
    def from_dense(cls, p: np.ndarray) -> "Dist":
        idx = np.flatnonzero(p)
        return cls(idx, p[idx].astype(np.float64), int(p.shape[-1]))

    def at(self, x: int) -> float:
        """P(x)."""
        i = int(np.searchsorted(self.idx, x))
        return float(self.w[i]) if i < len(self.idx) and self.idx[i] == x else 0.0

    def at_many(self, xs: np.ndarray) -> np.ndarray:
        """P(x) for each id in xs [n] -> [n]."""
        i = np.minimum(np.searchsorted(self.idx, xs), len(self.idx) - 1)
        return np.where(self.idx[i] == xs, self.w[i], 0.0)

    def dense(self) -> np.ndarray:
        out = np.zeros(self.V, dtype=np.float64)
        out[self.idx] = self.w
        return out

    def sample(self, rng: np.random.Generator) -> int:
        """Draw one id (inverse CDF over the support; one uniform from rng)."""
        cum = np.cumsum(self.w)
        u = rng.random() * cum[-1]
        return int(self.idx[min(np.searchsorted(cum, u, side="right"), len(self.idx) - 1)])


def as_dist(p: "Dist | np.ndarray") -> Dist:
    return p if isinstance(p, Dist) else Dist.from_dense(np.asarray(p))


def dense_rows(rows: Sequence[Dist]) -> np.ndarray:
    """[len(rows), V] dense probabilities (for tests and inspection)."""
    return np.stack([r.dense() for r in rows])


def apply_repeat_penalty(logits: np.ndarray, context: Sequence[int], sampling: SamplingArgs) -> np.ndarray:
    """CTRL-style penalty on tokens seen in the last `repeat_last_n` context tokens (copy if changed)."""
    if sampling.repeat_penalty == 1.0 or sampling.repeat_last_n == 0 or not context:
        return logits
    recent = np.unique(np.asarray(context[-sampling.repeat_last_n:], dtype=np.int64))
    recent = recent[recent < logits.shape[-1]]
    out = logits.astype(np.float64, copy=True)
    vals = out[recent]
    out[recent] = np.where(vals > 0, vals / sampling.repeat_penalty, vals * sampling.repeat_penalty)
    return out


def penalised(sampling: SamplingArgs) -> bool:
    """Whether the repetition penalty reads the context (else any context gives the same result)."""
    return sampling.repeat_penalty != 1.0 and sampling.repeat_last_n != 0


def greedy_token(logits: np.ndarray, sampling: SamplingArgs, context: Sequence[int] = ()) -> int:
    """The token greedy decoding picks: argmax after the repetition penalty (all of dist()'s mass)."""
    return int(apply_repeat_penalty(logits, context, sampling).argmax())


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of x [V] (ties at the k-th value: any of them)."""
    V = x.shape[-1]
    step = min(_TOPK_STRIDE, V // (4 * k))
    if step >= 2:
        sub = x[::step]                                    # [V / step]
        v = np.partition(sub, len(sub) - k)[len(sub) - k]  # k-th largest of the subsample
        if np.isfinite(v):
            cand = np.flatnonzero(x >= v)                  # >= k entries (the subsample's own): holds the k largest
            n = len(cand)
            if n <= V // 8:
                return cand if n == k else cand[np.argpartition(x[cand], n - k)[n - k:]]
    return np.argpartition(x, V - k)[V - k:]


def dist(logits: np.ndarray, sampling: SamplingArgs, context: Sequence[int] = ()) -> Dist:
    """One row of logits [V] -> the next-token distribution after the sampling transforms. Greedy -> a
    point mass at the argmax."""
    V = logits.shape[-1]
    if sampling.greedy:
        return Dist.point(greedy_token(logits, sampling, context), V)
    x = apply_repeat_penalty(logits, context, sampling)
    # candidates: indices kept after top-k (all when top_k is 0 or >= V)
    idx = _top_k(x, sampling.top_k) if 0 < sampling.top_k < V else np.arange(V)
    z = x[idx].astype(np.float64) / sampling.temperature
    with np.errstate(invalid="ignore", over="ignore"):      # non-finite logits are caught below
        z = z - z.max()
        w = np.exp(z)
        w /= w.sum()
    keep = np.ones(len(idx), dtype=bool)
    if sampling.top_p < 1.0:
        order = np.argsort(-w, kind="stable")
        cum = np.cumsum(w[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = int(np.searchsorted(cum, sampling.top_p, side="left")) + 1
        keep[:] = False
        keep[order[:n_keep]] = True
    if sampling.min_p > 0.0:
        keep &= w >= sampling.min_p * w.max()
    w = np.where(keep, w, 0.0)
    total = w.sum()
    if not (np.isfinite(total) and total > 0):      # never sample from a non-finite distribution
        log.warning("non-finite probabilities (temperature %g); taking the greedy token", sampling.temperature)
        return Dist.point(greedy_token(logits, sampling, context), V)
    sel = np.flatnonzero(w)
    idx, w = idx[sel], w[sel] / total
    order = np.argsort(idx)
    return Dist(idx[order].astype(np.int64, copy=False), w[order], V)


def probs(logits: np.ndarray, sampling: SamplingArgs, context: Sequence[int] = ()) -> np.ndarray:
    """dist() as a dense vector [V] (float64, sums to 1). Greedy -> one-hot at argmax."""
    return dist(logits, sampling, context).dense()


def sample(p: "Dist | np.ndarray", rng: np.random.Generator) -> int:
    """Draw one index from a Dist or dense probabilities p [V] (inverse CDF; one uniform from rng)."""
    return as_dist(p).sample(rng)
