"""The rejection sampler of speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a pure function.

Drafted token x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection the
replacement is drawn from the residual norm(max(0, p_i - q_i)); if every draft is kept, a bonus
token is drawn from p_gamma. The committed tokens then follow the target distribution p exactly,
whatever q is. A drafter without probabilities (q None) is a point mass on its own tokens.

Rows are `Dist`s (speculative/sampling.py: a support and its probabilities) or dense [rows, V] arrays; the
residual only needs p's support (max(0, p - q) is 0 wherever p is), so no vocabulary-sized vector is
built.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgument
from .sampling import Dist, as_dist

# A residual below this total mass is rounding noise (p == q up to float error): draw from p instead.
_RESIDUAL_EPS = 1e-12

Residual = Callable[[Dist, "Dist | None", int], Dist]


def residual(p_i: "Dist | np.ndarray", q_i: "Dist | np.ndarray | None", x: int) -> Dist:
    """Distribution to resample from after rejecting draft x: norm(max(0, p_i - q_i)).

    q_i None means q is one-hot at x, so the residual is p_i with x removed.
    Falls back to p_i when the residual carries no mass (it only happens through rounding).
    """
    p = as_dist(p_i)
    if q_i is None:
        r = np.where(p.idx == x, 0.0, p.w)
    else:
        r = np.maximum(p.w - as_dist(q_i).at_many(p.idx), 0.0)
    total = r.sum()
    if not np.isfinite(total) or total <= _RESIDUAL_EPS:
        return Dist(p.idx, p.w / p.w.sum(), p.V)
    return Dist(p.idx, r / total, p.V)


def _rows(a, n: int, name: str) -> list[Dist]:
    """A [n, V] array or a sequence of n Dists -> n Dists."""
    if isinstance(a, np.ndarray):
        if a.ndim != 2 or a.shape[0] != n:
            raise InvalidArgument(f"verify: {name} must have shape [{n}, V], got {a.shape}")
        return [Dist.from_dense(row) for row in a]
    rows = [as_dist(r) for r in a]
    if len(rows) != n:
        raise InvalidArgument(f"verify: {name} must have {n} rows, got {len(rows)}")
    return rows


def verify(
    p,
    q,
    draft: Sequence[int],
    rng: np.random.Generator,
    *,
    resample: Residual = residual,
) -> tuple[int, int]:
    """Decide how many drafted tokens to keep and which token comes next.

    p: target distributions at the g+1 verified positions (after the sampling transforms), g+1 Dists
    or [g+1, V]; q: the g drafter distributions the drafts were sampled from (Dists or [g, V]), or
    None for a point-mass drafter; draft: the g drafted tokens. Returns (n_accepted, next_token): the
    caller commits draft[:n_accepted] + [next_token]. `resample` exists so tests can plug in a wrong
    residual and show that the statistical tests catch it; the decode loop never passes it.
    """
    g = len(draft)
    p = _rows(p, g + 1, "p (one row per verified position)")
    V = p[0].V
    if q is not None:
        q = _rows(q, g, "q (one row per drafted token)")
        if any(r.V != V for r in (*p, *q)):
            raise InvalidArgument(f"verify: every row of p and q must cover the same {V} ids")
    for i, x in enumerate(draft):
        x = int(x)
        if not 0 <= x < V:
            raise InvalidArgument(f"verify: drafted token {i} is {x}, expected an id in [0, {V})")
        px = p[i].at(x)
        qx = 1.0 if q is None else q[i].at(x)
        # accept with probability min(1, px / qx), written without the division: u * qx < px.
        # px == 0 is never accepted; qx == 0 < px (a draft outside q's support) is always accepted.
        if px > 0.0 and (px >= qx or rng.random() * qx < px):
            continue
        return i, resample(p[i], None if q is None else q[i], x).sample(rng)
    return g, p[g].sample(rng)


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
