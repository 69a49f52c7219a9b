"""The draft both model-free drafters make (prompt lookup, suffix lookup): copy what followed an earlier
occurrence of the context's end, as a point mass under the grammar."""

from __future__ import annotations

from typing import Sequence

from ..constrain.base import Constraint


def copy_draft(tokens: Sequence[int], start: int, length: int, gamma: int,
               constraint: Constraint | None) -> list[int]:
    """gamma tokens from tokens[start:]; a copy that runs into the end (`length`, where the context ends)
    continues with its own output (an overlapping copy, as in LZ77), so periodic text drafts a full gamma.
    Under a constraint the draft is cut at its first forbidden token, the rest consumed into it."""
    out = list(tokens[start:start + gamma])
    while len(out) < gamma:
        out.append(out[len(out) - (length - start)])
    if constraint is not None:
        for i, x in enumerate(out):
            if not constraint.continuing_mask()[x]:
                del out[i:]
                break
            constraint.consume(x)
    return out
