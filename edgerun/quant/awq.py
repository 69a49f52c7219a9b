"""AWQ search (Lin et al., MLSys 2024) in the exact storage format: statistics, scale search, clip search.

Pure functions on one scale group (linears sharing an input X [n, in]):

- `group_stats(x, ...)`: mean |x| per input channel (the AWQ statistic), mean x^2 per channel
  (optionally per-block Gram matrices) for the activation-weighted choice of each block's d / m,
  and a token subsample for scoring.
- `search_scale(fmt, ws, stats, grid)`: s = mean|x|^a / mean|w|^(1-a) per input channel for a on
  a grid (plus s = 1), each candidate scored by the group's output error
  || X W^T - (X / s) Q(W diag(s))^T ||^2 summed over the group's linears, with Q the round-to-
  nearest fake quantization of the target format (fp16 d as stored); optionally the `rescore`
  best are scored again with their searched block params (what would be stored). Returns the best s.
- `choose_block_params(fmt, w_scaled, stats, s)`: the per-block clipping search: each block's d
  (and m) chosen to minimise sum_j E[(x_j / s_j)^2] e_j^2 (or e^T G e with the block Gram matrix
  G of X / s when the stats carry it: slower, slightly better), optionally also weighted per
  element by sqrt(sigma2 + w^2) (`blocks.element_importance`).

Scales may be tied (`tie` [in] -> index into a smaller vector): GQA's o-projection input channels
that read the same v channel must share one scale, because 1/s is folded into that v row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import blocks as F


@dataclass(frozen=True)
class GroupStats:
    x_abs_mean: np.ndarray       # [in] mean |x| per channel over all calibration tokens
    x_sq_mean: np.ndarray        # [in] mean x^2 per channel (the diagonal of the Gram matrix)
    x_search: np.ndarray         # [n_search, in] token subsample used to score scale candidates
    n_tokens: int
    gram: np.ndarray | None = None   # [in/32, 32, 32] per-block X^T X / n, when asked for


def group_stats(x: np.ndarray, n_search: int, rng: np.random.Generator, gram: bool = False) -> GroupStats:
    """x [n, in] float32 -> statistics; n_search tokens are sampled without replacement for scoring."""
    n, k = x.shape
    g = None
    if gram:
        xb = x.reshape(n, k // F.QK, F.QK).transpose(1, 0, 2)      # [nb, n, 32]
        g = (np.matmul(xb.transpose(0, 2, 1), xb) / np.float32(n)).astype(np.float32)   # [nb, 32, 32]
    idx = np.sort(rng.choice(n, size=min(n_search, n), replace=False))
    return GroupStats(np.abs(x).mean(axis=0), np.square(x).mean(axis=0), np.ascontiguousarray(x[idx]), n, g)


def weight_abs_mean(ws: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over output rows of |w| normalised by its 32-block max: [in] (AWQ's weight statistic)."""
    acc = None
    rows = 0
    for w in ws:
        b = np.abs(w).reshape(w.shape[0], -1, F.QK)                 # [out, nb, 32]
        mx = b.max(axis=-1, keepdims=True)
        b = np.divide(b, mx, out=np.zeros_like(b), where=mx > 0).reshape(w.shape)
        acc = b.sum(axis=0) if acc is None else acc + b.sum(axis=0)
        rows += w.shape[0]
    return acc / rows


def tie_mean(v: np.ndarray, tie: np.ndarray | None) -> np.ndarray:
    """Average a per-channel vector [in] over tied channels -> [n_tied] (identity if tie is None)."""
    if tie is None:
        return v
    n = int(tie.max()) + 1
    return np.bincount(tie, weights=v, minlength=n) / np.bincount(tie, minlength=n)


def scale_from_alpha(x_abs: np.ndarray, w_abs: np.ndarray, alpha: float) -> np.ndarray:
    """s = x^a / w^(1-a), clamped positive, normalised so that max(s) * min(s) = 1."""
    s = np.power(np.maximum(x_abs, 1e-8), alpha) / np.power(np.maximum(w_abs, 1e-8), 1.0 - alpha)
    s = np.clip(s, 1e-4, None)
    s = s / np.sqrt(s.max() * s.min())
    return s.astype(np.float32)


def output_error(fmt: str, ws: Sequence[np.ndarray], x: np.ndarray, s: np.ndarray | None,
                 refs: Sequence[np.ndarray] | None = None,
                 params: Sequence[F.BlockParams | None] | None = None) -> float:
    """sum over linears of || x W^T - (x / s) Q(W diag(s))^T ||^2 (s None: no scaling)."""
    xs = x if s is None else x / s
    total = 0.0
    for j, w in enumerate(ws):
        ref = x @ w.T if refs is None else refs[j]
        wq = F.fake_quant(fmt, w if s is None else w * s, None if params is None else params[j])
        e = (ref - xs @ wq.T).ravel()
        total += float(e @ e)
    return total


@dataclass(frozen=True)
class ScaleResult:
    s: np.ndarray            # [in] per input channel (expanded from tied scales)
    s_tied: np.ndarray       # [n_tied] what is folded into the previous operator
    alpha: float | None      # None: s = 1 won
    loss: float              # output error with s: round-to-nearest, or the searched params if given
    loss_rtn: float          # output error of round-to-nearest without scaling
    params: tuple[F.BlockParams, ...] | None = None   # searched block params of w * s (rescored winner)


def search_scale(fmt: str, ws: Sequence[np.ndarray], stats: GroupStats, grid: int,
                 tie: np.ndarray | None = None, rescore: int = 0, element: bool = False) -> ScaleResult:
    """Grid-search AWQ's scale exponent a in [0, 1) (`grid` values) for one group.

    Every candidate is scored with round-to-nearest; then the `rescore` best are scored again with
    their searched block params (`choose_block_params`), which is what would be stored, and the
    best of those wins (its params are returned with it).
    """
    x = stats.x_search
    refs = [x @ w.T for w in ws]
    x_abs = tie_mean(stats.x_abs_mean, tie)
    w_abs = tie_mean(weight_abs_mean(ws), tie)
    loss_rtn = output_error(fmt, ws, x, None, refs)
    ones = np.ones(x.shape[1], np.float32)
    best = ScaleResult(ones, np.ones_like(x_abs, dtype=np.float32), None, loss_rtn, loss_rtn)
    scored = []
    for i in range(grid):
        a = i / grid
        st = scale_from_alpha(x_abs, w_abs, a)
        s = st if tie is None else st[tie]
        loss = output_error(fmt, ws, x, s, refs)
        scored.append((loss, i, ScaleResult(s, st, a, loss, loss_rtn)))
        if loss < best.loss:
            best = scored[-1][2]
    if rescore <= 0:
        return best
    best = None
    for _, _, r in sorted(scored, key=lambda c: c[:2])[:rescore]:
        ps = tuple(choose_block_params(fmt, w * r.s, stats, r.s, element) for w in ws)
        loss = output_error(fmt, ws, x, r.s, refs, ps)
        if best is None or loss < best.loss:
            best = ScaleResult(r.s, r.s_tied, r.alpha, loss, loss_rtn, ps)
    return best


def block_gram_scaled(gram: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Gram of X / s from the Gram of X: G_ij / (s_i s_j) per block. gram [nb, 32, 32], s [in]."""
    inv = (1.0 / s).reshape(-1, F.QK)                               # [nb, 32]
    return gram * inv[:, :, None] * inv[:, None, :]


def choose_block_params(fmt: str, w_scaled: np.ndarray, stats: GroupStats, s: np.ndarray,
                        element: bool = False) -> F.BlockParams:
    """Each block's d (and m) minimising the activation-weighted error of that block on X / s.

    element: weight each element also by sqrt(sigma2 + w^2) (`blocks.element_importance`).
    """
    if stats.gram is not None:
        return F.search_params(fmt, w_scaled, block_gram_scaled(stats.gram, s))
    imp = stats.x_sq_mean / (s * s)
    return F.search_params(fmt, w_scaled, F.element_importance(w_scaled, imp) if element else imp)
