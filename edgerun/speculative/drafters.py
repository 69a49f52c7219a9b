"""Drafters: what proposes the tokens the target verifies. A model on its own backend, or prompt lookup.

A drafter's `propose(context, gamma, sampling, rng, constraint)` returns (tokens, q): up to gamma
drafted tokens and q, one `Dist` over the target's ids per token (speculative/sampling.py: the distribution
it was drawn from, after the same sampling transforms the target gets; with top-k a few dozen
entries, not a vocabulary-sized row), or q None when the draft is a deterministic function of the
context (prompt lookup; any drafter under greedy decoding): verify then treats it as a point mass. With a constraint (a grammar), a model drafter
masks each position's logits with the grammar state after the drafts before it and consumes each
drafted token into the constraint; a point-mass drafter cuts its draft at the first token the
grammar forbids (cutting a deterministic draft changes nothing; cutting a sampled one would bias the
output). Drafts never hold an end-of-generation token under a constraint. A drafter keeps its own state in step lazily: every call
receives the whole committed context and first rolls back to the common prefix.

Before each cycle the loop asks `hint(context, logits)` (logits: the target's row [V] at the last
verified position, None before the first cycle): None when the drafter has nothing to offer for this
context (no cycle is spent asking), else a class in 0..n_classes-1 that predicts how well its draft
will be accepted (prompt lookup: the length of the verbatim match; a model: how clearly the target's
last choice stood out, `margin_class`). The gamma tuner keeps one acceptance model per class, so what
it learned on one text (a code file: confident positions, drafts accepted) carries over to another
(prose: few confident positions) instead of being averaged into one rate. A drafter with two kinds of draft
(speculative/combined.py) may offer a tuple of classes; the loop lets the policy pick one (GammaTuner.pick) and
tells the drafter with `use(class)`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..backends.base import Backend, common_prefix
from ..config import BackendArgs, SamplingArgs, SpeculativeArgs
from ..constrain.base import Constraint, apply_mask
from ..errors import InvalidArgument, VocabMismatch
from ..tokenizer import is_padding
from .sampling import Dist, dist, greedy_token
from .copying import MATCH_PRIOR, copy_draft, match_class
from .suffix import SuffixDrafter

log = logging.getLogger(__name__)



@runtime_checkable
class Drafter(Protocol):
    name: str
    vocab_fingerprint: str | None     # None: model-free, fits any vocabulary
    weight_bytes: int                 # bytes read per drafted token (0 for model-free)
    n_classes: int                    # hint classes (1: the drafter gives no hint)

    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | None: ...

    def lag(self, context: Sequence[int]) -> int:
        """Positions the drafter must evaluate before its first draft after `context` (its cache's
        catch-up; 0 for a model-free drafter). An estimate, O(1): the tuner prices exploration with it."""
        ...

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs,
                rng: np.random.Generator, constraint: Constraint | None = None
                ) -> tuple[list[int], np.ndarray | None]: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------- vocabulary

def shared_vocab(target: Backend, drafter: Backend) -> int:
    """Check that the drafter speaks the target's vocabulary; return how many leading ids they share.

    Equal fingerprints share everything. Otherwise the token lists must agree (text, type, BOS/EOS)
    up to the shorter one, and the longer one may only add padding entries at its end (Qwen2.5
    ships 151,665 real tokens padded to 151,936 rows). Anything else raises VocabMismatch naming
    both models and the first token that differs.
    """
    t_tok, d_tok = target.tokenizer, drafter.tokenizer
    if target.vocab_fingerprint == drafter.vocab_fingerprint:
        return min(t_tok.n_vocab, d_tok.n_vocab, target.n_vocab, drafter.n_vocab)
    expect = "expected the same vocabulary (a drafter from the target's model family), or one that " \
             "differs only by padding entries at the end"
    if (t_tok.bos_id, t_tok.eos_id) != (d_tok.bos_id, d_tok.eos_id):
        raise VocabMismatch(
            f"drafter {drafter.name} and target {target.name} have different special tokens: "
            f"BOS/EOS {d_tok.bos_id}/{d_tok.eos_id} vs {t_tok.bos_id}/{t_tok.eos_id}; {expect}")
    t_texts, d_texts = t_tok.token_texts(), d_tok.token_texts()
    t_types, d_types = t_tok.token_types(), d_tok.token_types()
    n = min(len(t_texts), len(d_texts))
    for i in range(n):
        if t_texts[i] != d_texts[i] or t_types[i] != d_types[i]:
            raise VocabMismatch(
                f"drafter {drafter.name} and target {target.name} have different vocabularies: "
                f"token {i} is {d_texts[i]!r} (type {d_types[i]}) in the drafter but {t_texts[i]!r} "
                f"(type {t_types[i]}) in the target; {expect}")
    longer_texts, longer_types, who = (t_texts, t_types, target) if len(t_texts) > n else (d_texts, d_types, drafter)
    for i in range(n, len(longer_texts)):
        if not is_padding(longer_texts[i], longer_types[i]):
            raise VocabMismatch(
                f"drafter {drafter.name} has {len(d_texts)} tokens and target {target.name} has "
                f"{len(t_texts)}: token {i} {longer_texts[i]!r} of {who.name} is a real token, not "
                f"padding; {expect}")
    log.info("drafter %s and target %s share %d tokens; the rest are padding and are never drafted",
             drafter.name, target.name, n)
    return min(n, target.n_vocab, drafter.n_vocab)


# ---------------------------------------------------------------------------------- drafters

# margin_class: a target logit row's classes by how far its top logit stands above the rest
MARGINS = (1.0, 3.0, 6.0)


def margin_class(logits: np.ndarray | None) -> int:
    """0: another token within MARGINS[0] logits of the top one; 1, 2: none within MARGINS[0], MARGINS[1]
    ...; len(MARGINS): the top logit alone within MARGINS[-1]. None (no row yet) -> 1. Two passes over the
    row (its argmax, then the largest of the others: ~28 us for a 152k vocabulary, where a comparison mask
    took ~64 us); the decode loop calls it once per cycle."""
    if logits is None:
        return 1
    i = int(logits.argmax())
    m = logits[i]
    if not np.isfinite(m):
        return len(MARGINS)
    second = max(logits[:i].max(initial=-np.inf), logits[i + 1:].max(initial=-np.inf))
    return int(np.searchsorted(MARGINS, m - second, side="right"))


class ModelDrafter:
    """A smaller model of the same vocabulary on its own backend (and KV cache)."""

    n_classes = len(MARGINS) + 1

    def __init__(self, backend: Backend, target: Backend | None = None, *, p_min: float = 0.0,
                 name: str | None = None) -> None:
        if not 0.0 <= p_min < 1.0:
            raise InvalidArgument(f"p_min must be in [0, 1), got {p_min!r}")
        self.backend = backend
        self.name = name or backend.name
        self.vocab_fingerprint: str | None = backend.vocab_fingerprint
        self.weight_bytes = backend.weight_bytes
        self.p_min = p_min
        if target is None:
            self.n_out = self.n_shared = backend.n_vocab
        else:
            self.n_shared = shared_vocab(target, backend)
            self.n_out = target.n_vocab
            if backend.weight_bytes > target.weight_bytes:
                log.warning("drafter %s (%.0f MB of weights) is larger than target %s (%.0f MB): "
                            "speculation will be slower than plain decoding",
                            self.name, backend.weight_bytes / 1e6, target.name, target.weight_bytes / 1e6)

    def _q(self, logits: np.ndarray, sampling: SamplingArgs, context: Sequence[int]) -> Dist:
        """Drafter logits [V_d] -> its distribution over the target's ids, padding masked."""
        if self.n_shared < logits.shape[-1]:
            logits = logits.astype(np.float32, copy=True)
            logits[self.n_shared:] = -np.inf
        q = dist(logits, sampling, context)
        return Dist(q.idx, q.w, self.n_out)        # ids < n_shared: the same ids in the target

    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | None:
        """A model always has a draft to offer; its class is the target's margin at the last position
        (margin_class): drafts after a clear choice are accepted far more often."""
        return margin_class(logits)

    def lag(self, context: Sequence[int]) -> int:
        # the cache holds a prefix of the context (plus, after a rejection, drafts that propose() rolls back)
        return max(len(context) - len(self.backend.tokens), 1)

    def _top_prob(self, logits: np.ndarray) -> float:
        """Largest softmax probability of the raw logits (temperature 1): the drafter's confidence."""
        x = logits[: self.n_shared].astype(np.float64)
        m = x.max()
        return float(1.0 / np.exp(x - m).sum())

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs,
                rng: np.random.Generator, constraint: Constraint | None = None
                ) -> tuple[list[int], np.ndarray | None]:
        be = self.backend
        ctx = list(context)
        gamma = min(gamma, be.n_ctx - len(ctx) + 1)     # the last drafted token is never evaluated
        if gamma <= 0 or not ctx:
            return [], None
        # roll back to the common prefix; the last context token is always (re)evaluated for its logits
        keep = common_prefix(be.tokens, ctx[:-1])
        be.truncate(keep)
        logits = be.eval(ctx[keep:], n_logits=1)[-1]        # [V_d]
        tokens: list[int] = []
        rows: list[Dist] = []
        for i in range(gamma):
            if constraint is not None:
                allowed = constraint.continuing_mask()          # the grammar after context + tokens
                if not allowed.any():
                    break                                        # only an end is allowed: nothing to draft
                logits = apply_mask(logits, allowed)
            if self.p_min > 0.0 and self._top_prob(logits) < self.p_min:
                break
            if sampling.greedy:                 # deterministic: a point mass, no distribution to build
                x = greedy_token(logits[: self.n_shared], sampling, ctx + tokens)
            else:
                q = self._q(logits, sampling, ctx + tokens)
                x = q.sample(rng)
                rows.append(q)
            if constraint is not None:
                constraint.consume(x)
            tokens.append(x)
            if i + 1 < gamma:
                logits = be.eval([x])[-1]
        return tokens, (rows if rows else None)     # q: one Dist per drafted token, None for a point mass

    def reset(self) -> None:
        """Forget the cached context (the next proposal re-evaluates it from the start)."""
        self.backend.truncate(0)

    def close(self) -> None:
        self.backend.close()


class PromptLookupDrafter:
    """Model-free drafting: find the latest earlier occurrence of the context's last n tokens
    (n from ngram_max down to ngram_min) and propose what followed it. No model, a few bytes per
    context token for its index.

    Its hint class is how long the match really is (the matched n-gram extended backwards while the
    tokens still agree, up to 32): buckets 1, 2, 3-4, 5-8, 9-16, 17+. A continuation copied from a
    long verbatim match is accepted far more often than one keyed on a single common token, and the
    gamma tuner learns acceptance per class, drafting only where it pays.

    The n-gram index (n-gram -> latest start) is kept incrementally for a context list that only
    grows, as the decode loop's does: a cycle costs a few dictionary lookups, not a scan of the
    context. Any other list (a new generation, an edited context) is indexed afresh."""

    name = "lookup"
    vocab_fingerprint = None
    weight_bytes = 0
    n_classes = 6
    class_prior = MATCH_PRIOR
    _EXTEND_MAX = 32

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if not (isinstance(ngram_min, int) and isinstance(ngram_max, int) and 1 <= ngram_min <= ngram_max):
            raise InvalidArgument(
                f"prompt lookup needs integers 1 <= ngram_min <= ngram_max, got {ngram_min!r}, {ngram_max!r}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.reset()

    def reset(self) -> None:
        self._ctx: Sequence[int] | None = None     # the list indexed so far
        self._seen: list[int] = []                 # its tokens at indexing time (to detect edits)
        self._index: dict[tuple[int, ...], int] = {}

    def _sync(self, context: Sequence[int]) -> None:
        """Index every n-gram of the context that is followed by at least one token."""
        L, n0 = len(context), len(self._seen)
        if not (context is self._ctx and L >= n0 and (n0 == 0 or context[n0 - 1] == self._seen[-1])):
            self._ctx, self._seen, self._index, n0 = context, [], {}, 0
        new = list(context[n0:L])
        self._seen.extend(new)
        toks, index = self._seen, self._index
        # windows ending at e (exclusive) <= L - 1, not indexed yet: those with e > n0 - 1
        for e in range(max(n0 - 1, 1), L):
            for n in range(self.ngram_min, min(self.ngram_max, e) + 1):
                index[tuple(toks[e - n:e])] = e - n

    def _match(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(start of the copied continuation, matched length extended backwards) or None."""
        L = len(context)
        if L < 2:
            return None
        self._sync(context)
        toks = self._seen
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            h = self._index.get(tuple(toks[L - n:]))
            if h is not None:
                k = n
                while k < self._EXTEND_MAX and h - 1 - (k - n) >= 0 and toks[h - 1 - (k - n)] == toks[L - 1 - k]:
                    k += 1
                return h + n, k
        return None

    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | None:
        m = self._match(context)
        if m is None:
            return None
        return match_class(m[1])

    def lag(self, context: Sequence[int]) -> int:
        return 0

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs,
                rng: np.random.Generator, constraint: Constraint | None = None) -> tuple[list[int], None]:
        if gamma <= 0:
            return [], None
        m = self._match(context)
        if m is None:
            return [], None
        return copy_draft(context, m[0], len(context), gamma, constraint), None

    def close(self) -> None:
        self.reset()


# ---------------------------------------------------------------------------------- factory

def make_drafter(spec: str | None, target: Backend, *, backend_args: BackendArgs | None = None,
                 spec_args: SpeculativeArgs | None = None, pull: bool = True) -> Drafter | None:
    """'none' / None -> no drafter; 'lookup' -> PromptLookupDrafter; 'suffix' -> SuffixDrafter; otherwise a model name from the
    registry or a path to a model file, loaded on the backend that fits it and checked against
    the target's vocabulary."""
    spec_args = spec_args or SpeculativeArgs()
    if spec is None or spec == "none":
        return None
    if spec == "lookup":
        return PromptLookupDrafter(spec_args.lookup_ngram_max, spec_args.lookup_ngram_min)
    if spec == "suffix":                         # suffix lookup (speculative/suffix.py): the longest earlier match

        return SuffixDrafter()
    from ..backends import open_backend
    from ..resolve import resolve_model

    path = Path(resolve_model(spec, pull=pull))
    backend = open_backend(path, backend_args or BackendArgs())
    try:
        return ModelDrafter(backend, target, p_min=spec_args.p_min, name=spec)
    except BaseException:
        backend.close()
        raise

