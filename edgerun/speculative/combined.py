"""Suffix lookup and a model drafter as one drafter: the gamma tuner picks, per cycle, which of them drafts.

`--draft auto` for a target with a paired smaller model (the registry's Qwen pair, a hub model with a cached
model of its vocabulary) gives a SuffixOrModel. Before each cycle it offers two hint classes: its suffix
match's (0..7: the match length's class or a resumed copy's, as SuffixDrafter's: drafts that cost nothing to make)
and its model's (8..11, the target's margin, as ModelDrafter's: drafts that cost a model step each, plus the catch-up of the
model's cache over the cycles it sat out). The tuner takes the class whose best gamma it predicts the fastest
(GammaTuner.pick; the suffix match's on a tie) and chooses gamma in it as for any drafter. Acceptance is learned
per class, and the model's step only from the model's cycles (GammaTuner's `free_classes`: the first 8 classes
cost no draft time and no catch-up).

So where the model cannot pay (a 2-core CPU: verifying 4 positions costs ~3 steps, docs/speculative.md) its
classes stay off and suffix drafts do the copying; where it pays (a GPU's flat cost curve) it drafts wherever the
text holds no match the tuner prefers. With no match at all only the model is offered; while a server's model
is still loading (speculative/lazy.py: hint None) only the suffix match is.

Exactness: each cycle's drafts come from one part and go through the loop's one verification (a suffix draft is a
point mass, a model draft carries its q), so the output law is the target's whichever part drafts.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from ..config import SamplingArgs
from ..constrain.base import Constraint
from .drafters import ModelDrafter
from .suffix import SuffixDrafter


class SuffixOrModel:
    """A SuffixDrafter and a model drafter (ModelDrafter, or a LazyDrafter not loaded yet) behind one Drafter."""

    free_classes = SuffixDrafter.n_classes                       # classes 0..7: suffix drafts, free to make
    n_classes = SuffixDrafter.n_classes + ModelDrafter.n_classes
    class_prior = SuffixDrafter.class_prior + (None,) * ModelDrafter.n_classes

    def __init__(self, model, suffix: SuffixDrafter | None = None) -> None:
        self.model = model
        self.suffix = suffix if suffix is not None else SuffixDrafter()
        self.name = f"suffix+{model.name}"
        self._use_model = False            # which part proposes this cycle (hint() / use())

    # the model's identity and the suffix drafter's history, as the rest of the runtime reads a drafter's
    @property
    def vocab_fingerprint(self) -> str | None:
        return self.model.vocab_fingerprint

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def history(self):
        return self.suffix.history

    @history.setter
    def history(self, bucket) -> None:
        self.suffix.history = bucket

    @property
    def deferred(self) -> bool:
        """A model not loaded yet that this cycle's draft needs (generate.py loads it before the timed draft)."""
        return self._use_model and bool(getattr(self.model, "deferred", False))

    def load(self, **kw) -> None:
        self.model.load(**kw)

    def __copy__(self) -> "SuffixOrModel":
        """A slot's copy (Runtime.slots): its own suffix automaton and its own copy of the model part."""
        return SuffixOrModel(copy.copy(self.model))

    # -- the Drafter protocol -----------------------------------------------------------------
    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | tuple[int, int] | None:
        ks = self.suffix.hint(context, logits)
        km = self.model.hint(context, logits)
        if km is None:
            self._use_model = False
            return ks
        km += self.free_classes
        if ks is None:
            self._use_model = True
            return km
        return ks, km

    def use(self, c: int) -> int:
        """The class the policy picked of those hint() offered; the part that proposes follows it."""
        self._use_model = c >= self.free_classes
        return c

    def lag(self, context: Sequence[int]) -> int:
        return self.model.lag(context)         # the tuner prices no catch-up in the suffix classes

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs, rng: np.random.Generator,
                constraint: Constraint | None = None) -> tuple[list[int], object]:
        part = self.model if self._use_model else self.suffix
        return part.propose(context, gamma, sampling, rng, constraint)

    def shadow_draft(self, context: Sequence[int], gamma: int) -> list[int]:
        return self.suffix.shadow_draft(context, gamma)     # shadows are of free (suffix) classes only

    def reset(self) -> None:
        self.suffix.reset()
        self.model.reset()

    def close(self) -> None:
        self.suffix.close()
        self.model.close()


def model_part(drafter) -> ModelDrafter | None:
    """The loaded ModelDrafter a drafter holds (itself, or a SuffixOrModel's model), else None."""
    inner = drafter.model if isinstance(drafter, SuffixOrModel) else drafter
    return inner if isinstance(inner, ModelDrafter) else None
