"""llama.cpp backend on llama-cpp-python's low-level batch API.

Logits are requested only for the positions asked for (never an n_ctx x n_vocab array), and
rollback is llama_memory_seq_rm on the single sequence.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import check_eval
from .. import llama_lib
from ..config import BackendArgs
from ..errors import BackendError, InvalidArgument
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)


def default_threads() -> int:
    import psutil

    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


class LlamaCppBackend:
    """One GGUF model + its context (KV cache) in llama.cpp."""

    def __init__(self, path: str | Path, args: BackendArgs | None = None, cluster=None) -> None:
        args = args or BackendArgs()
        L = llama_lib.lib()
        self._model = llama_lib.Model.load(path, n_gpu_layers=args.n_gpu_layers,
                                           use_mmap=args.use_mmap, use_mlock=args.use_mlock, cluster=cluster)
        self.cluster = cluster
        self.path = self._model.path
        self.name = f"llama.cpp:{self.path.name}"
        self.tokenizer = Tokenizer(self._model)
        n_ctx_train = L.llama_model_n_ctx_train(self._model.ptr)
        n_ctx = args.n_ctx
        if n_ctx_train > 0 and n_ctx > n_ctx_train:
            log.info("n_ctx %d exceeds the model's training context %d; using %d", n_ctx, n_ctx_train, n_ctx_train)
            n_ctx = n_ctx_train
        self.n_threads = args.n_threads or default_threads()
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(args.n_batch, n_ctx)
        cp.n_ubatch = cp.n_batch
        cp.n_seq_max = 1
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
        self.n_ctx: int = L.llama_n_ctx(self._ctx)
        self.n_batch: int = cp.n_batch
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_vocab: int = self.tokenizer.n_vocab
        self.weight_bytes: int = int(L.llama_model_size(self._model.ptr))
        self.n_params: int = int(L.llama_model_n_params(self._model.ptr))
        self.flash_attn = args.flash_attn
        self.tokens: list[int] = []

    # -- Backend protocol ---------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def vocab_fingerprint(self) -> str:
        return self.tokenizer.vocab_fingerprint

    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        tokens, k = check_eval(self, tokens, n_logits)
        n = len(tokens)
        L = llama_lib.lib()
        out = np.empty((k, self.n_vocab), dtype=np.float32)
        filled = 0
        b = self._batch
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            n_out = 0
            for i, tok in enumerate(chunk):
                want = start + i >= n - k
                b.token[i] = tok
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = want
                n_out += want
            b.n_tokens = len(chunk)
            rc = L.llama_decode(self._ctx, b)
            if rc != 0:
                L.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)   # drop what the failed batch left
                raise BackendError(f"llama_decode failed with code {rc} at position {self.n_past}")
            self.tokens.extend(chunk)
            if n_out:
                ptr = L.llama_get_logits(self._ctx)
                # logits of the n_out requested positions, in order: [n_out, n_vocab]
                out[filled:filled + n_out] = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
                filled += n_out
        return out

    def truncate(self, n: int) -> None:
        if n < 0:
            raise InvalidArgument(f"truncate needs n >= 0, got {n}")
        n = min(n, len(self.tokens))
        # always remove [n, end): a KeyboardInterrupt landing between llama_decode and the bookkeeping
        # below may have left positions in the cache that `tokens` does not list
        llama_lib.lib().llama_memory_seq_rm(self._mem, 0, n, -1)
        del self.tokens[n:]

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
