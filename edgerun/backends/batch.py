"""Continuous batching: several decode loops share one multi-sequence context, one llama_decode per step.

Each sequence runs the ordinary decode loop (edgerun/generate.py) on its own thread, on a `SeqBackend`:
a Backend over one sequence id of a shared `LlamaCppBackend(n_seq=N)`. The loop's per-sequence logic
(prefill, drafting, verification, sampling with its own rng, transforms, grammar constraint, rollback)
is the single-sequence loop's, unchanged. Only `eval` differs: it posts the sequence's rows to the
`BatchGroup` and waits. When no member sequence is running Python any more (each waits for an eval
or has left), the group evaluates every posted row of one context in one `eval_rows` call (one
llama_decode per n_batch positions) and hands each sequence its logits. A drafter model's context
(a second multi-sequence backend) batches its members' draft steps the same way; it goes first, so
the target's batch gathers each speculating sequence's gamma + 1 rows with the others' single rows.

The rows a sequence gets back are the logits of its own positions: llama.cpp's attention masks other
sequences out, so a sequence's output does not depend on which others share its batch, except through
how CPU kernels round a matrix product of more rows (docs/batching.md: equal at 1 thread for the
models measured, as for speculative verification).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

import numpy as np

from .base import check_eval


YIELD_GRACE_S = 0.005     # how long a batch waits for a member whose consumer holds its last Step
ADMIT_GRACE_S = 0.05      # how long a batch waits for jobs being placed on free slots (their prompts join it)


class _Request:
    __slots__ = ("backend", "seq", "tokens", "k", "out", "error", "done")

    def __init__(self, backend, seq: int, tokens: list[int], k: int) -> None:
        self.backend, self.seq, self.tokens, self.k = backend, seq, tokens, k
        self.out: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = False


class BatchGroup:
    """The step driver of the sequences sharing some multi-sequence backends (one per model).

    A member's decode loop runs through `drive()`. `backends` is in priority order: when every member
    waits, the first backend with rows posted is evaluated (drafter before target).
    """

    def __init__(self, backends: Sequence) -> None:
        self.backends = list(backends)
        self._cond = threading.Condition()
        self._pending: dict[int, list[_Request]] = {id(b): [] for b in self.backends}
        self._running = 0              # members running Python (not waiting for an eval)
        self._yielded = 0              # members whose consumer holds a Step (back in a moment, usually)
        self._active = 0               # members inside a generation
        self._admitting: dict[int, float] = {}   # thread ident -> when it began placing a job (begin_admission)
        self._executing = False
        self._engine = threading.Lock()    # held around every llama.cpp call on the shared contexts
        self.n_steps = 0               # batches evaluated, and rows in them (sequences x positions)
        self.n_rows = 0
        self.eval_s = 0.0              # wall time inside those evaluations

    @property
    def n_active(self) -> int:
        return self._active

    def view(self, backend, seq: int) -> "SeqBackend":
        return SeqBackend(self, backend, seq)

    def begin_admission(self) -> None:
        """This thread is placing a job on a free slot (tokenizing, restoring a cached prefix): the next
        batch waits for its first rows until ADMIT_GRACE_S after this call, so the prompts of a burst of
        requests join the running sequences' step instead of each costing a pass of its own; a slower
        admission (a long prompt, a grammar to compile) holds no batch after that. Ends when this thread's
        decode loop joins (drive) or at end_admission, whichever comes first."""
        with self._cond:
            self._admitting[threading.get_ident()] = time.monotonic()

    def end_admission(self) -> None:
        with self._cond:
            if self._admitting.pop(threading.get_ident(), None) is not None:
                self._cond.notify_all()

    def drive(self, steps: Iterator) -> Iterator:
        """Run a decode loop (a generator of Steps) as a member: while it runs Python the group's next
        batch waits for its rows; while its consumer holds a Step (the loop is suspended) the batch
        waits YIELD_GRACE_S for it, then goes on without it; once it has ended, without it."""
        self._change(active=1, running=1, joined=True)
        try:
            while True:
                try:
                    step = next(steps)
                except StopIteration:
                    return
                self._change(running=-1, yielded=1)
                try:
                    yield step
                finally:
                    self._change(running=1, yielded=-1)
        finally:
            try:
                steps.close()          # the loop's rollback (truncate) runs while this member counts
            finally:
                self._change(active=-1, running=-1)

    def _change(self, *, active: int = 0, running: int = 0, yielded: int = 0, joined: bool = False) -> None:
        with self._cond:
            if joined:                           # an admission ends as its loop becomes a member
                self._admitting.pop(threading.get_ident(), None)
            self._active += active
            self._running += running
            self._yielded += yielded
            if self._running == 0 and running < 0:
                self._cond.notify_all()          # the others all wait for an eval: one of them runs it

    # -- called by SeqBackend ------------------------------------------------------------------
    def eval(self, backend, seq: int, tokens: list[int], k: int) -> np.ndarray:
        req = _Request(backend, seq, tokens, k)
        with self._cond:
            self._pending[id(backend)].append(req)
            self._running -= 1          # the last member to post evaluates the batch itself (no wake-up)
            graced = False
            while not req.done:
                if self._running == 0 and not self._executing:
                    if self._yielded and not graced:
                        # a member is handing its token to its consumer and is about to post its next
                        # rows: give it a moment (it then evaluates the batch itself) rather than split
                        # the batch; a consumer that holds its Step longer costs the others only this
                        graced = True
                        self._cond.wait(YIELD_GRACE_S)
                        continue
                    if self._admitting:
                        # a job is being placed on a free slot: its prompt joins this batch if it comes
                        # within ADMIT_GRACE_S of the admission's start (it then evaluates the batch
                        # itself), else a later one
                        wait = max(self._admitting.values()) + ADMIT_GRACE_S - time.monotonic()
                        if wait > 0:
                            self._cond.wait(wait)
                            continue
                    self._execute()
                else:
                    self._cond.wait()
        if req.error is not None:
            raise req.error
        return req.out

    def _timed(self, backend, rows):
        t0 = time.perf_counter()
        try:
            return backend.eval_rows(rows)
        finally:
            self.eval_s += time.perf_counter() - t0

    def truncate(self, backend, seq: int, n: int) -> None:
        with self._engine:
            backend.truncate_seq(seq, n)

    def _execute(self) -> None:
        """Evaluate the posted rows of the first backend that has any (called with the condition held)."""
        batch: list[_Request] = []
        for b in self.backends:
            batch = self._pending[id(b)]
            if batch:
                self._pending[id(b)] = []
                break
        if not batch:
            return
        backend = batch[0].backend
        self._executing = True
        self._cond.release()
        try:
            try:
                with self._engine:     # eval_rows runs on the engine thread (llamacpp.on_engine)
                    outs = self._timed(backend, [(r.seq, r.tokens, r.k) for r in batch])
                for r, out in zip(batch, outs):
                    r.out = out
            except BaseException as exc:       # every row of a failed batch gets the error
                for r in batch:
                    r.error = exc
        finally:
            self._cond.acquire()
            self._executing = False
            self.n_steps += 1
            self.n_rows += sum(len(r.tokens) for r in batch)
            for r in batch:
                r.done = True
            self._running += len(batch)
            self._cond.notify_all()


class SeqBackend:
    """One sequence of a multi-sequence llama.cpp backend, as a Backend for the decode loop."""

    def __init__(self, group: BatchGroup, backend, seq: int) -> None:
        if not 0 <= seq < backend.n_seq:
            raise ValueError(f"sequence {seq} is outside the backend's {backend.n_seq} sequences")
        self.group, self.shared, self.seq = group, backend, seq
        self.name = backend.name
        self.n_vocab = backend.n_vocab
        self.n_ctx = backend.n_ctx
        self.vocab_fingerprint = backend.vocab_fingerprint
        self.weight_bytes = backend.weight_bytes
        self.tokenizer = backend.tokenizer
        self.tokens = backend.seq_tokens(seq)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        toks, k = check_eval(self, tokens, n_logits)
        if not toks:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return self.group.eval(self.shared, self.seq, toks, k)

    def truncate(self, n: int) -> None:
        self.group.truncate(self.shared, self.seq, n)

    def save_state(self):
        """This sequence's saved cache (the shared backend's save_seq, between the group's evaluations)."""
        with self.group._engine:
            return self.shared.save_seq(self.seq)

    def restore_state(self, state) -> None:
        with self.group._engine:
            self.shared.restore_seq(self.seq, state)

    def close(self) -> None:
        """The shared backend is closed by its owner (the Runtime), not by a sequence."""
