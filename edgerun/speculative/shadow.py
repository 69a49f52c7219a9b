"""Shadow drafts: what a free class would have drafted, checked against the tokens decoded without it.

A model-free draft (suffix lookup: speculative/suffix.py) costs nothing to make; only its verification costs.
While the gamma tuner keeps such a class off (its acceptance, as learned so far, does not pay on this device's
cost curve), the decode loop still asks the drafter, at no cost, for the draft it would have made (`shadow_draft`), and compares
it with the tokens the target then decodes plain. The number that agree before the first difference is what a
verification would have accepted: a point-mass draft x is accepted with probability p(x), the probability that
the target samples x itself (greedy: exactly when it is the target's token), so the count is an unbiased
observation of the class's acceptance per position, and the tuner learns it (AcceptanceModel.shadow) without a
verified draft. On a steep CPU curve a class whose drafts would pay (a copy resumed after an edit) is otherwise
learned only from one-token exploratory drafts every ~85 cycles, each barely informative.

Each free class has at most one shadow open; the positions it has been compared on are learned as the decoded
tokens reach them (a long shadow of a good copy teaches its class before the copy ends), and it closes at its
first disagreement, when all of it agreed, or when its own class drafts for real (the positions past what agreed
are the verification's to observe). Other classes' drafts leave it open: the committed tokens are the target's either way (exactly so
under greedy decoding, in distribution under sampling), so the comparison stays unbiased. Nothing of a shadow
reaches the output: the tokens are the target's, with or without it.
"""

from __future__ import annotations

from typing import Sequence


class Shadow:
    """The open shadow drafts of one generation (_Loop in generate.py), one per free class at most."""

    __slots__ = ("tuner", "open")

    def __init__(self, tuner) -> None:
        self.tuner = tuner
        self.open: dict[int, list] = {}     # class -> [context length, draft, positions counted so far]

    def step(self, drafter, committed: Sequence[int], hint: int | None, gamma: int) -> None:
        """A cycle after `committed` in class `hint` drafts gamma: first each open shadow counts the positions the
        tokens since have reached (agreed, or the first that differs: then it closes; all of it: it closes), or
        closes unseen past them where its own class drafts for real now; then a free class kept off opens one (if
        it has none open). A Shadow of no tuner (a fixed gamma) does nothing."""
        if self.tuner is None:
            return
        for c, s in list(self.open.items()):
            n0, draft, k = s
            new = committed[n0:n0 + len(draft)]
            m = k
            while m < len(new) and new[m] == draft[m]:
                m += 1
            differs = m < len(new)
            if m > k or differs:
                self.tuner.shadow(c, k, m, differs)
                s[2] = m
            if differs or m == len(draft) or (c == hint and gamma > 0):
                del self.open[c]
        if gamma == 0 and hint is not None and hint not in self.open and self.tuner._free(hint) \
                and hasattr(drafter, "shadow_draft"):
            draft = drafter.shadow_draft(committed, self.tuner.cap(hint))
            if draft:
                self.open[hint] = [len(committed), list(draft), 0]
