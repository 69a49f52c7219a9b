"""What the GammaTuner learns about a drafter: acceptance and supply per hint class and drafted position.

Both are Beta posteriors over exponentially decayed counts (accepted / verified with every earlier position
accepted; supplied / asked for), per hint class; per-position estimates are shrunk towards the class's pooled
mean, and that towards the mean of all classes (itself towards the prior), so late positions and rare
classes borrow strength. With an rng the class's pooled acceptance is drawn from its posterior (Thompson
sampling). speculative/gamma.py's module docstring has the whole model.
"""

from __future__ import annotations

import numpy as np


class AcceptanceModel:
    """The acceptance and supply learner, a part of GammaTuner (which holds n_classes, gamma_max and its
    TunerSettings as `settings`)."""

    def _init_counts(self, n_classes: int, gamma_max: int) -> None:
        C, G = n_classes, gamma_max
        # decayed counts per hint class and drafted position i = 1..G (index [class, i - 1])
        self._acc = np.zeros((C, G))      # accepted
        self._seen = np.zeros((C, G))     # verified with every earlier position accepted
        self._asked = np.zeros((C, G))    # drafter was asked for position i (and supplied i - 1)
        self._got = np.zeros((C, G))      # ... and supplied it
        # the drafter's prior acceptance per class (its `class_prior`; NaN: the mean of all classes), what a
        # class with few drafts of its own is shrunk towards (not state: the drafter's, set by the tuner)
        self.class_prior = np.full(C, np.nan)

    def _count(self, c: int, decay: float, asked: int, m: int, n_accepted: int) -> None:
        """One cycle of class c: the counts decay by `decay`, then the drafter was asked for `asked`
        positions, supplied m of them and n_accepted were accepted."""
        for arr in (self._acc, self._seen, self._asked, self._got):
            arr[c] *= decay
        if asked > 0:
            # supply: positions 1..m supplied; position m + 1 asked but not supplied
            self._asked[c, :m] += 1
            self._got[c, :m] += 1
            if m < asked:
                self._asked[c, m] += 1
            # acceptance: positions 1..n_accepted accepted; position n_accepted + 1 rejected (if drafted)
            na = min(n_accepted, m)
            self._acc[c, :na] += 1
            self._seen[c, :na] += 1
            if na < m:
                self._seen[c, na] += 1

    def shadow(self, c: int, lo: int, hi: int, rejected: bool) -> None:
        """A shadow draft of free class c (speculative/shadow.py), as the tokens decoded plain reach it: its
        positions lo+1..hi agreed with them (newly seen), and with `rejected` position hi+1 did not. Learned as a
        drafting cycle's acceptance and supply (the decay of a class kept off, once per shadow: at lo = 0); no
        times, no warm-up (nothing was verified)."""
        G = self.gamma_max
        lo, hi = min(lo, G), min(hi, G)
        if lo == 0:
            for arr in (self._acc, self._seen, self._asked, self._got):
                arr[c] *= self.settings.decay ** 0.25
        for arr in (self._acc, self._seen, self._asked, self._got):
            arr[c, lo:hi] += 1
        if rejected and hi < G:
            self._seen[c, hi] += 1
            self._asked[c, hi] += 1
            self._got[c, hi] += 1

    def soften(self, classes, n_max: float) -> None:
        """A new text begins: each of `classes` keeps its estimates (the ratios of its counts) but weighs at
        most n_max verified positions, so that this text's first outcomes move them. Free drafts (suffix
        lookup) are accepted at rates that depend on the text far more than on the match's length: a class
        that learned from a file copied whole otherwise kept drafting long into a short answer from a
        document, whose first rejections hardly moved thousands of counts (docs/free_drafts.md)."""
        for c in classes:
            n = self._seen[c].sum()
            if n > n_max:
                for arr in (self._acc, self._seen, self._asked, self._got):
                    arr[c] *= n_max / n

    def _shrunk(self, hits: np.ndarray, trials: np.ndarray, mean0: float, c: int,
                rng: np.random.Generator | None = None) -> np.ndarray:
        """Per-position Beta posterior means for class c, shrunk towards the class's pooled mean,
        which is shrunk towards the pooled mean of all classes (itself shrunk towards the prior), or for
        acceptance towards the drafter's prior for the class where it has one.
        With rng, the class's pooled mean is drawn from its Beta posterior instead (Thompson
        sampling: a class seen little is sometimes drafted optimistically, and so gets learned)."""
        st = self.settings
        # "all classes" are those of c's kind: a drafter with free and model classes (speculative/combined.py)
        # pools each kind apart (copies of the text say nothing of a model's drafts: shadow drafts of a file copied
        # whole otherwise lifted the untried model classes' prior until the model drafted, at half plain speed)
        f = self.free_classes
        rows = slice(0, f) if c < f else slice(f, None)
        pooled = (mean0 * st.prior_strength + hits[rows].sum()) / (st.prior_strength + trials[rows].sum())
        if self.n_classes > 1 or rng is not None:
            h, n = hits[c].sum(), trials[c].sum()
            cs = st.class_strength
            if hits is self._acc and np.isfinite(self.class_prior[c]):
                pooled = self.class_prior[c]
            if rng is None:
                pooled = (h + cs * pooled) / (n + cs)
            else:
                pooled = rng.beta(h + cs * pooled, max(n - h, 0.0) + cs * (1.0 - pooled))
        return (hits[c] + st.pool_strength * pooled) / (trials[c] + st.pool_strength)

    def acceptance(self, hint: int = 0, rng: np.random.Generator | None = None, z: float = 0.0) -> np.ndarray:
        """a_i, i = 1..gamma_max: P(position i accepted | positions < i accepted), for a hint class
        (posterior mean, or a posterior draw with rng; z > 0: z posterior standard deviations below the
        mean, a lower confidence bound that is wide where the class has seen few drafts)."""
        a = self._shrunk(self._acc, self._seen, self.settings.alpha_prior, hint, rng)
        if z > 0:
            n = self._seen[hint] + self.settings.pool_strength                  # [G] trials behind each a_i
            a = np.clip(a - z * np.sqrt(a * (1.0 - a) / (n + 1.0)), 0.0, 1.0)
        return a

    def supply(self, hint: int = 0) -> np.ndarray:
        """s_i: P(drafter supplies position i | asked for it and supplied i - 1), for a hint class."""
        return np.minimum(self._shrunk(self._got, self._asked, self.settings.supply_prior, hint), 1.0)
