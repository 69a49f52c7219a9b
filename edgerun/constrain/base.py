"""The Constraint protocol: what the decode loop and the drafters ask of a grammar.

A constraint follows the tokens generated so far. `mask()` is the set of tokens allowed next
(bool [n_vocab]); `consume(t)` advances by one token; `rollback(n)` forgets the last n. The loop
consumes every drafted token while drafting (so the mask of each drafted position exists), and
after verification rolls back the rejected ones and consumes the token that replaced them: after
every cycle the constraint holds exactly the committed tokens.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Constraint(Protocol):
    n_vocab: int               # width of the masks (the target's logits rows)
    tokens: list[int]          # tokens consumed, in order

    def mask(self) -> np.ndarray:
        """bool [n_vocab]: the tokens allowed after `tokens` (end-of-generation only where the grammar accepts)."""
        ...

    def continuing_mask(self) -> np.ndarray:
        """mask() without the end-of-generation tokens: what a drafter may propose (it never drafts an end)."""
        ...

    def mask_at(self, k: int) -> np.ndarray:
        """The mask after the first k consumed tokens (k <= len(tokens))."""
        ...

    def consume(self, token: int) -> None:
        """Advance by one allowed token (InvalidArgument if the grammar does not allow it)."""
        ...

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first n consumed tokens."""
        ...

    def is_accepting(self) -> bool: ...

    def reset(self) -> None: ...


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """logits [V] with every token the mask forbids set to -inf (a copy). A mask narrower than the
    logits forbids the extra rows (a drafter with a larger vocabulary); a wider one is cut."""
    V = logits.shape[-1]
    m = mask[:V]
    if len(m) < V:
        m = np.concatenate([m, np.zeros(V - len(m), dtype=bool)])
    return np.where(m, logits, -np.inf).astype(logits.dtype, copy=False)


def allows(mask: np.ndarray, tokens: Sequence[int]) -> bool:
    return all(0 <= t < len(mask) and bool(mask[t]) for t in tokens)


def forced_run(constraint, is_eog: Callable[[int], bool], budget: int) -> list[int]:
    """Up to `budget` tokens, each the only one the grammar allows after the ones before it, consumed into the
    constraint; an end-of-generation token ends the run (last, not consumed)."""
    run: list[int] = []
    while len(run) < budget:
        tok = constraint.forced_token()
        if tok is None or (not is_eog(tok) and constraint.is_end(tok)):
            break                                  # a choice, or an end this loop's is_eog does not end on
        run.append(tok)
        if is_eog(tok):
            break
        constraint.consume(tok)
    return run
