"""Suffix lookup: a model-free drafter over a suffix automaton of the request's tokens (prompt + output).

The automaton (Blumer et al.; one state per right-equivalence class, built online in amortised O(1) per
token) holds every substring of the tokens seen. After token i the state reached by the whole text has a
suffix link to the state of the longest suffix that also ends earlier: its length is the longest match of
the context's end anywhere before, read in O(1) (no n-gram size to choose, no hashing of 1-3 token keys),
and the state's end position (its most recent occurrence where that is O(1) to keep) says where to copy
the continuation from. The draft is what followed that occurrence, overlapping into the current text where
the copy runs into it (periodic text).

The hint class is the match length's (1, 2, 3-4, 5-8, 9-16, 17+), as PromptLookupDrafter's, so the gamma
tuner learns the acceptance per class and sets the draft length from the match length and the past
acceptance (spec/gamma.py). Two more classes resume a copy after an edit: while the longest match is short
(under 9 tokens) and a 9+-token copy broke within the last 48 tokens, the tokens written since the break are
looked for in that copy's source just past the break (`_resume`); found, they draft what follows there, in the
class of a resumed copy matched on 1 token or on 2+. A file returned with a name changed goes on verbatim one
token after each rename, where the longest match is a few tokens long and anywhere. Within one request: the context must grow by appending (one decode loop's
`committed`), anything else rebuilds the automaton (O(n), once per request).

Across requests, where a server enables it (`serve --suffix-history`): `history`, a bucket of the service's
earlier answers for this request's API key (speculative/history.py), is searched too, and the longer of the
two matches drafts (the request's own on a tie).
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

from ..config import SamplingArgs
from ..constrain.base import Constraint
from .copying import MATCH_PRIOR, copy_draft, cut_to_grammar, match_class

MAX_FEED = 64        # a request's history cursor starts from its context's last this many tokens (a longer
                     # match drafts the same continuation)
RESUME_FROM = 9      # a match this long is a copy being followed: where it copies from is kept
RESUME_AFTER = 48    # a copy that broke (an edit) may resume within this many tokens of the break...
RESUME_WINDOW = 48   # ...this far past the break in its source, further than the edit's length
RESUMED = 6          # hint classes of a resumed copy (after match_class's 0..5): 1 token matched, 2+


class SuffixAutomaton:
    """The suffix automaton of a token sequence, extended one token at a time."""

    __slots__ = ("next", "link", "length", "end", "last", "tokens", "_match")

    def __init__(self) -> None:
        # per state: its transitions, then three integers in arrays (a sixth of the RAM Python ints in lists
        # take: speculative/history.py keeps automata of 100k tokens)
        self.next: list[dict[int, int]] = [{}]   # state -> {token: state}
        self.link = array("i", [-1])             # suffix link
        self.length = array("i", [0])            # longest string of the state
        self.end = array("i", [-1])              # index of the last token of an occurrence (a recent one)
        self.last = 0                            # the state of the whole text
        self.tokens = array("i")
        self._match = (0, -1)

    def extend(self, tok: int) -> None:
        nxt, link, length, end = self.next, self.link, self.length, self.end
        i = len(self.tokens)
        self.tokens.append(tok)
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        end.append(i)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:                                # split q: a clone keeps the shorter strings
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(end[q])
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # the match: link[cur], the longest suffix that ended before; its end is then moved to i, so that the
        # state, matched again later, copies from this most recent occurrence (the states further up the
        # suffix links keep an older one: O(1) per token, recency only where it is cheap)
        s = link[cur]
        self._match = (length[s], end[s]) if s > 0 else (0, -1)
        if s > 0:
            end[s] = i

    def match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the text that also ends before its last token: end is the
        index of an earlier occurrence's last token (-1 and length 0 where nothing repeats)."""
        return self._match


class SuffixDrafter:
    """Drafts the continuation of the longest earlier match of the context's end (a point mass)."""

    name = "suffix"
    vocab_fingerprint = None
    weight_bytes = 0
    n_classes = 8                  # the match length's 6 (match_class), then a resumed copy's 2 (RESUMED)
    free_classes = 8               # every class: drafts that cost nothing to make (GammaTuner prices none)
    class_prior = MATCH_PRIOR + (0.3, 0.7)     # a resumed copy's first drafts: right after 1 token 0.3, 2+ 0.7

    def __init__(self) -> None:
        self.history = None            # a HistoryBucket (speculative/history.py) the server sets per request
        self.reset()

    def reset(self) -> None:
        self._ctx: Sequence[int] | None = None
        self._sa = SuffixAutomaton()
        self._cursor = None
        self._src = self._src_at = -1      # a copy being followed: its next source index, set at this length

    def _sync(self, context: Sequence[int]) -> None:
        sa = self._sa
        n0 = len(sa.tokens)
        if not (context is self._ctx and len(context) >= n0 and (n0 == 0 or context[n0 - 1] == sa.tokens[-1])):
            self._ctx, self._sa, n0 = context, SuffixAutomaton(), 0
            self._src = self._src_at = -1
            sa = self._sa
            self._cursor = self.history.cursor() if self.history is not None else None
            if self._cursor is not None:
                self._cursor.feed([int(t) for t in context[-MAX_FEED:]])
        elif self._cursor is not None and len(context) > n0:
            self._cursor.feed([int(t) for t in context[n0:]])
        for t in context[n0:]:
            sa.extend(int(t))
            k, end = sa._match
            if k >= RESUME_FROM:
                self._src, self._src_at = end + 1, len(sa.tokens)

    def _match(self, context: Sequence[int]) -> tuple[int, int]:
        """(length, end) of the request's own match."""
        self._sync(context)
        return self._sa.match()

    def _resume(self) -> tuple[int, int]:
        """(length, end) of a copy resumed after an edit: the longest run of the tokens written since the copy
        broke that recurs in its source within RESUME_WINDOW past the break (the nearest on a tie); (0, -1)
        where none does, or no long copy broke in the last RESUME_AFTER tokens.

        A file returned with a name changed matches 9+ tokens until the name, then only the few tokens since
        it: the longest match is short and anywhere (its class drafts nothing), while the copy's own source,
        a few tokens past where it broke, goes on verbatim."""
        toks = self._sa.tokens
        n, src = len(toks), self._src
        d = n - self._src_at
        if src < 0 or not 0 < d <= RESUME_AFTER:
            return 0, -1
        last, best, at = toks[n - 1], 0, -1
        for j in range(src, min(src + d + RESUME_WINDOW, n - 1)):
            if toks[j] == last:
                m = 1
                while m < d and j - m >= src and toks[j - m] == toks[n - 1 - m]:
                    m += 1
                if m > best:
                    best, at = m, j
        return best, at

    def _find(self, context: Sequence[int]) -> tuple[int, int, int]:
        """(length, end, where): the longest of the request's own match (where -1), the history's (where: its
        block) and, while those are short, a resumed copy's (where -2)."""
        k, end = self._match(context)
        where = -1
        if self._cursor is not None:
            kh, block = self._cursor.match()
            if kh > k:
                k, end, where = kh, -1, block
        if k < RESUME_FROM:
            m, j = self._resume()
            if m:
                return m, j, -2
        return k, end, where

    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | None:
        k, _, where = self._find(context)
        if k == 0:
            return None
        if where == -2:
            return RESUMED + (k > 1)
        return match_class(k)

    def lag(self, context: Sequence[int]) -> int:
        return 0

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs,
                rng: np.random.Generator, constraint: Constraint | None = None) -> tuple[list[int], None]:
        return self._draft(context, gamma, constraint, count=True), None

    def shadow_draft(self, context: Sequence[int], gamma: int) -> list[int]:
        """The draft propose() would make, for a shadow (speculative/shadow.py): no constraint, and nothing counted
        as drafted from the history (a shadow is never drafted)."""
        return self._draft(context, gamma, None, count=False)

    def _draft(self, context: Sequence[int], gamma: int, constraint: Constraint | None, count: bool) -> list[int]:
        if gamma <= 0:
            return []
        k, end, where = self._find(context)
        if k == 0:
            return []
        if where >= 0:
            out = cut_to_grammar(self._cursor.continuation(where, gamma), constraint)
            if out:
                if count:
                    self._cursor.count(len(out))
                return out
            k, end = self._sa.match()          # the history's match ends its answer: the request's own
            if k == 0:
                return []
        return copy_draft(self._sa.tokens, end + 1, len(context), gamma, constraint)

    def close(self) -> None:
        self.reset()
