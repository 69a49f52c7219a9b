"""What a speculative cycle costs and yields, as the GammaTuner predicts it.

T_verify(n) is the device's CostCurve (measured, or a roofline before measuring) times a load factor
that follows the machine's current speed and a per-n shape correction learned from the cycles run; T_draft
and the drafter's catch-up per position are corrected by the draft times observed. Together with the
learned acceptance and supply (speculative/acceptance.py) they give the predicted tokens and seconds of a
cycle for every gamma, and so its rate. speculative/gamma.py's module docstring has the whole model.
"""

from __future__ import annotations

import numpy as np

from ..device.cost import CostCurve


class CycleCostModel:
    """The cost model, a part of GammaTuner (which holds gamma_max, its TunerSettings as `settings`, the
    drafter's catch-up `_lag` of the cycle being run, and the acceptance model)."""

    def _init_times(self, cost: CostCurve, gamma_max: int) -> None:
        G = gamma_max
        # observed times: EMA of T_verify(n) per n, draft time / curve ratio, cost of a drafter miss
        n_tab = G + 2                # index n = 1..G + 1 (index 0 unused)
        self._load = 1.0                          # observed / curve, common to every n (fast)
        self._shape = np.ones(n_tab)              # per-n correction of the curve's form (slow), index n
        self._shape_n = np.zeros(n_tab)           # observations behind _shape[n]
        self._tv_cache: np.ndarray | None = None
        self._curve = np.array([np.nan] + [cost.verify(n) for n in range(1, n_tab)])   # index n = 1..G + 1
        self._td_ratio = 1.0
        self._t_miss = 0.0
        # catch-up cost per position / draft step: prior from the curve's cost per row at its largest batch
        self._sync_ratio = float(self._curve[G + 1] / ((G + 1) * self._curve[1]))

    def _learn_times(self, m: int, asked: int, t_draft: float, t_verify: float) -> None:
        """A cycle's times: m tokens drafted of `asked`, its draft and verify seconds."""
        k = self.settings.time_ema
        n = m + 1
        # one observation moves an estimate by at most a factor 2 (a preempted cycle on a busy
        # machine is a spike, not a new cost level; a real change still arrives within a few cycles)
        if n < len(self._shape) and t_verify > 0:
            self._tv_cache = None
            r = t_verify / self._curve[n]
            cnt = self._shape_n[n]
            if not self._shape_n.any():
                self._load = r                      # the prior may be far off: the first sample is taken whole
            elif cnt == 0:
                # the first cycle at an n moves its shape halfway from the probe's measurement: llama.cpp's first
                # batch of a new size can run far slower than the rest (measured 1.26x at 4 positions, 1.47x at 17
                # on Qwen-1.5B, 2 CPU threads), and the shape reaches every n beyond it
                self._shape[n] = 0.5 + 0.5 * float(np.clip(r / self._load, 0.5, 2.0))
            else:
                expect = self._load * self._shape[n]
                r = float(np.clip(r, expect / 2, expect * 2))
                self._load += k * (r / self._shape[n] - self._load)
                self._shape[n] += max(self.settings.shape_rate, 1.0 / (cnt + 1)) * (r / self._load - self._shape[n])
            self._shape_n[n] = cnt + 1
            if self._shape_n[1] > 0 and self._shape[1] != 1.0:
                # only load x shape(n) is observed: scaled so that shape(1) = 1 (a plain step's time is the load),
                # which changes no prediction but the unseen n's, priced at the probe's ratio to T(1). Without it
                # the pair drifted along their product: after 2286 plain cycles a sampled-regime tuner held load
                # 2.84 and shape(1) 0.3, and every draft longer than those run was priced 2.84x the probe
                seen = self._shape_n > 0
                self._load *= self._shape[1]
                self._shape[seen] /= self._shape[1]
        excess = self._excess(self._lag)
        if self._free(self._hint):
            pass                                    # a model-free draft (speculative/combined.py): no model step to learn
        elif m > 0 and self.cost.t_draft > 0 and excess > 0:
            # the draft steps at their current estimate, the rest is the catch-up's
            r = max(t_draft - m * self.t_draft(), 0.0) / (excess * self.t_draft())
            r = float(np.clip(r, self._sync_ratio / 2, self._sync_ratio * 2))
            self._sync_ratio = (1 - k) * self._sync_ratio + k * r
        elif m > 0 and self.cost.t_draft > 0:
            r = float(np.clip(t_draft / (m * self.cost.t_draft), self._td_ratio / 2, self._td_ratio * 2))
            self._td_ratio = (1 - k) * self._td_ratio + k * r
        elif m == 0 and asked > 0:
            self._t_miss = (1 - k) * self._t_miss + k * t_draft

    def t_verify(self, n: int) -> float:
        """T_verify(n) = curve(n) x load x shape(n): `load` follows the machine's current speed fast
        (one factor for every n, so a busy spell slows all choices alike and cancels in the argmax);
        shape(n), learned slowly from the n the loop has run (interpolated between them, and from the largest
        back to 1.0 at gamma_max + 1), corrects the curve's form where the prior or probe was wrong."""
        if n <= self.gamma_max + 1:
            return float(self._tv_table()[n - 1])
        return float(self._tv_at(np.array([n]))[0])

    def _tv_at(self, n: np.ndarray) -> np.ndarray:
        curve = self._curve                                                 # curve [G + 2]: T(n) prior, index n
        if n.max() < len(curve):
            pred = curve[n]                                                 # pred [len(n)]
        else:
            pred = np.array([curve[k] if k < len(curve) else self.cost.verify(int(k)) for k in n])
        # shape between the n run so far is interpolated; past the largest, a measured curve's returns to the probe's
        # ratio to T(1) (1.0) at the table's end, unless that was run: what a few short cycles taught does not close
        # the long drafts off for good (only a long draft would correct it). A roofline's is held (no measurement)
        seen = list(np.flatnonzero(self._shape_n > 0))
        xs, ys = seen, list(self._shape[seen])
        if (not seen or seen[-1] < len(self._shape) - 1) and self.cost.source == "measured":
            xs, ys = xs + [len(self._shape) - 1], ys + [1.0]
        shape = np.interp(n, xs, ys) if xs else np.ones(len(n))
        return pred * self._load * shape

    def _tv_table(self) -> np.ndarray:
        """T_verify(n) for n = 1..gamma_max + 1, recomputed only after an observation."""
        if self._tv_cache is None:
            self._tv_cache = self._tv_at(np.arange(1, self.gamma_max + 2))
        return self._tv_cache

    def t_draft(self) -> float:
        """Seconds per drafted token of the drafter's model (0 for a model-free drafter)."""
        return self.cost.t_draft * self._td_ratio

    def _free(self, c: int | None) -> bool:
        """Whether class c's drafts cost nothing to make (the first `free_classes` of a drafter that offers both
        model-free and model drafts: speculative/combined.py)."""
        return c is not None and c < self.free_classes

    def draft_cost(self, c: int | None) -> float:
        """Seconds per drafted token in hint class c."""
        return 0.0 if self._free(c) else self.t_draft()

    def t_sync(self) -> float:
        """Seconds per position of the drafter's catch-up."""
        return self.t_draft() * self._sync_ratio

    @staticmethod
    def _excess(lag: int) -> int:
        """Positions caught up beyond a speculating cycle's own (its first draft step evaluates up to two:
        the last accepted draft's successor and the target's token)."""
        return max(lag - 2, 0)

    def _catch_up(self, lag: int) -> float:
        """Seconds of that catch-up."""
        return self._excess(lag) * self.t_sync()

    def _cycle(self, hint: int = 0, rng: np.random.Generator | None = None,
               z: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Predicted tokens and seconds of a cycle asking for gamma = 0..gamma_max drafts (index gamma)."""
        a, s = self.acceptance(hint, rng, z), self.supply(hint)
        D = np.concatenate([[1.0], np.cumprod(s)])          # D [G + 1]: P(at least k drafted | asked >= k)
        A = np.cumprod(s * a)                               # A [G]: P(positions 1..k drafted and accepted)
        tv = self._tv_table()                               # tv [G + 1]: T_verify(m + 1), m = 0..G
        # asking for g: exactly m < g drafted with P = D[m] - D[m + 1], all g with P = D[g]
        stop_before = np.concatenate([[0.0], np.cumsum((D[:-1] - D[1:]) * tv[:-1])])   # [G + 1], index g
        cost = (self.draft_cost(hint) * np.concatenate([[0.0], np.cumsum(D[1:])])
                + stop_before + D * tv + (D[0] - D[1]) * (0.0 if self._free(hint) else self._t_miss))                 # cost [G + 1]
        cost[0] = tv[0]
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(A)])                         # tokens [G + 1]
        return tokens, cost

    def rates(self, hint: int = 0, rng: np.random.Generator | None = None, z: float = 0.0) -> np.ndarray:
        """Predicted tokens/s for gamma = 0..gamma_max in a hint class (vectorised: runs every cycle);
        with rng, for acceptance drawn from its posterior; with z, at its lower confidence bound."""
        tokens, cost = self._cycle(hint, rng, z)
        r = tokens / cost
        cap = self.cap(hint)
        if cap < self.gamma_max:
            r[cap + 1:] = 0.0                     # longer than this class may draft (a model's, beside free drafts)
        return r

    def _could_win(self, alpha: float = 1.0, c: int | None = None) -> bool:
        """Whether some gamma beats plain decoding by the hysteresis margin at acceptance alpha per
        position (default: every draft accepted), with class c's draft cost (None: the model's)."""
        G = self.cap(c)
        tv = self._tv_table()[:G + 1]                                   # tv [G + 1]
        g = np.arange(1, G + 1)
        tokens = g + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (g + 1)) / (1.0 - alpha)   # Leviathan's E[tokens]
        best = (tokens / (g * self.draft_cost(c) + tv[1:])).max()
        return bool(best > (1.0 + self.settings.hysteresis) / tv[0])
