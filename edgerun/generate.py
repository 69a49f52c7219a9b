"""THE decode loop. Plain decoding is speculative decoding with gamma = 0.

Each cycle:  draft gamma tokens -> ONE target eval of [pending] + draft (gamma + 1 positions)
-> verify (Leviathan rejection sampling) -> policy.observe -> commit accepted + next token.
`pending` is the last committed token, not yet in the target's KV cache; the target cache
always holds `committed[:-1]` between cycles, and the `finally` restores that invariant
(rollback) whatever happens: an exception, a stop string, or a consumer that closes the stream.
(A backend with `begin_eval`, a lone sequence of a batching group, may already be evaluating
`pending` while a plain cycle's Steps are yielded: the next cycle takes that result; the `finally`
waits for it before it rolls back.)

With a constraint (a grammar), every verified position's logits are masked with the grammar state
after the tokens before it, for the drafter (while drafting, which advances the constraint over the
drafts) and for the target alike; the rejected drafts are rolled back out of the constraint with
the KV cache, so after every cycle it holds exactly the committed tokens.

Forced runs (docs/free_drafts.md): where the grammar's mask allows exactly one token after a committed
token, that token has probability 1 under the masked target: it is committed at once, with no logits and
no sampling, and so are the ones forced after it. The target cache then lags the committed tokens by the
run: the next cycle evaluates [pending, *run, *draft] in one call that asks for logits at the last
gamma + 1 positions only. In general the cache holds a prefix of `committed[:-1]` between cycles.
"""

from __future__ import annotations

import codecs
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

import numpy as np

from .backends.base import Backend, common_prefix
from .config import SamplingArgs
from .constrain.base import Constraint, apply_mask
from .errors import BackendError, ContextOverflow, InvalidArgument
from .speculative.gamma import BatchedGamma, FixedGamma, GammaPolicy, GammaTuner
from .speculative.sampling import dist, greedy_token, penalised
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


# Forced runs are on by default. EDGERUN_FORCED_RUNS=0 (or generate(forced_runs=False)) turns them off: an
# internal switch for benchmarks and tests that compare against the token-by-token path, not a user setting.
FORCED_RUNS = os.environ.get("EDGERUN_FORCED_RUNS", "1") != "0"


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
        spec_cycles = sum(self.accept_histogram)
        return self.n_accepted / spec_cycles if spec_cycles else 0.0

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
    if times:
        policy.observe(gamma, n_acc, t_draft, t_verify)
    elif isinstance(policy, GammaTuner):
        policy.observe(gamma, n_acc, t_draft, t_verify, times=False)
    elif isinstance(policy, BatchedGamma):
        policy.tuner.observe(gamma, n_acc, t_draft, t_verify, times=False)
    else:
        policy.observe(gamma, n_acc, t_draft, t_verify)


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
    rng = rng if rng is not None else np.random.default_rng(sampling.seed)
    policy = policy if (policy is not None and drafter is not None) else FixedGamma(0)
    if isinstance(policy, FixedGamma) and policy.gamma == 0:
        drafter = None                          # plain decoding: the drafter is not even asked for a hint
    plain_cycle = getattr(policy, "plain_cycle", None)   # optional (GammaPolicy): a cycle known to run plain
    is_eog = is_eog or target.tokenizer.is_eog
    penalise = penalised(sampling)
    releaser = _TextReleaser(target.tokenizer.token_bytes, stop)
    if constraint is not None:
        constraint.reset()
    # optional Constraint methods (GrammarConstraint): forced_token() and is_end(token)
    forced_token = getattr(constraint, "forced_token", None) if hasattr(constraint, "is_end") else None
    if forced_runs is False or (forced_runs is None and not FORCED_RUNS):
        forced_token = None

    t_start = time.perf_counter()
    committed = list(prompt_tokens)            # committed[-1] is `pending`: not yet in the target cache
    limit = len(committed) + max_tokens        # len(committed) once max_tokens are generated
    stats.n_prompt_tokens = len(committed)

    def commit(new: list[int], n_acc: int, gamma: int, t_draft: float, t_verify: float,
               n_forced: int = 0) -> Generator[Step, None, str | None]:
        """Commit a cycle's tokens (its n_acc accepted drafts, then the target's token, then the n_forced
        tokens of the forced run after it), yield the Steps the releaser lets out, and return why generation
        ends ('eos' | 'stop' | 'length'; None: go on)."""
        first_forced = len(new) - n_forced
        for i, tok in enumerate(new):
            committed.append(tok)
            if is_eog(tok):
                return "eos"
            stats.n_tokens += 1
            stats.n_forced += i >= first_forced
            steps, hit = releaser.push(tok, i < n_acc, gamma, n_acc,       # the cycle's times ride on its first Step
                                       t_draft if i == 0 else 0.0, t_verify if i == 0 else 0.0, i >= first_forced)
            yield from steps
            if hit:
                return "stop"
            if len(committed) >= limit:
                return "length"
        return None

    def forced_run(n_new: int) -> list[int]:
        """The tokens the grammar forces after the constraint's tokens, consumed into it (an end-of-generation
        token last, not consumed), at most as many as may be committed after n_new more tokens: within
        max_tokens, and within the context plus the one token the old path could sample at its last position."""
        run: list[int] = []
        budget = min(limit, target.n_ctx + 1) - len(committed) - n_new
        while len(run) < budget:
            tok = forced_token()
            if tok is None or (not is_eog(tok) and constraint.is_end(tok)):
                break                                  # a choice, or an end this loop's is_eog does not end on
            run.append(tok)
            if is_eog(tok):
                break
            constraint.consume(tok)
        if run:
            stats.n_forced_runs += 1
        return run

    # plain decoding on a backend that can evaluate in the background (a lone sequence of a batching group):
    # the next token's evaluation starts before this one's Steps are yielded, so what the consumer does with
    # a token (the server's hand-off, stop checks) runs beside the evaluation instead of before it
    begin_eval = getattr(target, "begin_eval", None) if drafter is None else None
    ahead = None                                # the waiter of an evaluation of [pending] begun ahead

    try:
        # prefill: reuse the cached prefix (multi-turn chat), evaluate the rest without logits
        keep = common_prefix(target.tokens, committed[:-1])
        target.truncate(keep)
        if keep < len(committed) - 1:
            target.eval(committed[keep:-1], n_logits=0)
        stats.t_prefill_s = time.perf_counter() - t_start
        if max_tokens == 0:
            stats.finish_reason = "length"             # nothing to generate: the prompt is prefilled all the same
            return

        finish = None
        last = None                                    # the target's logits at the last verified position
        n_tail = 1                                     # positions before the drafts: pending and a forced run
        if forced_token is not None:                   # the grammar may force the answer's first tokens
            run = forced_run(0)
            if run:
                n_tail += len(run)
                finish = yield from commit(run, 0, 0, 0.0, 0.0, len(run))
        while finish is None:
            room = target.n_ctx - len(committed)       # cache slots left for drafts once pending goes in
            if room < 0:
                finish = "length"                      # context full (documented policy: stop, no sliding)
                break
            gamma = 0
            lag = drafter.lag(committed) if drafter is not None else 0
            if drafter is not None and not (plain_cycle is not None and plain_cycle(lag)):
                gamma = min(policy.choose(drafter.hint(committed, last), lag), limit - len(committed) - 1, room)
            t0 = time.perf_counter()
            base = len(committed) - stats.n_prompt_tokens      # generated tokens: what the constraint holds
            draft, q = drafter.propose(committed, gamma, sampling, rng, constraint) if gamma > 0 else ([], None)
            gamma = len(draft)
            if constraint is not None and len(constraint.tokens) != base + gamma:
                raise BackendError(f"drafter {drafter.name} did not advance the constraint over its "
                                   f"{gamma} drafted tokens")
            t1 = time.perf_counter()
            if ahead is not None:
                logits, ahead = ahead(), None
            else:
                # pending and a forced run committed after it (no forced run: committed[-1:]), then the drafts
                logits = target.eval([*committed[target.n_past:], *draft], n_logits=gamma + 1)   # [gamma + 1, V]
            if constraint is not None:         # position i: the grammar state after committed + draft[:i]
                logits = [apply_mask(logits[i], constraint.mask_at(base + i)) for i in range(gamma + 1)]

            def context_at(i: int) -> list[int]:          # what the repetition penalty sees at position i
                return committed if i == 0 or not penalise else committed + draft[:i]

            if sampling.greedy and gamma == 0:
                n_acc, nxt = 0, greedy_token(logits[0], sampling, committed)    # plain greedy decoding
            elif sampling.greedy:
                # greedy: the target's argmax at each verified position decides (verify()'s one-hot case)
                n_acc, nxt = verify_greedy([greedy_token(logits[i], sampling, context_at(i))
                                            for i in range(gamma + 1)], draft)
            else:
                # p: the target's distribution at each verified position (gamma + 1 Dists), same transforms as q
                n_acc, nxt = verify([dist(logits[i], sampling, context_at(i)) for i in range(gamma + 1)],
                                    q, draft, rng)
            t2 = time.perf_counter()
            last = logits[n_acc]
            # the cache holds committed + draft; keep committed (incl. old pending) + accepted drafts (nothing
            # to drop when every draft was accepted, as in every plain cycle: no call into the backend)
            if n_acc < gamma:
                target.truncate(len(committed) + n_acc)
            run: list[int] = []
            if constraint is not None:
                constraint.rollback(gamma - n_acc)
                if not is_eog(nxt):
                    constraint.consume(nxt)
                    if forced_token is not None:
                        run = forced_run(n_acc + 1)
            new = [*draft[:n_acc], nxt, *run]
            n_after = len(committed) + len(new)
            if (begin_eval is not None and gamma == 0 and not is_eog(new[-1]) and n_after < limit
                    and n_after <= target.n_ctx):
                # the next cycle evaluates [nxt, *run] unless a stop string ends it (then the finally rolls it
                # back); it needs logits at the last position only
                ahead = begin_eval([nxt, *run], n_logits=1)
            _observe(policy, gamma, n_acc, t1 - t0, t2 - t1, times=n_tail == 1)
            n_tail = 1 + len(run)
            stats.record_cycle(gamma, n_acc, t1 - t0, t2 - t1)
            finish = yield from commit(new, n_acc, gamma, t1 - t0, t2 - t1, len(run))
        stats.finish_reason = finish
        if finish != "stop":
            yield from releaser.flush()
    finally:
        if ahead is not None:                   # begun for a cycle that did not come: let it end first
            try:
                ahead()
            except Exception:                   # its failure no longer matters; the rollback below does
                pass
        # rollback: the target cache holds exactly the committed tokens minus pending, the constraint
        # exactly the committed generated tokens
        target.truncate(min(target.n_past, len(committed) - 1))
        if constraint is not None:
            constraint.truncate(len(committed) - stats.n_prompt_tokens)
        stats.t_total_s = time.perf_counter() - t_start
