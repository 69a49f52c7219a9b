"""llama.cpp backend on llama-cpp-python's low-level batch API.

Logits are requested only for the positions asked for (never an n_ctx x n_vocab array), and
rollback is llama_memory_seq_rm on the sequence. A context made with BackendArgs.n_seq > 1 holds that
many sequences (llama.cpp sequence ids 0..n_seq-1), each with its own KV stream of n_ctx cells
(kv_unified off: a sequence's cells stay in position order whatever the others do, so its attention
sums in the same order as alone; with one unified cache, greedy output differed from alone in 2 of 4
runs, docs/batching.md); `eval_rows` evaluates rows of several sequences in one llama_decode
(continuous batching, edgerun/engine/batch.py). The Backend protocol methods (eval, truncate,
tokens) are sequence 0's.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import CachedTokens, check_eval
from .gapfill import GapChooser
from .. import llama_lib
from ..config import BackendArgs
from ..errors import BackendError, InvalidArgument
from ..tokenizer import Tokenizer
from ..engine import handoff
from ..engine.thread import on_engine
from ..util import hugepages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqState:
    """One sequence's saved KV cache (llama.cpp's per-sequence state) and the tokens it holds."""
    tokens: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.tokens)


# evaluations after which a busy backend collapses its memory into huge pages without waiting for idle time:
# the collapse took 1.5 s of CPU for Qwen2.5-1.5B here and a 16-token one-shot shared its 2 cores with it
# (1.0-1.9 s slower); the gain per step is ~1% on Zen 3 (docs/decode.md), more where TLBs are small
HUGE_PAGES_AFTER = 512


def default_threads() -> int:
    import psutil

    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


class LlamaCppBackend(CachedTokens):
    """One GGUF model + its context (KV cache) in llama.cpp."""

    def __init__(self, path: str | Path, args: BackendArgs | None = None, cluster=None) -> None:
        args = args or BackendArgs()
        L = llama_lib.lib()
        before = hugepages.anon_ranges() if args.huge_pages else {}   # what the load adds: weights, KV, buffers
        self._model = llama_lib.Model.load(path, n_gpu_layers=args.n_gpu_layers,
                                           use_mmap=args.use_mmap, use_mlock=args.use_mlock, cluster=cluster)
        self.cluster = cluster
        self.placement = self._model.placement     # where the layers went (edgerun/device/gpu.py)
        self.path = self._model.path
        self.name = f"llama.cpp:{self.path.name}"
        self.tokenizer = Tokenizer(self._model)
        n_ctx_train = L.llama_model_n_ctx_train(self._model.ptr)
        n_ctx = args.n_ctx
        if n_ctx_train > 0 and n_ctx > n_ctx_train:
            log.info("n_ctx %d exceeds the model's training context %d; using %d", n_ctx, n_ctx_train, n_ctx_train)
            n_ctx = n_ctx_train
        self.n_threads = args.n_threads or default_threads()
        self.n_seq: int = args.n_seq
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx * self.n_seq
        cp.n_batch = min(args.n_batch, n_ctx)
        cp.n_ubatch = cp.n_batch
        cp.n_seq_max = self.n_seq
        # one KV stream per sequence (n_ctx cells each): batched attention sums as the sequence's own would
        cp.kv_unified = False
        cp.n_threads = self.n_threads
        cp.n_threads_batch = self.n_threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(self._model.ptr, cp)
        if not self._ctx:
            self._model.close()
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} positions for {self.path} "
                               f"(out of memory?); try a smaller --ctx")
        self._mem = L.llama_get_memory(self._ctx)
        self.n_ctx: int = L.llama_n_ctx(self._ctx) // self.n_seq      # positions per sequence
        self.n_batch: int = cp.n_batch
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        # repacked weights, KV cache and compute buffers are anonymous memory: on 2 MiB pages a decode step
        # costs fewer TLB misses (docs/decode.md, "Huge pages"); mmap'd file pages are left as they are. The
        # collapse helps long runs only and costs a second or more of CPU that a short run's decoding would
        # share: it starts when the process is idle (Runtime.idle: a server between requests, chat waiting
        # for its user) or once this backend has run HUGE_PAGES_AFTER evaluations, on a thread of its own
        self.huge = hugepages.Pending(before, self.path.name, "llama.cpp's model and KV memory") if before else None
        self.n_evals = 0
        self.n_vocab: int = self.tokenizer.n_vocab
        self.weight_bytes: int = int(L.llama_model_size(self._model.ptr))
        self.n_params: int = int(L.llama_model_n_params(self._model.ptr))
        self.flash_attn = args.flash_attn
        self._seqs: list[list[int]] = [[] for _ in range(self.n_seq)]   # tokens cached per sequence
        # whether a gap in a batch's sequence ids is filled or split, timed per shape (_gap_fillers);
        # fill_gaps True / False forces one way (benches, tests), None learns
        self.gaps = GapChooser()
        self.fill_gaps: bool | None = None
        self.tokens: list[int] = self._seqs[0]
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}    # (address, rows) -> a view of llama.cpp's logits

    # -- Backend protocol ---------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        tokens, k = check_eval(self, tokens, n_logits)
        return self.eval_rows([(0, tokens, k)])[0]

    def truncate(self, n: int) -> None:
        self.truncate_seq(0, n)

    # -- several sequences (continuous batching) ----------------------------------------------
    def seq_tokens(self, seq: int) -> list[int]:
        """The tokens cached for sequence `seq` (the list itself: it changes as the sequence does)."""
        return self._seqs[seq]

    def eval_rows(self, rows: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """Append rows[i] = (seq, tokens, k) to their sequences' caches in one llama_decode per n_batch
        positions; return, per row, float32 logits [k, n_vocab] of its last k positions. The tokens are
        checked already (check_eval); a sequence appears at most once. A context of several sequences
        evaluates on the engine thread (on_engine), one of one sequence on the calling thread."""
        out = on_engine(self._eval_rows, rows) if self.n_seq > 1 else self._eval_rows(rows)
        self.n_evals += 1
        if self.huge is not None and self.n_evals >= HUGE_PAGES_AFTER:
            self.huge.start()
        return out

    @property
    def huge_bytes(self) -> int:
        """Bytes of this backend's memory collapsed into huge pages so far (settle() first to wait)."""
        return self.huge.done if self.huge is not None else 0

    def _eval_rows(self, rows: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        L = llama_lib.lib()
        outs = [np.empty((k, self.n_vocab), dtype=np.float32) for _, _, k in rows]
        filled = [0] * len(rows)
        if len(rows) == 1:                      # one sequence (every step of a lone client): no order, no gaps
            seq, toks, k = rows[0]
            base, n = len(self._seqs[seq]), len(toks)
            self._decode_flat(rows, [(0, tok, base + i, i >= n - k) for i, tok in enumerate(toks)], outs, filled)
            return outs
        # the flat list of positions: (row index, token, position in its sequence, wants logits), in order of
        # sequence id. With one KV stream per sequence llama.cpp splits a batch with split_equal(sequential):
        # a ubatch takes sequences only while each id is the previous one + 1, so 4 single rows posted in the
        # order 2, 0, 3, 1 ran as 3 ubatches, 25-30 ms against 21 ms in the order 0, 1, 2, 3 (SmolLM2, 2
        # threads; bench/batch_steps.py). Ids with a gap (an idle slot between) would still split there; where
        # filling the gap is timed faster (_gap_fillers, GapChooser), r = -1 - seq marks a filler position of
        # seq, removed again below.
        flat = []
        for r in sorted(range(len(rows)), key=lambda i: rows[i][0]):
            seq, toks, k = rows[r]
            base, n = len(self._seqs[seq]), len(toks)
            flat.extend((r, tok, base + i, i >= n - k) for i, tok in enumerate(toks))
        shape, fillers = self._gap_fillers(rows)
        if len(flat) + sum(len(t) for _, t in fillers.values()) > self.n_batch:
            shape, fillers = None, {}          # several decodes anyway
        if shape is not None and self.fill_gaps is None and not self.gaps.fill(shape):
            fillers = {}
        if fillers:
            flat = sorted(flat + [(-1 - seq, tok, pos, False) for seq, (pos, toks) in fillers.items()
                                  for pos, tok in enumerate(toks, start=pos)],
                          key=lambda f: (rows[f[0]][0] if f[0] >= 0 else -1 - f[0], f[2]))
        t0 = time.perf_counter()
        try:
            self._decode_flat(rows, flat, outs, filled)
        finally:
            for seq, (pos, _) in fillers.items():
                L.llama_memory_seq_rm(self._mem, seq, pos, -1)
        if shape is not None:
            self.gaps.observe(shape, bool(fillers), time.perf_counter() - t0)
        return outs

    def _gap_fillers(self, rows) -> tuple[tuple[int, int, int] | None, dict[int, tuple[int, list[int]]]]:
        """The batch's gap shape and filler positions for the idle sequence ids between the rows' ids:
        (shape, {seq: (first position, tokens)}); (None, {}) where there is no gap to fill.

        split_equal(sequential) starts a new ubatch at every gap in the ids (rows of sequences 0, 1, 3 run
        as two passes over the weights: [0, 1] and [3]). Where every row has the same length n, an idle
        sequence in the gap can get n throw-away positions after its cached ones (no logits; removed right
        after the decode), making the step one pass of a few more rows. Whether that is faster is timed per
        shape (GapChooser). The rows' own results are those of the batch they are in (each sequence attends
        only to its own KV stream). Unequal rows split anyway (a speculating sequence's gamma+1 rows beside
        single rows, an admitted prompt), so nothing is filled there."""
        lengths = {len(toks) for _, toks, _ in rows}
        if self.fill_gaps is False or len(rows) < 2 or len(lengths) != 1:
            return None, {}
        n = lengths.pop()
        ids = sorted(seq for seq, _, _ in rows)
        gaps = [s for s in range(ids[0], ids[-1] + 1) if s not in set(ids)]
        if not gaps or n > 8 or len(gaps) > len(ids):
            return None, {}
        tok = rows[0][1][0]
        fillers = {}
        for seq in gaps:
            base = len(self._seqs[seq])
            if base + n > self.n_ctx:
                return None, {}                # no room in that sequence: split as llama.cpp would
            fillers[seq] = (base, [tok] * n)
        return (len(ids), len(gaps), n), fillers

    def _decode_flat(self, rows, flat, outs, filled) -> None:
        """llama_decode the flat positions in chunks of n_batch and copy the requested logits to outs."""
        L = llama_lib.lib()
        b = self._batch
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start:start + self.n_batch]
            for i, (r, tok, pos, want) in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = rows[r][0] if r >= 0 else -1 - r
                b.logits[i] = want
            b.n_tokens = len(chunk)
            handoff.flush()                     # tokens handed to other threads: their Python runs beside this
            handoff.native(True)
            try:
                rc = L.llama_decode(self._ctx, b)
            finally:
                handoff.native(False)
            if rc != 0:
                for seq, _, _ in rows:          # drop what the failed batch left
                    L.llama_memory_seq_rm(self._mem, seq, len(self._seqs[seq]), -1)
                raise BackendError(f"llama_decode failed with code {rc} "
                                   f"({len(rows)} sequence(s), {len(chunk)} positions)")
            n_out = 0
            for r, tok, _, want in chunk:
                if r >= 0:
                    self._seqs[rows[r][0]].append(tok)
                n_out += want
            if n_out:
                # logits of the requested positions, in batch order: [n_out, n_vocab]
                got = self._logits(L, n_out)
                if len(rows) == 1:              # one sequence: its rows in one copy
                    outs[0][filled[0]:filled[0] + n_out] = got
                    filled[0] += n_out
                    continue
                j = 0
                for r, _, _, want in chunk:
                    if want:
                        outs[r][filled[r]] = got[j]
                        filled[r] += 1
                        j += 1

    def _logits(self, L, n_out: int) -> np.ndarray:
        """The last decode's n_out rows of logits, a view of llama.cpp's output buffer (valid until the next
        decode). Views are kept per (buffer address, rows): np.ctypeslib.as_array builds a ctypes array type
        per call, ~60 µs a token between two evaluations of a 135M model (docs/batching.md)."""
        addr = ctypes.cast(L.llama_get_logits(self._ctx), ctypes.c_void_p).value
        view = self._logits_views.get((addr, n_out))
        if view is None:
            if not addr:
                raise BackendError("llama.cpp returned no logits for the batch")
            if len(self._logits_views) > 64:        # the buffer moved or many row counts: start over
                self._logits_views.clear()
            buf = (ctypes.c_float * (n_out * self.n_vocab)).from_address(addr)
            view = self._logits_views[(addr, n_out)] = np.frombuffer(buf, dtype=np.float32).reshape(n_out, self.n_vocab)
        return view

    def save_seq(self, seq: int) -> "SeqState":
        """A copy of sequence `seq`'s KV cache and tokens (llama_state_seq_get_data), to restore later into
        any sequence of this context (the serve prompt cache)."""
        L = llama_lib.lib()
        size = int(L.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * max(size, 1))()
        got = int(L.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if got != size:
            raise BackendError(f"llama.cpp copied {got} of {size} bytes of sequence {seq}'s state")
        return SeqState(tuple(self._seqs[seq]), bytes(buf)[:size])

    def restore_seq(self, seq: int, state: "SeqState") -> None:
        """Replace sequence `seq`'s cache with a saved one (llama_state_seq_set_data); on failure the
        sequence is left empty (a fresh prefill follows) and BackendError is raised."""
        L = llama_lib.lib()
        self.truncate_seq(seq, 0)
        buf = (ctypes.c_uint8 * max(len(state.data), 1)).from_buffer_copy(state.data or b"\0")
        if int(L.llama_state_seq_set_data(self._ctx, buf, len(state.data), seq)) == 0:
            L.llama_memory_seq_rm(self._mem, seq, 0, -1)
            raise BackendError(f"llama.cpp could not restore a saved state of {len(state.tokens)} positions "
                               f"into sequence {seq}")
        self._seqs[seq][:] = state.tokens

    def move_seq(self, src: int, dst: int) -> None:
        """Move sequence src's cache to sequence dst (whose own cache is dropped); src is left empty. The
        token lists move with the caches: the list that was src's (a holder of it, such as a batch view,
        sees its tokens unchanged) is dst's now, and dst's former list, emptied, is src's."""
        if src == dst:
            return
        a, b = self._seqs[src], self._seqs[dst]
        state = self.save_seq(src)
        self.restore_seq(dst, state)
        self.truncate_seq(src, 0)
        self._seqs[src], self._seqs[dst] = b, a
        a[:] = state.tokens
        b.clear()

    def save_state(self) -> "SeqState":
        return self.save_seq(0)

    def restore_state(self, state: "SeqState") -> None:
        self.restore_seq(0, state)

    def truncate_seq(self, seq: int, n: int) -> None:
        """Keep the first n positions of sequence `seq` (rollback)."""
        if n < 0:
            raise InvalidArgument(f"truncate needs n >= 0, got {n}")
        toks = self._seqs[seq]
        n = min(n, len(toks))
        # always remove [n, end): a KeyboardInterrupt landing between llama_decode and the bookkeeping
        # may have left positions in the cache that the token list does not hold
        llama_lib.lib().llama_memory_seq_rm(self._mem, seq, n, -1)
        del toks[n:]

    def close(self) -> None:
        L = llama_lib.lib()
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        # the model stays alive while the tokenizer (shared) is referenced

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except (AttributeError, TypeError):
            pass
