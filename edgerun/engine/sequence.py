"""One sequence of a multi-sequence llama.cpp backend as a Backend: the view a decode loop of a batching
group evaluates through (its rows go to the group's next step)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backends.base import check_eval


class SeqBackend:
    """One sequence of a multi-sequence llama.cpp backend, as a Backend for the decode loop."""

    def __init__(self, group, backend, seq: int) -> None:     # group: its BatchGroup
        if not 0 <= seq < backend.n_seq:
            raise ValueError(f"sequence {seq} is outside the backend's {backend.n_seq} sequences")
        self.group, self.shared, self.seq = group, backend, seq
        self.name = backend.name
        self.n_vocab = backend.n_vocab
        self.n_ctx = backend.n_ctx
        self.weight_bytes = backend.weight_bytes
        self.tokenizer = backend.tokenizer
        self.tokens = backend.seq_tokens(seq)

    @property
    def vocab_fingerprint(self) -> str:
        return self.shared.vocab_fingerprint    # on demand: hashing a vocabulary costs 0.1-0.4 s

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        toks, k = check_eval(self, tokens, n_logits)
        if not toks:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return self.group.eval(self, toks, k)

    def begin_eval(self, tokens: Sequence[int], n_logits: int | None = None):
        """eval() started in the background where it can be (this sequence's member is alone in its group):
        returns a function that waits for the logits, or None (then call eval). The decode loop hands over
        a token's text while its next evaluation runs (generate.py)."""
        toks, k = check_eval(self, tokens, n_logits)
        if not toks:
            return None
        return self.group.begin(self, toks, k)

    def truncate(self, n: int) -> None:
        self.group.truncate(self, n)

    def save_state(self):
        """This sequence's saved cache (the shared backend's save_seq, between the group's evaluations)."""
        with self.group._engine:
            return self.shared.save_seq(self.seq)

    def restore_state(self, state) -> None:
        with self.group._engine:
            self.shared.restore_seq(self.seq, state)

    def close(self) -> None:
        """The shared backend is closed by its owner (the Runtime), not by a sequence."""
