"""Exact numpy backend: the Backend protocol on the reference forward (edgerun/reference/llama.py).

Slow and deterministic; it exists to prove things (greedy speculative == greedy plain, rollback,
the sampler's distribution) on the same tiny GGUF models llama.cpp loads. Weights are dequantized
to float64 by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .base import CachedTokens, check_eval
from ..errors import InvalidArgument
from ..reference.llama import ReferenceModel
from ..tokenizer import Tokenizer


class ReferenceBackend(CachedTokens):
    """One ReferenceModel + its KV cache. `source` is a GGUF path or an already built ReferenceModel
    (then `tokenizer` is required: e.g. the Tokenizer of the GGUF the weights came from)."""

    def __init__(self, source: str | Path | ReferenceModel, *, tokenizer=None, n_ctx: int | None = None,
                 dtype=np.float64, name: str | None = None) -> None:
        if isinstance(source, ReferenceModel):
            if tokenizer is None:
                raise InvalidArgument("ReferenceBackend(model) needs tokenizer=...: a ReferenceModel "
                                      "carries weights only")
            self.model = source
            self.name = name or "reference:<weights>"
        else:
            path = Path(source)
            self.model = ReferenceModel.from_gguf(path, dtype=dtype)
            tokenizer = tokenizer or Tokenizer.from_gguf(path)
            self.name = name or f"reference:{path.name}"
        self.tokenizer = tokenizer
        self.n_vocab: int = self.model.n_vocab
        self.n_ctx: int = n_ctx or self.model.cfg.n_ctx_train
        if self.n_ctx < 1:
            raise InvalidArgument(f"n_ctx must be >= 1, got {self.n_ctx}")
        self.weight_bytes: int = sum(int(t.nbytes) for t in self.model.tensors.values())
        self.tokens: list[int] = []
        self._cache = self.model.new_cache()
        self.n_evals = 0           # forward calls made: lets tests check what the decode loop batches

    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        tokens, k = check_eval(self, tokens, n_logits)
        n = len(tokens)
        if n == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        logits = self.model.forward(tokens, self._cache)       # [n, V]
        self.n_evals += 1
        self.tokens.extend(tokens)
        return np.ascontiguousarray(logits[n - k:], dtype=np.float32)

    def truncate(self, n: int) -> None:
        if n < 0:
            raise InvalidArgument(f"truncate needs n >= 0, got {n}")
        if n >= len(self.tokens):
            return
        self._cache.truncate(n)
        del self.tokens[n:]

    def close(self) -> None:
        self.tokens = []
        self._cache = self.model.new_cache()
