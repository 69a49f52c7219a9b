"""Cross-request history for suffix lookup: earlier answers of the service, kept per API key, in RAM only.

`SuffixHistory` holds one `HistoryBucket` per key (a keyless server has one bucket). A bucket keeps the
answers it was given, each with the last `PROMPT_TAIL` tokens of its prompt before it (so that a repeated
question matches from its first answer token on), in suffix automata (speculative/suffix.py) over their
concatenation, one answer after another behind a separator that no request token equals (a match never
spans two answers, and a copied draft stops at the answer's end).

Bounded: a bucket holds at most `budget` tokens. The answers go into blocks of budget / BLOCKS tokens, one
automaton each; when the bucket holds more than its budget, its oldest block is dropped whole (an automaton
cannot forget its first tokens), so between (BLOCKS - 1) / BLOCKS of the budget and all of it is kept once
full, oldest first out. A full block is frozen into a compact table (_Frozen: about a tenth of the RAM of
the growing form's dict per state). Nothing is written anywhere: the store lives and dies with the process.

A request reads its key's bucket through a `HistoryCursor`: the blocks as they were when the request began
(a block dropped meanwhile stays readable to it until it ends), each with the state of the longest suffix
of the request's context found there, advanced one token at a time in amortised O(1) per block. The drafts
it proposes go through the decode loop's verification like every other draft, so they change how fast an
answer comes, never which answer comes (docs/free_drafts.md). A bucket's lock is held while an answer is
added and while a cursor advances, so a cursor never reads an automaton half-extended.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections import deque
from typing import Hashable, Sequence

from ..errors import InvalidArgument
from .suffix import SuffixAutomaton

SEPARATOR = -1       # between answers: no request token equals it, so no match spans two answers
PROMPT_TAIL = 32     # prompt tokens kept before each answer: a repeated question matches from its start
BLOCKS = 4           # a full bucket drops a quarter of its budget at a time (its oldest block)


class _Growing(SuffixAutomaton):
    """The newest block's automaton, extended as answers come."""

    __slots__ = ()

    def go(self, s: int, t: int) -> int:
        """The transition of state s on token t, or -1."""
        return self.next[s].get(t, -1)


class _Frozen:
    """A full block's automaton, never extended again: its transitions in one sorted table (12 bytes each)
    instead of a dict per state (~280 bytes a state), searched by bisection."""

    __slots__ = ("keys", "dest", "link", "length", "end", "tokens")

    def __init__(self, sa: SuffixAutomaton) -> None:
        pairs = sorted(((s << 32) | (t & 0xFFFFFFFF), d) for s, out in enumerate(sa.next) for t, d in out.items())
        self.keys = array("q", [k for k, _ in pairs])
        self.dest = array("i", [d for _, d in pairs])
        self.link, self.length, self.end, self.tokens = sa.link, sa.length, sa.end, sa.tokens

    def go(self, s: int, t: int) -> int:
        k = (s << 32) | (t & 0xFFFFFFFF)
        keys = self.keys
        i = bisect_left(keys, k)
        return self.dest[i] if i < len(keys) and keys[i] == k else -1


class _Block:
    __slots__ = ("sa", "n")

    def __init__(self) -> None:
        self.sa: _Growing | _Frozen = _Growing()
        self.n = 0                      # tokens held (separators not counted)


class HistoryBucket:
    """One key's earlier answers, at most `budget` tokens (oldest block dropped first)."""

    def __init__(self, budget: int, label: str = "") -> None:
        if not isinstance(budget, int) or budget < 1:
            raise InvalidArgument(f"suffix history budget must be an integer >= 1 token, got {budget!r}")
        self.budget = budget
        self.label = label
        self.block_cap = max(1, budget // BLOCKS)
        self.lock = threading.Lock()
        self.blocks: deque[_Block] = deque()
        self.tokens = 0                 # tokens held now
        self.answers = 0                # answers added since start
        self.hits = 0                   # drafts proposed from this bucket
        self.drafted = 0                # tokens in those drafts

    def add(self, answer: Sequence[int], prompt: Sequence[int] = ()) -> int:
        """Keep an answer (and its prompt's last PROMPT_TAIL tokens); returns the tokens kept."""
        seg = [int(t) for t in (*prompt[-PROMPT_TAIL:], *answer)] if answer else []
        if not seg:
            return 0
        seg = seg[:self.budget]
        full = None
        with self.lock:
            block = self.blocks[-1] if self.blocks else None
            if block is None or (block.n and block.n + len(seg) > self.block_cap):
                full = block
                block = _Block()
                self.blocks.append(block)
            sa = block.sa
            sa.extend(SEPARATOR)
            for t in seg:
                sa.extend(t)
            block.n += len(seg)
            self.tokens += len(seg)
            self.answers += 1
            while self.tokens > self.budget and len(self.blocks) > 1:
                self.tokens -= self.blocks.popleft().n
        if full is not None and isinstance(full.sa, _Growing):
            # no one extends it again: its compact form is built without the lock (cursors go on reading the
            # dicts meanwhile) and swapped in, with the same state numbers
            frozen = _Frozen(full.sa)
            with self.lock:
                full.sa = frozen
        return len(seg)

    def cursor(self) -> "HistoryCursor":
        with self.lock:
            return HistoryCursor(self, tuple(self.blocks))

    def clear(self) -> None:
        with self.lock:
            self.blocks.clear()
            self.tokens = 0


class HistoryCursor:
    """A request's view of a bucket: the longest suffix of its context found in each block."""

    __slots__ = ("bucket", "blocks", "state", "length")

    def __init__(self, bucket: HistoryBucket, blocks: tuple[_Block, ...]) -> None:
        self.bucket = bucket
        self.blocks = blocks
        self.state = [0] * len(blocks)
        self.length = [0] * len(blocks)

    def feed(self, tokens: Sequence[int]) -> None:
        if not self.blocks:
            return
        with self.bucket.lock:
            for i, b in enumerate(self.blocks):
                sa = b.sa
                go, link, length = sa.go, sa.link, sa.length
                s, k = self.state[i], self.length[i]
                for t in tokens:
                    d = go(s, t)
                    # min(): a state split since (a later answer) may hold our string in its clone, whose
                    # length can then exceed it; in an automaton as it was built, length[link] < k anyway
                    while d < 0 and s:
                        s = link[s]
                        k = min(k, length[s])
                        d = go(s, t)
                    s = max(d, 0)
                    k = min(k + 1, length[s]) if s else 0
                self.state[i], self.length[i] = s, k

    def match(self) -> tuple[int, int]:
        """(length, block index) of the longest match over the blocks, newest first on ties; (0, -1)."""
        best, where = 0, -1
        for i in range(len(self.blocks) - 1, -1, -1):
            if self.length[i] > best:
                best, where = self.length[i], i
        return best, where

    def continuation(self, where: int, gamma: int) -> list[int]:
        """Up to gamma tokens that followed the match in block `where`, stopping at the answer's end."""
        with self.bucket.lock:
            sa = self.blocks[where].sa
            start = sa.end[self.state[where]] + 1
            out = []
            for t in sa.tokens[start:start + gamma]:
                if t == SEPARATOR:
                    break
                out.append(t)
            return out

    def count(self, n: int) -> None:
        with self.bucket.lock:
            self.bucket.hits += 1
            self.bucket.drafted += n


class SuffixHistory:
    """The service's history: one bucket per key, each bounded by `budget` tokens."""

    def __init__(self, budget: int) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise InvalidArgument(f"suffix history budget must be an integer >= 1 token, got {budget!r}")
        self.budget = budget
        self._lock = threading.Lock()
        self._buckets: dict[Hashable, HistoryBucket] = {}

    def bucket(self, key: Hashable, label: str | None = None) -> HistoryBucket:
        """The bucket of `key` (created empty on first use); label names it in /metrics."""
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = HistoryBucket(self.budget, str(key) if label is None else label)
            return b

    def buckets(self) -> list[HistoryBucket]:
        with self._lock:
            return list(self._buckets.values())

    def stats(self) -> list[tuple[str, int, int, int]]:
        """(label, tokens held, hits, drafted tokens) per bucket, by label."""
        return sorted((b.label, b.tokens, b.hits, b.drafted) for b in self.buckets())
