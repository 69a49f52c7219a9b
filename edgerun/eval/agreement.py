"""Top-1 agreement of two engines' teacher-forced logits over the same positions (parity checks)."""

from __future__ import annotations

import numpy as np


def top1_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """a vs b [positions, V]. top1_excluding_near_ties is a separate, looser figure: the agreement over
    the positions where b's top-2 logit margin is at least the mean |a - b| (the rest are near-ties
    that the measured noise alone can flip)."""
    d = np.abs(a.astype(np.float64) - b)
    same = a.argmax(1) == b.argmax(1)
    top2 = np.sort(b, axis=1)[:, -2:]                    # [positions, 2]
    clear = (top2[:, 1] - top2[:, 0]) >= d.mean()
    return {"top1_agreement": float(same.mean()), "n_differ": int((~same).sum()), "max_abs_diff": float(d.max()),
            "mean_abs_diff": float(d.mean()), "logit_std": float(b.std()),
            "top1_excluding_near_ties": float(same[clear].mean()), "near_ties_excluded": int((~clear).sum())}
