"""Which llama.cpp sequence id each generation slot runs on, kept packed.

With one KV stream per sequence llama.cpp cuts a batch at every gap in the sequence ids, so busy sequences
0 and 2 cost two passes over the weights (or a filler row, backends/gapfill.py) where 0 and 1 cost one
(docs/batching.md has the cost). A job is placed on the free slot that keeps the busy ids packed
(`best_slot`), with the cache of a free slot that holds a longer prefix of its prompt copied in first
(`bring_prefix`); a gap that a finished job leaves is closed by moving the highest busy sequence into it
(`compact`, BatchGroup.move). The scheduler says which slots are free; this module decides where.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ..backends.base import common_prefix
from ..errors import EdgerunError

log = logging.getLogger(__name__)


def runs(ids: set[int]) -> int:
    """Runs of consecutive integers in ids: {0, 1, 3} -> 2."""
    return sum(1 for i in ids if i - 1 not in ids)


class SeqPacking:
    """The sequence ids of the generation slots (one Runtime each, Runtime.slots) and the moves that keep
    the busy ones packed. prompt_cache (serve/promptcache.PromptCache or None) keeps a cache that a copy
    would overwrite when restoring it would save at least min_gain positions."""

    def __init__(self, slots: Sequence[Any] = (), prompt_cache: Any = None, min_gain: int = 0) -> None:
        self.slots = list(slots)
        self.prompt_cache = prompt_cache
        self.min_gain = min_gain
        self.n_moved = 0                            # caches copied to the slot a job was placed on

    def seq_id(self, slot: int) -> int:
        """The sequence id slot `slot` runs on now (its target view's; compact changes it)."""
        return getattr(self.slots[slot].target, "seq", slot)

    def best_slot(self, free: Sequence[int]) -> int:
        """Of the free slots, the one whose sequence id keeps the busy ids packed (fewest runs of consecutive
        ids; the lowest on ties)."""
        seq = self.seq_id
        busy = {seq(i) for i in range(len(self.slots)) if i not in free}
        return min(free, key=lambda i: (runs(busy | {seq(i)}), seq(i)))

    def bring_prefix(self, free: Sequence[int], best: int, prompt: Sequence[int]) -> None:
        """If another free slot's cache holds a longer prefix of the prompt than slot `best` (a conversation's
        next turn finds its history), copy that cache into `best` (a per-sequence state copy, ~1 ms per 100
        positions) instead of running the job where the prefix happens to be."""
        have = {i: common_prefix(self.slots[i].target.tokens, prompt) for i in free}
        holder = max(free, key=lambda i: (have[i], i == best))
        if have[holder] >= have[best] + self.min_gain:        # a copy must save what a restore must
            self._move_prefix(holder, best, have[best])

    def _move_prefix(self, src: int, dst: int, dst_kept: int) -> None:
        """Copy free slot src's cache into free slot dst (dst's own, if it would be lost, into the prompt
        cache first). A failure is logged: the job then evaluates its prompt."""
        to, frm = self.slots[dst].target, self.slots[src].target
        try:
            if self.prompt_cache is not None and len(to.tokens) - dst_kept >= self.min_gain:
                self.prompt_cache.put(to.save_state())
            to.restore_state(frm.save_state())
            self.n_moved += 1
        except EdgerunError as e:
            log.warning("copying slot %d's cache to slot %d: %s; evaluating the prompt instead", src, dst, e)

    def compact(self, group: Any, idle_now: Callable[[], "set[int] | None"]) -> None:
        """Close the gaps a finished job left in the busy sequence ids: move the highest busy sequence into
        the idle id that packs the busy ones best (BatchGroup.move, at the running sequences' next step).
        idle_now() gives the idle slots, or None when jobs wait: the freed slot takes one at once (a move
        would hold its admission for a step) and best_slot places it. The idle slot's own cache goes to the
        prompt cache first when a restore would pay; a move whose sequence ends meanwhile ends with it, and
        a job that comes while a move waits for its step cancels it (BatchGroup.cancel_moves)."""
        seq = self.seq_id
        for _ in range(len(self.slots)):
            idle = idle_now()
            if idle is None:
                return
            busy = [i for i in range(len(self.slots)) if i not in idle]
            ids = {seq(i) for i in busy}
            if not idle or runs(ids) <= 1:
                return
            src = max(busy, key=seq)
            rest = ids - {seq(src)}
            dst = min((i for i in idle if seq(i) < seq(src)), key=lambda i: (runs(rest | {seq(i)}), seq(i)),
                      default=None)
            if dst is None or runs(rest | {seq(dst)}) >= runs(ids):
                return
            to = self.slots[dst].target
            if self.prompt_cache is not None and len(to.tokens) >= self.min_gain:
                try:
                    self.prompt_cache.put(to.save_state())
                except EdgerunError as e:
                    log.warning("saving slot %d's cache before moving a sequence there: %s", dst, e)
            # at the next step: a few steps' time at most (then the gap stays until the next job ends)
            step_s = group.eval_s / group.n_steps if group.n_steps else 0.1
            if not group.move(self.slots[src].batch_views(), self.slots[dst].batch_views(),
                              timeout_s=min(2.0, max(0.1, 3 * step_s))):
                return
