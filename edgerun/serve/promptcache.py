"""PromptCache: finished sequences' KV caches kept in RAM, restored for a prompt that starts the same way.

A slot's cache holds its last request (prompt + answer) until the next request overwrites it. Before that
happens the scheduler saves it here (llama.cpp's per-sequence state: about 29 KB per position for
Qwen2.5-Coder-1.5B); a later request whose prompt shares a longer prefix with a saved sequence than with its
slot's own cache gets that state restored instead of evaluating the prefix again (a repeated system prompt,
a retried request, a conversation whose slot was taken by another client). llama-server does the same with
its `--cache-ram`. Bounded by bytes, least recently used out first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

import psutil

from ..backends.base import common_prefix
from ..errors import EdgerunError

log = logging.getLogger(__name__)

MIN_GAIN = 4           # positions a restore must save over the slot's own cache: a restore is a copy of
                       # about 29 KB per position (Qwen-1.5B: 100 in 1 ms), far cheaper than evaluating 4


def sized(mib: int) -> "PromptCache | None":
    """The server's cache: `mib` MiB (0: none), but never more than a quarter of the RAM available now, so a
    small board's cache cannot take the memory the model and its KV caches were checked against."""
    if mib <= 0:
        return None
    want = mib * 1024 * 1024
    cap = psutil.virtual_memory().available // 4
    if want > cap:
        log.warning("prompt cache: %d MiB asked, %d MiB available; keeping it to %d MiB (a quarter)",
                    mib, cap * 4 // 2**20, cap // 2**20)
        want = cap
    return PromptCache(int(want))


class PromptCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()   # tokens -> SeqState, oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0               # restores
        self.saved_positions = 0    # prompt positions the restores did not evaluate

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, prompt: Sequence[int]) -> tuple[int, Any]:
        """(shared prefix length, state) of the saved sequence sharing the longest prefix with `prompt`."""
        with self._lock:
            best_n, best = 0, None
            for toks, st in self._entries.items():
                n = common_prefix(toks, prompt)
                if n > best_n:
                    best_n, best = n, st
            if best is not None:
                self._entries.move_to_end(best.tokens)
            return best_n, best

    def put(self, state: Any) -> None:
        """Keep a saved sequence (one whose tokens another entry already starts with replaces it; one that is
        a prefix of an entry is not kept); evict the least recently used past max_bytes."""
        if state.nbytes > self.max_bytes or not state.tokens:
            return
        with self._lock:
            for toks in list(self._entries):
                if len(toks) >= len(state.tokens) and toks[:len(state.tokens)] == state.tokens:
                    self._entries.move_to_end(toks)
                    return                                   # already held, or held longer
                if toks == state.tokens[:len(toks)]:
                    self._bytes -= self._entries.pop(toks).nbytes
            self._entries[state.tokens] = state
            self._bytes += state.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes

    def prepare(self, target: Any, prompt: Sequence[int]) -> int:
        """Before a request runs on a slot whose cache is `target`: save what the request would overwrite,
        and restore a saved sequence if it shares at least MIN_GAIN more positions with the prompt than the
        slot's own cache. Returns the positions restored (0: none). Failures are logged, never raised: the
        request then simply evaluates its prompt."""
        own = common_prefix(target.tokens, prompt)
        n, state = self.best(prompt)
        restore = state is not None and n >= own + MIN_GAIN
        try:
            if len(target.tokens) - own >= MIN_GAIN:        # the request would overwrite these positions
                self.put(target.save_state())
            if restore:
                target.restore_state(state)
                self.hits += 1
                self.saved_positions += n - own
                return n
        except EdgerunError as e:
            log.warning("prompt cache: %s; evaluating the prompt instead", e)
        return 0
