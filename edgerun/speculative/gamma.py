"""Draft-length policies (GammaPolicy). The decode loop asks `choose(hint)` before each cycle, then `observe()`s it.

FixedGamma always drafts the same number of tokens. GammaTuner picks, every cycle, the gamma in
0..gamma_max that maximises predicted tokens per second:

    rate(g) = E[tokens per cycle | g] / E[seconds per cycle | g]

    E[tokens | g]  = 1 + sum_{k=1..g} prod_{i<=k} s_i * a_i
    E[seconds | g] = sum_{k=1..g} D_k * T_draft  +  sum_{m=0..g} P(m drafted) * T_verify(m + 1)

a_i is the probability that drafted position i is accepted given that positions < i were, s_i the
probability that the drafter supplies position i when asked for it (its confidence cut-off or a
failed prompt lookup stops it early), D_k = prod_{i<=k} s_i. Both are learned online as Beta
posteriors over exponentially decayed counts, per hint class: before each cycle the drafter says
which class the context falls in (prompt lookup: how long its verbatim match is; a model drafter:
one class), so a drafter whose drafts are good in some contexts and useless in others is used only
where it pays. Per-position estimates are shrunk towards their class's pooled mean, and that
towards the mean of all classes, so late positions and rare classes borrow strength. The class's
pooled acceptance is drawn from its posterior each cycle (Thompson sampling), so a class seen
little is sometimes tried optimistically and one seen often is decided by its data; switching speculation
on in a class, though, needs the win at a lower confidence bound of its acceptance (as wide as a wrong
switch is dear: none for free prompt-lookup drafts), so a few lucky drafts or what another text taught the
class do not buy a switch that the next rejections undo. T_verify(n) and T_draft come from the device's
CostCurve (measured, or a roofline before measuring), corrected by the times the loop observes. g = 0 is
plain decoding (rate 1 / T_verify(1)), chosen whenever speculation is not predicted to win. The first
drafting cycles of each class happen whatever the prior says (acceptance is learned, not assumed), unless
even perfect acceptance could not beat plain decoding. Now and then (exponential back-off while the choice stands) one exploratory cycle
runs: a one-token draft while speculation is off in that class, spaced so that losing drafts cost at
most 1% of the decode time, so a change in the text can turn speculation back on; plain or a
neighbouring gamma while it is on, so the observed costs stay honest where the prior curve was
wrong. A switch needs a predicted gain over the current gamma (hysteresis): no oscillating between near-equal choices.

A model drafter's cache is not advanced while speculation is off: its next draft first evaluates every
position since its last one (`Drafter.lag`, the catch-up), and that cost grows with the gap. The tuner
prices it (seconds per caught-up position, learned from the draft times it observes; before any, the
target's cost curve per row at its largest measured batch): an exploratory draft runs only when the
exploration budget earned since the last one also pays the catch-up, so a drafter whose catch-up alone
costs more than the budget is not explored while off (its learned state, persisted per device and pair,
decides), and a switch from off to on needs the predicted gain over the next explore_every cycles to
repay it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from ..config import GAMMA_LIMIT
from ..errors import InvalidArgument
from ..device.cost import CostCurve
from .acceptance import AcceptanceModel
from .cycle_cost import CycleCostModel

log = logging.getLogger(__name__)

WARMUP_ALPHA = 0.8     # acceptance the warm-up gamma is chosen for (a drafter worth learning about)


@runtime_checkable
class GammaPolicy(Protocol):
    """What the decode loop needs from a draft-length policy."""

    def choose(self, hint: int | None = 0, lag: int = 0) -> int:
        """gamma for the next cycle; hint is the drafter's class for the context (None: 0, nothing to draft),
        lag the positions the drafter must catch up on before drafting (Drafter.lag)."""
        ...

    def observe(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float) -> None:
        """The cycle's outcome: gamma tokens drafted, n_accepted of them accepted, and its times."""
        ...

    # optional: plain_cycle(lag) -> bool, asked before the drafter's hint: True, the next cycle runs plain whatever
    # is offered (BatchedGamma: no draft can pay in the batch), no hint or choose() needed, observe() as usual;
    # pick(classes) -> int, asked when a drafter offers several classes for a cycle (combined.py), else the first.


class FixedGamma:
    """Always draft `gamma` tokens (0 = plain decoding)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def choose(self, hint: int | None = 0, lag: int = 0) -> int:
        return 0 if hint is None else self.gamma

    def observe(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float) -> None:
        pass


@dataclass(frozen=True)
class TunerSettings:
    """The GammaTuner's rarely set knobs (the module docstring says what each one steers)."""

    alpha_prior: float = 0.6        # prior P(a drafted position is accepted)
    prior_strength: float = 1.0     # pseudo-counts of that prior behind the mean of all classes
    class_strength: float = 4.0     # pseudo-counts pulling a class's pooled mean towards all classes'
    pool_strength: float = 4.0      # pseudo-counts pulling a position's estimate towards its class's mean
    supply_prior: float = 0.95      # prior P(the drafter supplies a position it is asked for)
    decay: float = 0.98             # count decay per cycle of a class (1.0: never forget)
    hysteresis: float = 0.03        # relative predicted gain a switch of gamma needs
    explore_every: int = 16         # cycles between explorations while speculation is on, at first...
    explore_max: int = 256          # ... doubling up to this while the choice stands
    explore_budget: float = 0.01    # share of decode time losing exploratory drafts may cost while off
    warmup_cycles: int = 2          # drafting cycles per class whatever the prior says...
    warmup_total: int = 4           # ... and at most this many over all classes (learning cost bounded)
    time_ema: float = 0.2           # EMA weight of an observed time (load, draft ratio, miss cost)
    shape_rate: float = 0.05        # least learning rate of the curve's per-n shape correction
    thompson: bool = True           # draw the class's pooled acceptance from its posterior each cycle
    switch_on_z: float = 1.0        # switching on needs the win at acceptance this many posterior sds below the mean
    warmup_gamma: int = 0           # gamma of the warm-up cycles; 0: the one the cost curve favours
    free_memory: float = 16.0       # verified positions a free class's counts weigh at a generation's start

    def __post_init__(self) -> None:
        if not 0 < self.alpha_prior < 1 or not 0 < self.supply_prior <= 1:
            raise InvalidArgument(f"alpha_prior must be in (0, 1) and supply_prior in (0, 1], "
                                  f"got {self.alpha_prior}, {self.supply_prior}")
        if not 0 < self.decay <= 1 or self.hysteresis < 0 or not 0 < self.time_ema <= 1:
            raise InvalidArgument(f"need 0 < decay <= 1, hysteresis >= 0, 0 < time_ema <= 1; "
                                  f"got {self.decay}, {self.hysteresis}, {self.time_ema}")
        if not 0 < self.explore_budget <= 1:
            raise InvalidArgument(f"explore_budget must be in (0, 1], got {self.explore_budget}")
        if not self.switch_on_z >= 0:
            raise InvalidArgument(f"switch_on_z must be >= 0, got {self.switch_on_z}")
        if self.warmup_cycles < 0 or self.warmup_total < 0 or self.warmup_gamma < 0:
            raise InvalidArgument(f"need warmup_cycles >= 0, warmup_total >= 0 and warmup_gamma >= 0, "
                                  f"got {self.warmup_cycles}, {self.warmup_total}, {self.warmup_gamma}")
        if self.explore_every < 1 or self.explore_max < self.explore_every:
            raise InvalidArgument(f"need 1 <= explore_every <= explore_max, got {self.explore_every}, {self.explore_max}")


class GammaTuner(AcceptanceModel, CycleCostModel):
    """Cost model (cycle_cost.py) + online acceptance per drafter hint class (acceptance.py) -> gamma per
    cycle, chosen here (module docstring)."""

    def __init__(self, cost: CostCurve, gamma_max: int = 8, *, n_classes: int = 1, seed: int = 0,
                 settings: TunerSettings = TunerSettings(), free_classes: int = 0,
                 model_gamma_max: int | None = None, class_prior=None) -> None:
        if not isinstance(gamma_max, int) or not 1 <= gamma_max <= GAMMA_LIMIT:
            raise InvalidArgument(f"gamma_max must be an integer in 1..{GAMMA_LIMIT}, got {gamma_max!r}")
        if not isinstance(n_classes, int) or not 1 <= n_classes <= 64:
            raise InvalidArgument(f"n_classes must be an integer in 1..64, got {n_classes!r}")
        if not isinstance(free_classes, int) or not 0 <= free_classes <= n_classes:
            raise InvalidArgument(f"free_classes must be an integer in 0..n_classes, got {free_classes!r}")
        self.cost = cost
        self.gamma_max = gamma_max
        self.n_classes = n_classes
        self.free_classes = free_classes        # classes < this draft for nothing (no model step, no catch-up)
        # the other classes (a model's drafts) draft at most this many; free ones up to gamma_max
        self.model_gamma_max = gamma_max if model_gamma_max is None else min(int(model_gamma_max), gamma_max)
        if self.model_gamma_max < 1:
            raise InvalidArgument(f"model_gamma_max must be >= 1, got {model_gamma_max!r}")
        self.settings = settings
        self.warmup_gamma = min(settings.warmup_gamma, gamma_max)     # 0: chosen from the curve per cycle
        self._rng = np.random.default_rng(seed)
        C = n_classes
        self._init_counts(n_classes, gamma_max)
        if class_prior is not None:  # the drafter's prior acceptance per class (None: pooled)
            self.class_prior[:] = np.clip(np.asarray(class_prior, dtype=float)[:C], 0.01, 0.99)
        self._init_times(cost, gamma_max)
        self._lag = 0                           # the drafter's catch-up before the cycle being run
        # the policy's state per class: gamma in force, cycles since the last exploration, drafting
        # cycles seen (warm-up), exploration interval while speculation is on
        g0 = int(np.argmax(self.rates(0)))
        self._current = np.full(C, g0)
        self._since_explore = np.zeros(C, dtype=np.int64)
        self._n_drafting = np.zeros(C, dtype=np.int64)
        self._explore_interval = np.full(C, settings.explore_every)
        self._hint = 0                          # class of the cycle being run (None: nothing to draft)
        self._last = g0
        self._explore_turn = 0
        self._exploring = False
        self._lowered = False                   # the cycle being run was lowered to 0 by the caller (lower())
        self.n_explored = 0
        log.debug("gamma tuner: %s cost curve, %d hint classes, start at gamma %d", cost.source, C, g0)

    # -- construction from a loaded runtime ---------------------------------------------------
    @classmethod
    def for_runtime(cls, profile, target, drafter, spec, *, measure: bool = True) -> "GammaTuner":
        """Tuner for a loaded target + drafter: cached/measured cost curve (roofline if not measured),
        one acceptance model per hint class the drafter reports. The curve is measured up to gamma_max + 1
        rows; BatchedGamma (continuous batching) reads it further, extended linearly from its last points
        (CostCurve.verify), because probing every batch size a batch can reach would lengthen start-up by
        minutes (docs/batching.md)."""
        from ..device.costprobe import cost_curve_for

        free = int(getattr(drafter, "free_classes", 0))
        gmax, model_gmax = spec.limits(profile, free > 0)
        # a drafter offering model-free and model drafts (speculative/combined.py) is priced by its model's step
        curve = cost_curve_for(target, getattr(drafter, "model", drafter), profile, measure=measure, n_max=gmax + 1)
        return cls(curve, gamma_max=gmax, n_classes=int(getattr(drafter, "n_classes", 1)), free_classes=free,
                   model_gamma_max=model_gmax, class_prior=getattr(drafter, "class_prior", None))

    def fresh(self, seed: int = 0) -> "GammaTuner":
        """A tuner with this one's cost curve, gamma_max, classes and settings, and nothing learned."""
        return GammaTuner(self.cost, self.gamma_max, n_classes=self.n_classes, seed=seed, settings=self.settings,
                          free_classes=self.free_classes, model_gamma_max=self.model_gamma_max,
                          class_prior=self.class_prior)

    def cap(self, c: int | None) -> int:
        """The longest draft class c may ask for: gamma_max for model-free drafts, model_gamma_max for a model's."""
        return self.gamma_max if self._free(c) else self.model_gamma_max

    # -- what was learned, to persist between processes (speculative/tuner_store.py) --------------------
    _ARRAYS = ("_acc", "_seen", "_asked", "_got", "_shape", "_shape_n", "_current", "_n_drafting",
               "_explore_interval", "_since_explore")
    _SCALARS = ("_load", "_td_ratio", "_t_miss", "_sync_ratio")

    def state(self) -> dict:
        """Everything learned online (acceptance and supply counts, time corrections, the gamma in force
        per class, warm-up and exploration progress) as plain JSON values."""
        out = {name: getattr(self, name).tolist() for name in self._ARRAYS}
        out.update({name: float(getattr(self, name)) for name in self._SCALARS})
        out.update(gamma_max=self.gamma_max, n_classes=self.n_classes, n_explored=self.n_explored)
        return out

    def restore(self, state: dict) -> bool:
        """Continue from `state()` of a tuner of the same shape; False (nothing changed) when it does not fit."""
        try:
            if state["gamma_max"] != self.gamma_max or state["n_classes"] != self.n_classes:
                return False
            arrays = {}
            for name in self._ARRAYS:
                cur = getattr(self, name)
                a = np.asarray(state[name], dtype=cur.dtype)
                if a.shape != cur.shape or not np.isfinite(a).all() or (a < 0).any():
                    return False
                arrays[name] = a
            # a store written before _sync_ratio existed keeps the prior
            scalars = {name: float(state[name]) for name in self._SCALARS if name != "_sync_ratio" or name in state}
        except (KeyError, TypeError, ValueError):
            return False
        if not all(np.isfinite(v) and v >= 0 for v in scalars.values()) or scalars["_load"] <= 0 \
                or scalars["_td_ratio"] <= 0 or (arrays["_current"] > self.gamma_max).any():
            return False
        for name, a in {**arrays, **scalars}.items():
            setattr(self, name, a)
        # the exploration budget is earned by this process's own plain cycles: a restored credit would let
        # the first short generation of a new CLI process pay for an exploration that a long one earned
        # (measured: a 32-token answer losing 10-25% to one exploratory draft and its catch-up)
        self._since_explore = np.zeros_like(self._since_explore)
        self.n_explored = int(state.get("n_explored", 0))
        self._tv_cache = None
        return True

    # -- the policy --------------------------------------------------------------------------
    def choose(self, hint: int | None = 0, lag: int = 0) -> int:
        """gamma for the next cycle. hint: the drafter's class for this context (drafters.py), None
        when it has nothing to offer (then 0: no cycle is spent asking). lag: positions the drafter
        must evaluate before its first draft (Drafter.lag; priced into exploration and switching on)."""
        self._hint = hint
        self._lag = lag
        if hint is None:
            self._last = 0
            return 0
        if hint < 0:
            raise InvalidArgument(f"hint class must be >= 0 or None, got {hint!r}")
        c = min(hint, self.n_classes - 1)      # a tuner with fewer classes pools the upper ones
        self._hint = c
        if self._free(c):
            lag = self._lag = 0                  # a model-free draft: nothing to catch up on
        rates = self.rates(c, self._rng if self.settings.thompson else None)
        best = int(np.argmax(rates))
        cur = int(self._current[c])
        if best != cur and rates[best] > rates[cur] * (1.0 + self.settings.hysteresis) and \
                (cur > 0 or self._switch_on_pays(c, best, lag)):
            log.debug("class %d: gamma %d -> %d (predicted %.1f -> %.1f tok/s)", c, cur, best, rates[cur], rates[best])
            self._current[c] = cur = best
            self._explore_interval[c] = self.settings.explore_every
            self._since_explore[c] = 0
        g = cur
        if g > 0 and self._excess(lag) > 0 and not self._switch_on_pays(c, g, lag):
            # on, but the drafter is behind (a new process's prompt, or a stretch of plain cycles in other
            # classes): its catch-up is paid only where the win soon repays it; else this cycle runs plain
            g = 0
        self._since_explore[c] += 1
        can_win = g > 0 or self._could_win(c=c)
        probe_g = 1 if can_win else self._favoured_gamma(c)
        if (g == 0 and can_win and self._n_drafting[c] < self.settings.warmup_cycles
                and self._n_drafting.sum() < self.settings.warmup_total and self._could_win(WARMUP_ALPHA, c)):
            # the first drafting cycles of a class happen whatever the prior says: acceptance is
            # learned from data, not assumed (the tuner lives as long as the Runtime), where a good
            # drafter (acceptance WARMUP_ALPHA) would win; a pair that wins only near perfect acceptance
            # is learned by the budgeted explorations instead of an up-front warm-up
            g = self.warmup_gamma or self._favoured_gamma(c)
        elif g == 0 and self._since_explore[c] >= max(self.settings.explore_every, self._off_gap(probe_g, lag, c)):
            # speculation is off: a one-token draft as often as the exploration budget allows keeps the
            # acceptance estimate current (a drafter that has nothing to offer is asked again next cycle).
            # Where the curve says even perfect acceptance cannot win, the draft is the length the curve
            # favours, as rarely as the budget allows: its verify time corrects a curve measured wrong
            # (a probe on a contended machine) instead of leaving speculation off for good.
            self._since_explore[c] = 0
            self._exploring = True
            self.n_explored += 1
            g = probe_g
        elif g > 0 and self._since_explore[c] >= self._explore_interval[c]:
            # speculation is on: plain or a neighbouring gamma, ever rarer while the choice stands,
            # keeps T_verify honest there
            self._since_explore[c] = 0
            self._explore_interval[c] = min(2 * self._explore_interval[c], self.settings.explore_max)
            self.n_explored += 1
            cands = [x for x in (0, g + 1, g - 1) if 0 <= x <= self.cap(c) and x != g]
            g = cands[self._explore_turn % len(cands)]
            self._explore_turn += 1
        self._last = g
        self._lowered = False
        return g

    def pick(self, classes: tuple[int, ...]) -> int:
        """Of the hint classes a drafter offers for one cycle (speculative/combined.py: its suffix match's and
        its model's), the one whose best gamma is predicted the fastest at the posterior mean acceptance, the
        first on a tie (model-free drafts: no catch-up, nothing to load). A class not seen yet is predicted
        from the prior, so a model drafter that could pay gets its warm-up."""
        best, best_rate = classes[0], -1.0
        for c in classes:
            r = float(self.rates(min(c, self.n_classes - 1)).max())
            if r > best_rate * (1.0 + 1e-9):
                best, best_rate = c, r
        return best

    def pass_cycle(self, lag: int = 0) -> None:
        """The next cycle runs plain for a reason of the caller's, decided without choose() (BatchedGamma: no
        draft can pay in the current batch): as a cycle lowered to 0, it is no observation of any class and
        moves no exploration or warm-up; its verify time counts."""
        self._lag = lag
        self._last = 0
        self._exploring = False
        self._lowered = True

    def begin_generation(self) -> None:
        """A generation starts (generate()): the free classes' counts weigh at most free_memory positions."""
        self.soften(range(self.free_classes), self.settings.free_memory)

    def lower(self, g: int) -> None:
        """The cycle just chosen runs with g < choose()'s gamma for a reason of the caller's (BatchedGamma:
        the shared batch makes the drafts dear), not the drafter's: the drafter is asked for g only, so its
        supply is learned from g; a cycle lowered to 0 is no observation of the class at all (no supply, no
        acceptance, no decay of either; its verify time still counts). Without this, every lowered cycle read
        as a drafter that declined to draft: under batching the supply estimate fell to ~0, speculation
        switched off for the pair and stayed off (persisted) even for a single client."""
        if not 0 <= g <= self._last:
            raise InvalidArgument(f"lower() takes a gamma in 0..{self._last} (the chosen one), got {g!r}")
        self._last = g
        if g == 0:
            self._lowered = True
            if self._exploring and self._hint is not None:
                self._since_explore[self._hint] = 10 ** 9    # the exploration is still owed: at the next cycle that may draft
            self._exploring = False

    def observe(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float, *, times: bool = True) -> None:
        """gamma: tokens actually drafted (<= what choose() asked); n_accepted of them accepted. times=False:
        the cycle's times are not what the model prices (a batch shared with other sequences, BatchedGamma):
        the counts are learned, the times are not."""
        if not 0 <= n_accepted <= gamma:
            raise InvalidArgument(f"n_accepted must be in 0..gamma ({gamma}), got {n_accepted}")
        c = self._hint
        asked = min(max(self._last, gamma), self.gamma_max)
        m = min(gamma, self.gamma_max)
        if c is not None and not self._lowered:
            # per cycle of this class, drafted or not, so old text weighs less and less; slower while
            # speculation is off, so the sparse exploratory cycles add up to an estimate instead of
            # fading into the prior
            d = self.settings.decay if self._current[c] > 0 else self.settings.decay ** 0.25
            if self._exploring and m == 0 and asked > 0:
                self._since_explore[c] = 10 ** 9      # nothing was drafted: the exploration is still owed
            if m > 0:
                self._n_drafting[c] += 1
            self._count(c, d, asked, m, n_accepted)
        self._exploring = False
        self._lowered = False
        if times:
            self._learn_times(m, asked, t_draft, t_verify)

    def _favoured_gamma(self, c: int | None = None) -> int:
        """The gamma (>= 1) the cost curve favours for a drafter that is good (acceptance WARMUP_ALPHA): the
        warm-up learns acceptance where speculation would be run. Where the curve is not monotone (llama.cpp's
        CPU kernels verify 4 positions for little more than 2) it is not simply a small gamma."""
        g = np.arange(1, self.cap(c) + 1)
        tokens = (1.0 - WARMUP_ALPHA ** (g + 1)) / (1.0 - WARMUP_ALPHA)            # Leviathan's E[tokens]
        return int(g[np.argmax(tokens / (g * self.draft_cost(c) + self._tv_table()[1:len(g) + 1]))])

    def _off_gap(self, g: int = 1, lag: int = 0, c: int | None = None) -> float:
        """Plain cycles between exploratory g-token drafts so that a losing draft, with the drafter's
        catch-up over `lag` positions, costs at most explore_budget of the decode time:
        (g T_draft + T_verify(g + 1) - T_verify(1) + catch-up) / (budget x T_verify(1))."""
        tv = self._tv_table()
        loss = max(g * self.draft_cost(c) + tv[g] - tv[0], 0.0) + self._catch_up(lag)
        return loss / (self.settings.explore_budget * tv[0])

    def _switch_on_pays(self, c: int, g: int, lag: int) -> bool:
        """Whether switching speculation on at gamma g in class c pays by the lower confidence bound of the
        class's acceptance (switch_on_z sds below the mean): it must beat plain decoding by the hysteresis
        margin and save, over the next explore_every cycles, more than the drafter's catch-up costs. A win
        predicted from a few drafts, or from what another text taught the class, is not enough to pay for a
        switch that the next rejections undo (docs/gamma.md has the runs that slowed down under a mean-based
        rule); the budgeted explorations add the data that narrows the bound."""
        # the confidence asked for scales with what a wrong switch costs: the drafts and the catch-up, in
        # target steps (a model drafter on a CPU: the full bound; prompt lookup, whose drafts are free: none)
        tv1 = self._tv_table()[0]
        z = self.settings.switch_on_z * min(1.0, (g * self.draft_cost(c) + self._catch_up(lag)) / tv1)
        tokens, seconds = self._cycle(c, z=z)                            # [G + 1] each, at the bound
        low = tokens / seconds
        if not low[g] > low[0] * (1.0 + self.settings.hysteresis):
            return False
        cost = self._catch_up(lag)
        if cost <= 0.0:
            return True
        saved = self.settings.explore_every * tokens[g] * (1.0 / low[0] - 1.0 / low[g])
        return bool(saved > cost)

    @property
    def gamma(self) -> int:
        """The gamma currently in force in class 0 (exploration cycles aside)."""
        return int(self._current[0])

    def gammas(self) -> list[int]:
        """The gamma currently in force per hint class."""
        return [int(x) for x in self._current]

    def summary(self) -> dict:
        return {"gamma": self.gamma, "gamma_per_class": self.gammas(), "n_classes": self.n_classes,
                "rates": [[float(x) for x in self.rates(c)] for c in range(self.n_classes)],
                "acceptance": [[float(x) for x in self.acceptance(c)] for c in range(self.n_classes)],
                "supply": [[float(x) for x in self.supply(c)] for c in range(self.n_classes)],
                "t_draft": self.t_draft(), "t_verify_1": self.t_verify(1), "cost_source": self.cost.source,
                "n_explored": self.n_explored}


class BatchedGamma:
    """A sequence's gamma while it shares the target's batches with others (continuous batching).

    With one sequence active it is its tuner, unchanged. With m > 1 active, one step evaluates the
    other m - 1 sequences' rows (taken as one each) with this sequence's gamma + 1. llama.cpp evaluates
    such a batch in two passes: with one KV stream per sequence its split_equal gives every sequence of
    a ubatch the same number of rows, so the m sequences' first rows go together and this sequence's
    other gamma rows follow alone. The step yields (m - 1) + tokens(gamma) tokens in
    T(m) + T(gamma) + gamma x t_draft (T(0) = 0), from the measured cost curve of a batch of rows T(rows)
    and the tuner's acceptance and supply model. The tuner's gamma is lowered to the one that maximises
    that step's rate, down to 0 (speculation off) where the extra pass costs more than its tokens bring.
    The tuner learns acceptance from every cycle and times only from the cycles run alone (a batch's
    time is several sequences', prompts included)."""

    def __init__(self, tuner: GammaTuner, n_active: Callable[[], int]) -> None:
        self.tuner = tuner
        self.n_active = n_active
        self.n_lowered = 0            # cycles whose gamma was lowered because of the batch (plain_cycle's too)
        self._m = 1                   # sequences active when the current cycle's gamma was chosen

    def plain_cycle(self, lag: int = 0) -> bool:
        """True when, with the sequences active now, no draft could pay even if every one were supplied and
        accepted: max over k of (m + k) / (T(m) + T(k) + k t_draft) <= m / T(m), the rates choose() compares
        at their best. The cycle then runs plain (what choose() would return) and the tuner is not asked: its
        choice, the drafter's hint over the target's logits and the lowering cost ~0.2-0.4 ms a sequence per
        step in Python between two evaluations, for a 0 known in advance (docs/batching.md). The tuner takes
        the cycle as one lowered to 0 (pass_cycle)."""
        m = max(1, self.n_active())
        if m == 1:
            return False
        cost = self.step_costs(m, self.tuner.gamma_max, 0 if self.tuner.free_classes else None)   # at the cheapest drafts
        if ((m + np.arange(1, len(cost))) / cost[1:]).max() > m / cost[0]:
            return False
        self._m = m
        self.n_lowered += 1
        self.tuner.pass_cycle(lag)
        return True

    def pick(self, classes: tuple[int, ...]) -> int:
        return self.tuner.pick(classes)

    def choose(self, hint: int | None = 0, lag: int = 0) -> int:
        g = self.tuner.choose(hint, lag)
        self._m = m = max(1, self.n_active())
        if g == 0 or m == 1:
            return g
        t = self.tuner
        c = min(hint or 0, t.n_classes - 1)
        A = np.cumprod(t.supply(c) * t.acceptance(c))[:g]                     # A [g]: drafts 1..k all kept
        tokens = (m - 1) + 1.0 + np.concatenate([[0.0], np.cumsum(A)])         # tokens [g + 1], index gamma
        cost = self.step_costs(m, g, c)                                         # cost [g + 1]
        best = int(np.argmax(tokens / cost))
        if best < g:
            self.n_lowered += 1
            self.tuner.lower(best)
        return best

    def step_costs(self, m: int, g: int, c: int | None = None) -> np.ndarray:
        """Seconds of a step of m sequences in which this one drafts k = 0..g tokens (index k) in hint class c
        (None: a model's drafts): its drafts, then T(m) + T(k), two passes."""
        t = self.tuner
        k = np.arange(g + 1)
        return t.t_verify(m) + np.concatenate([[0.0], t._tv_table()[:g]]) + k * t.draft_cost(c)

    def observe(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float) -> None:
        # a batch's time is not this sequence's cost: other sequences' prompts join batches (hundreds of rows),
        # and rescaling it by the curve's T(gamma + 1) / (T(m) + T(gamma)) taught the tuner a load several times
        # the machine's, which the cycles alone then folded into shape(1) while T(n >= 2) stayed inflated
        # (docs/batching.md); the times are learned from cycles alone, the acceptance from every cycle
        self.tuner.observe(gamma, n_accepted, t_draft, t_verify, times=self._m == 1)
