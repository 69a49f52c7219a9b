"""THE decode loop. Plain decoding is speculative decoding with gamma = 0.

generate() sets up, prefills, and runs an outer loop: `cycle()`, then `commit()` of what the cycle decided.
One cycle (_Loop.cycle), read top to bottom:  draft gamma tokens -> verify: ONE target eval of [pending] +
draft (gamma + 1 positions) and Leviathan rejection sampling -> rollback of the rejected drafts (KV cache and
grammar) -> policy.observe; commit() then appends the accepted drafts and the target's token, releasing Steps.
`pending` is the last committed token, not yet in the target's KV cache; the target cache holds (a prefix of)
`committed[:-1]` between cycles, and the `finally` restores that invariant (_Loop.restore) whatever happens:
an exception, a stop string, or a consumer that closes the stream.

With a constraint (a grammar), every verified position's logits are masked with the grammar state after the
tokens before it, for the drafter (while drafting, which advances the constraint over the drafts) and for the
target alike; rejected drafts leave the constraint with the KV cache: it holds exactly the committed tokens.

Forced runs (docs/free_drafts.md): where the grammar's mask allows exactly one token after a committed token, that
token has probability 1 under the masked target: it is committed at once, with no logits and no sampling, and so
are the ones forced after it (constrain/base.py forced_run). The target cache then lags the committed tokens by the
run: the next cycle evaluates [pending, *run, *draft] in one call that asks for logits at the last gamma + 1 only.

Evaluation begun ahead (_EvalAhead, an optional wrapper around cycle()): on a backend with `begin_eval` (a lone
sequence of a batching group), a cycle that will not draft (its gamma is chosen right after the cycle before) has
its evaluation begun before that cycle's Steps are yielded; the `finally` waits for it. Shadow drafts
(speculative/shadow.py) let a free class kept off learn its acceptance from the tokens decoded plain.
"""

from __future__ import annotations

import codecs
import os
import time
from time import perf_counter as _now
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

import numpy as np

from .backends.base import Backend, common_prefix
from .config import GAMMA_LIMIT, SamplingArgs
from .constrain.base import Constraint, apply_mask, forced_run
from .errors import BackendError, ContextOverflow, InvalidArgument
from .speculative.gamma import BatchedGamma, FixedGamma, GammaPolicy, GammaTuner
from .speculative.sampling import dist, greedy_token, penalised
from .speculative.shadow import Shadow
from .speculative.verify import verify, verify_greedy

if TYPE_CHECKING:
    from .speculative.drafters import Drafter


@dataclass(frozen=True)
class Step:
    """One committed token. t_draft/t_verify are the cycle's times, carried by its first Step (0 on the rest)."""

    token: int
    text: str            # text this token adds ('' if its bytes end inside a UTF-8 character; cut before a stop)
    from_draft: bool     # True: a drafted token the target accepted
    gamma: int           # draft length of the cycle that produced it
    n_accepted: int      # drafted tokens accepted in that cycle
    t_draft: float
    t_verify: float
    forced: bool = False  # True: the grammar allowed only this token (appended unsampled, docs/free_drafts.md)


# Forced runs are on by default; EDGERUN_FORCED_RUNS=0 (or forced_runs=False) turns them off: for benchmarks and tests.
FORCED_RUNS = os.environ.get("EDGERUN_FORCED_RUNS", "1") != "0"
EARNED_START = 8       # a learning policy's drafts past this length are earned within a generation (_Loop)


@dataclass
class GenStats:
    """Statistics of one generation; the acceptance histogram is first-class."""

    n_prompt_tokens: int = 0
    n_tokens: int = 0
    t_prefill_s: float = 0.0
    t_total_s: float = 0.0
    n_cycles: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_rejected: int = 0          # cycles that ended on a rejected draft (the rest accepted every draft)
    gamma_sum: int = 0
    t_draft_s: float = 0.0
    t_verify_s: float = 0.0
    accept_histogram: list[int] = field(default_factory=list)   # [k] = cycles that accepted k drafted tokens
    finish_reason: str | None = None                            # 'stop' | 'eos' | 'length'
    n_forced: int = 0            # tokens committed from forced runs (the grammar allowed only them)
    n_forced_runs: int = 0       # forced runs (maximal: a run ends where the grammar allows a choice)

    @property
    def tokens_per_s(self) -> float:
        dt = self.t_total_s - self.t_prefill_s
        return self.n_tokens / dt if dt > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (drafts after a rejection count as not accepted)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability, accepted / (accepted + rejected): Leviathan's alpha."""
        tested = self.n_accepted + self.n_rejected
        return self.n_accepted / tested if tested else 0.0

    @property
    def mean_accepted_per_cycle(self) -> float:
        return self.n_accepted / sum(self.accept_histogram) if sum(self.accept_histogram) else 0.0

    @property
    def gamma_mean(self) -> float:
        return self.gamma_sum / self.n_cycles if self.n_cycles else 0.0

    def record_cycle(self, gamma: int, n_accepted: int, t_draft: float, t_verify: float) -> None:
        self.n_cycles += 1
        self.gamma_sum += gamma
        self.t_draft_s += t_draft
        self.t_verify_s += t_verify
        if gamma > 0:
            self.n_drafted += gamma
            self.n_accepted += n_accepted
            self.n_rejected += n_accepted < gamma
            if len(self.accept_histogram) <= gamma:
                self.accept_histogram.extend([0] * (gamma + 1 - len(self.accept_histogram)))
            self.accept_histogram[n_accepted] += 1

    def merge(self, other: "GenStats") -> None:
        """Accumulate another generation's counts (for session-wide /stats and /metrics)."""
        for name in ("n_prompt_tokens", "n_tokens", "t_prefill_s", "t_total_s", "n_cycles", "n_drafted",
                     "n_accepted", "n_rejected", "gamma_sum", "t_draft_s", "t_verify_s", "n_forced",
                     "n_forced_runs"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        h = other.accept_histogram
        if len(self.accept_histogram) < len(h):
            self.accept_histogram.extend([0] * (len(h) - len(self.accept_histogram)))
        for k, c in enumerate(h):
            self.accept_histogram[k] += c
        self.finish_reason = other.finish_reason

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, acceptance_rate=self.acceptance_rate, alpha=self.alpha,
                 mean_accepted_per_cycle=self.mean_accepted_per_cycle, gamma_mean=self.gamma_mean)
        return d


class _TextReleaser:
    """Turns committed tokens into Steps, holding back those whose text may begin a stop string."""

    def __init__(self, detok_bytes: Callable[[int], bytes], stop: Sequence[str]) -> None:
        self._detok = detok_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held: list[Step] = []          # held back, each with its token's whole decoded text

    def push(self, token: int, from_draft: bool, gamma: int, n_accepted: int, t_draft: float,
             t_verify: float, forced: bool = False) -> tuple[list[Step], bool]:
        """Add a token; return (steps now released, stop string hit)."""
        step = Step(token, self._utf8.decode(self._detok(token)), from_draft, gamma, n_accepted, t_draft, t_verify,
                    forced)
        if not self._stop:
            return [step], False
        self._held.append(step)
        text = "".join(h.text for h in self._held)
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._release(cut), True
        if any(text.endswith(s[:k]) for s in self._stop for k in range(1, len(s))):
            return [], False          # may be the start of a stop string: wait for more tokens
        return self.flush(), False

    def flush(self) -> list[Step]:
        out, self._held = self._held, []
        return out

    def _release(self, limit: int) -> list[Step]:
        """The held Steps up to `limit` characters of their text (the stop string and what follows it: dropped)."""
        out, used = [], 0
        for step in self._held:
            if used >= limit:
                break
            if used + len(step.text) > limit:
                step = replace(step, text=step.text[: limit - used])
            used += len(step.text)
            out.append(step)
        self._held = []
        return out


def _observe(policy: GammaPolicy, gamma: int, n_acc: int, t_draft: float, t_verify: float, times: bool) -> None:
    """policy.observe; times=False: the cycle's evaluation also held a forced run, so its time is not the
    gamma + 1 positions' the tuner prices (it learns the counts only)."""
    tuner = policy.tuner if isinstance(policy, BatchedGamma) else policy
    if times or not isinstance(tuner, GammaTuner):
        policy.observe(gamma, n_acc, t_draft, t_verify)
    else:
        tuner.observe(gamma, n_acc, t_draft, t_verify, times=False)


def generate(
    target: Backend,
    prompt_tokens: Sequence[int],
    sampling: SamplingArgs,
    *,
    max_tokens: int,
    stop: Sequence[str] = (),
    drafter: Drafter | None = None,
    policy: GammaPolicy | None = None,
    rng: np.random.Generator | None = None,
    stats: GenStats | None = None,
    is_eog: Callable[[int], bool] | None = None,
    constraint: Constraint | None = None,
    forced_runs: bool | None = None,
) -> Iterator[Step]:
    """Generate up to max_tokens tokens after prompt_tokens, yielding one Step per committed token.

    drafter: None (plain decoding) or a Drafter (speculative/drafters.py). policy: chooses gamma per cycle
    (speculative/gamma.py: FixedGamma or GammaTuner); ignored without a drafter. is_eog(token) -> bool ends
    generation (default: the tokenizer's end-of-generation tokens). constraint: a grammar the output
    must follow (constrain/); it is reset here and follows this generation's tokens. forced_runs: None (the
    default, FORCED_RUNS: on) or False to evaluate grammar-forced tokens one by one like any other (an
    internal switch for benchmarks and tests; the output is the same either way).
    """
    if max_tokens < 0:
        raise InvalidArgument(f"max_tokens must be >= 0, got {max_tokens}")
    if not prompt_tokens:
        raise InvalidArgument("the prompt is empty: at least one token (e.g. BOS) is needed")
    if len(prompt_tokens) >= target.n_ctx:
        raise ContextOverflow(
            f"the prompt is {len(prompt_tokens)} tokens but the context holds {target.n_ctx}: "
            f"shorten the prompt or load the model with a larger n_ctx")
    stats = stats if stats is not None else GenStats()
    stats.finish_reason = None
    policy = policy if (policy is not None and drafter is not None) else FixedGamma(0)
    if isinstance(policy, FixedGamma) and policy.gamma == 0:
        drafter = None                          # plain decoding: the drafter is not even asked for a hint
    if constraint is not None:
        constraint.reset()
    forced = (hasattr(constraint, "forced_token") and hasattr(constraint, "is_end")   # optional Constraint methods
              and forced_runs is not False and (forced_runs is not None or FORCED_RUNS))
    t_start = time.perf_counter()
    loop = _Loop(target, prompt_tokens, max_tokens, sampling, drafter, policy,
                 rng if rng is not None else np.random.default_rng(sampling.seed), stats,
                 is_eog or target.tokenizer.is_eog, constraint, forced,
                 _TextReleaser(target.tokenizer.token_bytes, stop))
    begin_eval = getattr(target, "begin_eval", None)
    ahead = _EvalAhead(loop, begin_eval) if begin_eval is not None else None
    cycle, commit = ahead.cycle if ahead is not None else loop.cycle, loop.commit
    try:
        loop.prefill()
        stats.t_prefill_s = time.perf_counter() - t_start
        if max_tokens == 0:
            stats.finish_reason = "length"             # nothing to generate: the prompt is prefilled all the same
            return
        finish = yield from loop.opening_run()
        while finish is None:
            out = cycle()
            if out is None:
                finish = "length"                      # context full (documented policy: stop, no sliding)
                break
            finish = yield from commit(*out)
        stats.finish_reason = finish
        if finish != "stop":
            yield from loop.releaser.flush()
    finally:
        if ahead is not None:
            ahead.settle()
        loop.restore()
        stats.t_total_s = time.perf_counter() - t_start


class _Loop:
    """One generation's decode state (the committed tokens; `pending`, their last, is not yet in the target's
    cache) and its steps: cycle() drafts, verifies and rolls back; commit() appends what a cycle decided."""

    def __init__(self, target: Backend, prompt_tokens: Sequence[int], max_tokens: int, sampling: SamplingArgs,
                 drafter: Drafter | None, policy: GammaPolicy, rng: np.random.Generator, stats: GenStats,
                 is_eog: Callable[[int], bool], constraint: Constraint | None, forced: bool,
                 releaser: _TextReleaser) -> None:
        self.target, self.sampling, self.drafter, self.policy, self.rng = target, sampling, drafter, policy, rng
        self.stats, self.is_eog, self.constraint, self.forced, self.releaser = (stats, is_eog, constraint, forced,
                                                                               releaser)
        self.committed = list(prompt_tokens)    # committed[-1] is `pending`: not yet in the target cache
        self.n_prompt = stats.n_prompt_tokens = len(self.committed)
        self.limit = self.n_prompt + max_tokens  # len(committed) once max_tokens are generated
        self.plain_cycle = getattr(policy, "plain_cycle", None)   # optional (GammaPolicy): a cycle known plain
        self.pick = getattr(policy, "pick", None)               # optional: which of a drafter's offers to take
        self.penalise = penalised(sampling)
        self.greedy = sampling.greedy            # (a property of the frozen SamplingArgs: asked once)
        self.learns = type(policy) is not FixedGamma   # FixedGamma.observe does nothing: not even called
        self.evaluate = target.eval              # _EvalAhead puts its own in
        self.last: np.ndarray | None = None      # the target's logits at the last verified position
        self.n_tail = 1                          # positions before the drafts: pending and a forced run
        self.earned = EARNED_START               # longest draft this generation may make (_Loop.draft_length)
        self.next_gamma: int | None = None       # the next cycle's gamma where _EvalAhead chose it
        self.ahead = False                       # this cycle's evaluation was begun ahead: its time is no step's
        tuner = getattr(policy, "tuner", policy)
        self.lower = getattr(tuner, "lower", None) if self.learns else None
        self.shadow = Shadow(tuner if self.learns and getattr(tuner, "free_classes", 0) else None)   # shadow.py
        if self.learns and hasattr(tuner, "begin_generation"):
            tuner.begin_generation()             # a new text: what free drafts learned on others weighs less

    def prefill(self) -> None:
        """Reuse the cached prefix (multi-turn chat), evaluate the rest of the prompt without logits."""
        target, committed = self.target, self.committed
        keep = common_prefix(target.tokens, committed[:-1])
        target.truncate(keep)
        if keep < len(committed) - 1:
            target.eval(committed[keep:-1], n_logits=0)

    def cycle(self) -> tuple[list[int], int, int, float, float, int] | None:
        """draft -> verify -> rollback: (the tokens to commit, drafts accepted, gamma, t_draft, t_verify, forced
        tokens at the end), or None when the context is full."""
        room = self.target.n_ctx - len(self.committed)     # cache slots left for drafts once pending goes in
        if room < 0:
            return None
        if self.next_gamma is not None:                     # chosen ahead (_EvalAhead.cycle)
            gamma, self.next_gamma = self.next_gamma, None
        else:
            gamma = self.draft_length(room, self.committed) if self.drafter is not None else 0
        t0 = _now()
        draft, q = self.draft(gamma) if gamma > 0 else ([], None)
        t1 = _now()
        n_acc, nxt = self.verify(draft, q)
        t2 = _now()
        gamma = len(draft)
        run = self.rollback(gamma, n_acc, nxt) if n_acc < gamma or self.constraint is not None else []
        if gamma:
            self.earned = min(max(EARNED_START, 2 * n_acc), GAMMA_LIMIT)     # twice the run just accepted
        if self.learns:
            _observe(self.policy, gamma, n_acc, t1 - t0, t2 - t1, times=self.n_tail == 1 and not self.ahead)
        self.n_tail, self.ahead = 1 + len(run), False
        self.stats.record_cycle(gamma, n_acc, t1 - t0, t2 - t1)
        return [*draft[:n_acc], nxt, *run], n_acc, gamma, t1 - t0, t2 - t1, len(run)

    def draft_length(self, room: int, committed: list[int]) -> int:
        """The policy's gamma for the cycle after `committed` (maybe extended: _EvalAhead), within limits."""
        drafter = self.drafter
        lag = drafter.lag(committed)
        if self.plain_cycle is not None and self.plain_cycle(lag):
            return 0
        hint = drafter.hint(committed, self.last)
        if type(hint) is tuple:       # several kinds of draft on offer (speculative/combined.py): the policy picks
            hint = drafter.use(self.pick(hint) if self.pick is not None else hint[0])
        gamma = min(self.policy.choose(hint, lag), self.limit - len(committed) - 1, room)
        if gamma > self.earned and self.lower is not None:    # a long draft is earned in the generation (docs/
            gamma = self.earned                                # free_drafts.md): lowered, not a supply miss
            self.lower(gamma)
        self.shadow.step(drafter, committed, hint, gamma)
        if gamma > 0 and getattr(drafter, "deferred", False):
            drafter.load()         # a drafter deferred at start-up (speculative/lazy.py): its load is no draft time
        return gamma

    def draft(self, gamma: int) -> tuple[list[int], object]:
        """The drafter's tokens (up to gamma) and their distributions q (None: point masses); it advances the
        constraint over them."""
        base = len(self.committed) - self.n_prompt           # generated tokens: what the constraint holds
        draft, q = self.drafter.propose(self.committed, gamma, self.sampling, self.rng, self.constraint)
        if self.constraint is not None and len(self.constraint.tokens) != base + len(draft):
            raise BackendError(f"drafter {self.drafter.name} did not advance the constraint over its "
                               f"{len(draft)} drafted tokens")
        return draft, q

    def verify(self, draft: list[int], q) -> tuple[int, int]:
        """ONE target evaluation of pending, a forced run committed after it and the drafts, with logits at the
        last gamma + 1 positions, masked by the grammar; then the rejection sampler (its one-hot case from
        argmaxes when greedy). Returns (drafts accepted, the target's next token)."""
        gamma, committed, sampling = len(draft), self.committed, self.sampling
        logits = self.evaluate([*committed[self.target.n_past:], *draft], n_logits=gamma + 1)   # [gamma + 1, V]
        if self.constraint is not None:        # position i: the grammar state after committed + draft[:i]
            base = len(committed) - self.n_prompt
            logits = [apply_mask(logits[i], self.constraint.mask_at(base + i)) for i in range(gamma + 1)]
        if self.greedy and gamma == 0:
            n_acc, nxt = 0, greedy_token(logits[0], sampling, committed)    # plain greedy decoding
        else:
            # what the repetition penalty sees at each position
            contexts = _contexts(committed, draft) if self.penalise else [committed] * (gamma + 1)
            if self.greedy:
                n_acc, nxt = verify_greedy([greedy_token(logits[i], sampling, contexts[i])
                                            for i in range(gamma + 1)], draft)
            else:   # p: the target's distribution at each verified position, same transforms as q
                n_acc, nxt = verify([dist(logits[i], sampling, contexts[i]) for i in range(gamma + 1)],
                                    q, draft, self.rng)
        self.last = logits[n_acc]
        return n_acc, nxt

    def rollback(self, gamma: int, n_acc: int, nxt: int) -> list[int]:
        """Drop the rejected drafts from the target's cache and the constraint, advance the constraint over the
        target's token; return the forced run after it."""
        # the cache holds committed + draft; keep committed (incl. old pending) + accepted drafts (nothing to drop
        # when every draft was accepted, as in every plain cycle: no call into the backend)
        if n_acc < gamma:
            self.target.truncate(len(self.committed) + n_acc)
        constraint = self.constraint
        if constraint is None:
            return []
        constraint.rollback(gamma - n_acc)
        if self.is_eog(nxt):
            return []
        constraint.consume(nxt)
        return self.forced_run(n_acc + 1) if self.forced else []

    def forced_run(self, n_new: int) -> list[int]:
        """The tokens the grammar forces after the constraint's tokens, consumed into it (an end-of-generation
        token last, not consumed), at most as many as may be committed after n_new more tokens: within
        max_tokens, and within the context plus the one token the token-by-token path could sample at its last
        position."""
        run = forced_run(self.constraint, self.is_eog,
                          min(self.limit, self.target.n_ctx + 1) - len(self.committed) - n_new)
        if run:
            self.stats.n_forced_runs += 1
        return run

    def opening_run(self) -> Generator[Step, None, str | None]:
        """Commit the answer's first tokens where the grammar forces them (evaluated with the first cycle)."""
        run = self.forced_run(0) if self.forced else []
        if not run:
            return None
        self.n_tail += len(run)
        return (yield from self.commit(run, 0, 0, 0.0, 0.0, len(run)))

    def commit(self, new: list[int], n_acc: int, gamma: int, t_draft: float, t_verify: float,
               n_forced: int) -> Generator[Step, None, str | None]:
        """Commit a cycle's tokens (its n_acc accepted drafts, then the target's token, then the n_forced
        tokens of the forced run after it), yield the Steps the releaser lets out, and return why generation
        ends ('eos' | 'stop' | 'length'; None: go on)."""
        committed, is_eog, stats, push, limit = self.committed, self.is_eog, self.stats, self.releaser.push, self.limit
        first_forced = len(new) - n_forced
        for i, tok in enumerate(new):
            committed.append(tok)
            if is_eog(tok):
                return "eos"
            stats.n_tokens += 1
            if i >= first_forced:
                stats.n_forced += 1
            steps, hit = push(tok, i < n_acc, gamma, n_acc,       # the cycle's times ride on its first Step
                              t_draft if i == 0 else 0.0, t_verify if i == 0 else 0.0, i >= first_forced)
            yield from steps
            if hit:
                return "stop"
            if len(committed) >= limit:
                return "length"
        return None

    def restore(self) -> None:
        """Rollback whatever happened: the target cache holds a prefix of the committed tokens minus pending, the
        constraint exactly the committed generated tokens."""
        self.target.truncate(min(self.target.n_past, len(self.committed) - 1))
        if self.constraint is not None:
            self.constraint.truncate(len(self.committed) - self.n_prompt)


def _contexts(committed: list[int], draft: list[int]) -> list[list[int]]:
    """The tokens before each verified position: committed, then committed + draft[:i]."""
    return [committed, *[committed + draft[:i] for i in range(1, len(draft) + 1)]]


class _EvalAhead:
    """On a backend that evaluates in the background (a lone sequence of a batching group), a next cycle that
    will not draft (its gamma chosen here, right after this cycle) has its evaluation of [pending, *forced run]
    begun before this cycle's Steps are yielded: the consumer's work on a token runs beside it. Wraps cycle()."""

    def __init__(self, loop: _Loop, begin_eval: Callable) -> None:
        self.loop, self.begin_eval = loop, begin_eval
        self.waiter: Callable[[], np.ndarray] | None = None
        loop.evaluate = self.evaluate

    def cycle(self) -> tuple[list[int], int, int, float, float, int] | None:
        out = self.loop.cycle()
        if out is not None:
            new, n_acc, loop = out[0], out[1], self.loop
            n_after = len(loop.committed) + len(new)
            if not loop.is_eog(new[-1]) and n_after < loop.limit and n_after <= loop.target.n_ctx:
                if loop.drafter is not None:   # asked of the committed list itself, as the cycle would (drafters
                    loop.committed.extend(new)     # index it by identity), then trimmed back for commit()
                    try:
                        loop.next_gamma = loop.draft_length(loop.target.n_ctx - n_after, loop.committed)
                    finally:
                        del loop.committed[-len(new):]
                    if loop.next_gamma > 0:
                        return out
                # the next cycle evaluates new[n_acc:] = [nxt, *run] (the accepted drafts are in the cache)
                # unless a stop string ends it (then settle() and the loop's restore() roll it back); it needs
                # logits at the last position only
                self.waiter = self.begin_eval(new[n_acc:], n_logits=1)
                loop.ahead = self.waiter is not None
        return out

    def evaluate(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        waiter, self.waiter = self.waiter, None
        return waiter() if waiter is not None else self.loop.target.eval(tokens, n_logits=n_logits)

    def settle(self) -> None:
        """An evaluation begun for a cycle that did not come: let it end first (its failure no longer matters;
        the loop's restore() rolls back)."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            try:
                waiter()
            except Exception:
                pass
