"""The Backend protocol: what the decode loop needs from an inference engine.

A backend owns one model and its KV cache. Positions are appended with `eval` and removed
with `truncate`; `tokens` mirrors what the cache holds, so `n_past == len(tokens)`.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ContextOverflow, InvalidArgument


@runtime_checkable
class Backend(Protocol):
    name: str                  # e.g. "llama.cpp:/path/model.gguf"
    n_vocab: int               # rows of the logits (may include padding entries)
    n_ctx: int                 # context window in positions
    tokens: list[int]          # tokens whose K/V are in the cache, in order
    vocab_fingerprint: str     # sha256 over token strings/types/specials (see tokenizer.py)
    weight_bytes: int          # bytes of weights read per forward pass: feeds the cost model
    tokenizer: "object"        # edgerun.tokenizer.Tokenizer

    @property
    def n_past(self) -> int: ...

    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        """Append `tokens` to the cache; return float32 logits [k, n_vocab] for the last k positions.

        k = len(tokens) when n_logits is None; n_logits = 0 returns an empty [0, n_vocab] array
        (prefill without logits). Raises ContextOverflow if the cache would exceed n_ctx.
        """
        ...

    def truncate(self, n: int) -> None:
        """Keep the first n positions of the cache (rollback)."""
        ...

    def close(self) -> None: ...

    # Optional: begin_eval(tokens, n_logits=None) -> a function waiting for eval()'s logits, or None where
    # the backend cannot evaluate in the background now (then eval). The decode loop uses it for plain
    # decoding (engine/sequence.py's SeqBackend: a lone sequence of a batching group).


class CachedTokens:
    """The Backend protocol's derived attributes, shared by the engines: `tokens` mirrors the cache, and the
    vocabulary is the tokenizer's."""

    tokens: list[int]
    tokenizer: "object"

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def vocab_fingerprint(self) -> str:
        return self.tokenizer.vocab_fingerprint


def check_eval(backend: Backend, tokens: Sequence[int], n_logits: int | None) -> tuple[list[int], int]:
    """The argument checks every backend's eval makes. Returns (tokens as ints, k logits rows to return).
    Called once a token on a lone client's path: keep it lean (no import here, ~30 µs a call right after an
    evaluation has pushed the interpreter out of the caches)."""
    toks = [int(t) for t in tokens]
    n = len(toks)
    k = n if n_logits is None else max(0, min(n_logits, n))
    if backend.n_past + n > backend.n_ctx:
        raise ContextOverflow(
            f"{backend.n_past} cached + {n} new positions exceed the context of {backend.n_ctx}; "
            f"load the model with a larger n_ctx or shorten the input")
    bad = [t for t in toks if not 0 <= t < backend.n_vocab]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{backend.n_vocab - 1})")
    return toks, k


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: the KV-cache positions a new context can keep."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
