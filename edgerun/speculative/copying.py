"""What both model-free drafters share (prompt lookup, suffix lookup): the hint class of a match's length,
and the draft itself, a copy of what followed an earlier occurrence of the context's end, as a point mass
under the grammar."""

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
    return cut_to_grammar(out, constraint)


def cut_to_grammar(out: list[int], constraint: Constraint | None) -> list[int]:
    """A draft cut at its first token the grammar forbids, the rest consumed into the constraint."""
    if constraint is not None:
        for i, x in enumerate(out):
            if not constraint.continuing_mask()[x]:
                del out[i:]
                break
            constraint.consume(x)
    return out


def match_class(k: int) -> int:
    """The tuner's hint class of a k-token match: 1, 2, 3-4, 5-8, 9-16, 17+ -> 0..5 (acceptance is learned
    per class: a longer match is likelier to continue)."""
    return 0 if k <= 1 else 1 if k == 2 else 2 if k <= 4 else 3 if k <= 8 else 4 if k <= 16 else 5


# The prior acceptance of a copied draft per match class (the tuner's starting point, learned away by each
# class's own drafts: speculative/acceptance.py): about the share of drafts whose first token is right on plain
# greedy answers to issue 52's six workloads, lower of SmolLM2's and Qwen-1.5B's (`python bench/suffix_classes.py`;
# docs/free_drafts.md). Without it every class started at one pooled prior (0.6), at which no draft pays on a CPU
# whose cost curve rises steeply, so even a file copied whole was decoded plain until an exploration every ~85
# cycles had taught its long matches.
MATCH_PRIOR = (0.25, 0.33, 0.55, 0.7, 0.9, 0.95)

