"""The rejection sampler of speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a pure function.

Drafted token x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection the
replacement is drawn from the residual norm(max(0, p_i - q_i)); if every draft is kept, a bonus
token is drawn from p_gamma. The committed tokens then follow the target distribution p exactly,
whatever q is. A drafter without probabilities (q None) is a point mass on its own tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgument
from .sampling import sample

# A residual below this total mass is rounding noise (p == q up to float error): draw from p instead.
_RESIDUAL_EPS = 1e-12

Residual = Callable[[np.ndarray, np.ndarray | None, int], np.ndarray]


def residual(p_i: np.ndarray, q_i: np.ndarray | None, x: int) -> np.ndarray:
    """Distribution to resample from after rejecting draft x: norm(max(0, p_i - q_i)) [V].

    q_i None means q is one-hot at x, so the residual is p_i with x removed.
    Falls back to p_i when the residual carries no mass (it only happens through rounding).
    """
    if q_i is None:
        r = p_i.astype(np.float64, copy=True)
        r[x] = 0.0
    else:
        r = np.maximum(p_i.astype(np.float64) - q_i, 0.0)
    total = r.sum()
    if not np.isfinite(total) or total <= _RESIDUAL_EPS:
        return p_i.astype(np.float64) / p_i.sum()
    return r / total


def verify(
    p: np.ndarray,
    q: np.ndarray | None,
    draft: Sequence[int],
    rng: np.random.Generator,
    *,
    resample: Residual = residual,
) -> tuple[int, int]:
    """Decide how many drafted tokens to keep and which token comes next.

    p: target probabilities [g+1, V] at the g+1 verified positions (after the sampling transforms);
    q: drafter probabilities [g, V] the drafts were sampled from, or None for a point-mass drafter;
    draft: the g drafted tokens. Returns (n_accepted, next_token): the caller commits
    draft[:n_accepted] + [next_token]. `resample` exists so tests can plug in a wrong residual and
    show that the statistical tests catch it; the decode loop never passes it.
    """
    g = len(draft)
    if p.ndim != 2 or p.shape[0] != g + 1:
        raise InvalidArgument(f"verify: p must have shape [{g + 1}, V] for {g} drafted tokens, got {p.shape}")
    V = p.shape[1]
    if q is not None and q.shape != (g, V):
        raise InvalidArgument(f"verify: q must have shape [{g}, {V}] (one row per drafted token), got {q.shape}")
    for i, x in enumerate(draft):
        x = int(x)
        if not 0 <= x < V:
            raise InvalidArgument(f"verify: drafted token {i} is {x}, expected an id in [0, {V})")
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        # accept with probability min(1, px / qx), written without the division: u * qx < px.
        # px == 0 is never accepted; qx == 0 < px (a draft outside q's support) is always accepted.
        if px > 0.0 and (px >= qx or rng.random() * qx < px):
            continue
        return i, sample(resample(p[i], None if q is None else q[i], x), rng)
    return g, sample(p[g], rng)


def verify_greedy(targets: Sequence[int], draft: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: targets [g + 1] are the target's greedy tokens at the verified positions.
    Keeps the drafts that equal them and continues with the target's token after the last kept one:
    what verify() returns for one-hot p (whatever q), without building probability vectors."""
    if len(targets) != len(draft) + 1:
        raise InvalidArgument(f"verify_greedy: need {len(draft) + 1} target tokens for {len(draft)} drafts, "
                              f"got {len(targets)}")
    n = 0
    while n < len(draft) and int(draft[n]) == int(targets[n]):
        n += 1
    return n, int(targets[n])
