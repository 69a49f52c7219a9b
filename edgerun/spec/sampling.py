"""Logits -> next-token probabilities, and sampling from them.

The same transforms are applied to the target's and the drafter's logits, so speculative
decoding reproduces exactly the *transformed* target distribution.
Order (as llama.cpp's default chain): repetition penalty, top-k, temperature, top-p, min-p.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..config import SamplingArgs

log = logging.getLogger(__name__)


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
    """The token greedy decoding picks: argmax after the repetition penalty (all of probs()' mass)."""
    return int(np.argmax(apply_repeat_penalty(logits, context, sampling)))


def probs(logits: np.ndarray, sampling: SamplingArgs, context: Sequence[int] = ()) -> np.ndarray:
    """One row of logits [V] -> probabilities [V] (float64, sums to 1). Greedy -> one-hot at argmax."""
    V = logits.shape[-1]
    out = np.zeros(V, dtype=np.float64)
    if sampling.greedy:
        out[greedy_token(logits, sampling, context)] = 1.0
        return out
    x = apply_repeat_penalty(logits, context, sampling)
    # candidates: indices kept after top-k (all when top_k is 0 or >= V)
    if 0 < sampling.top_k < V:
        idx = np.argpartition(x, V - sampling.top_k)[V - sampling.top_k:]
    else:
        idx = np.arange(V)
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
        out[:] = 0.0
        out[greedy_token(logits, sampling, context)] = 1.0
        return out
    out[idx] = w / total
    return out


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from probabilities p [V] (inverse CDF; one uniform from rng)."""
    idx = np.flatnonzero(p)             # after top-k/top-p/min-p (or greedy) few entries remain
    cum = np.cumsum(p[idx])             # same intervals as a cumsum over all of p: zeros add nothing
    u = rng.random() * cum[-1]
    return int(idx[min(np.searchsorted(cum, u, side="right"), len(idx) - 1)])
