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
from typing import Callable, Iterator, Sequence

import numpy as np

from . import handoff
from .inline import (ADMIT_GRACE_S, YIELD_GRACE_S, _Failed, _greenlet, _Hub, _Member, _MemberGreenlet,
                     _to_hub, blocking)
from .sequence import SeqBackend
from .thread import attach_driver, on_engine, on_engine_later, signal_engine

__all__ = ["ADMIT_GRACE_S", "YIELD_GRACE_S", "BatchGroup", "SeqBackend", "blocking"]


class _Request:
    __slots__ = ("view", "tokens", "k", "out", "error", "done")

    def __init__(self, view: "SeqBackend", tokens: list[int], k: int) -> None:
        self.view, self.tokens, self.k = view, tokens, k    # the sequence id is read when it is evaluated
        self.out: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = False


class _Move:
    __slots__ = ("src", "dst", "done", "ok")

    def __init__(self, src: Sequence["SeqBackend"], dst: Sequence["SeqBackend"]) -> None:
        self.src, self.dst = list(src), list(dst)
        self.done = False
        self.ok = False


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
        self._members: dict = {}       # thread ident (drive) or _Member (run_inline) -> the views of its slot
        self._moves: list[_Move] = []          # sequences to move at the next step (move())
        self._engine = threading.Lock()    # held around every llama.cpp call on the shared contexts
        self.n_steps = 0               # batches evaluated, and rows in them (sequences x positions)
        self.n_rows = 0
        self.eval_s = 0.0              # wall time inside those evaluations
        self.n_moves = 0               # running sequences moved to other ids (move())
        self._hub = _Hub(self) if _greenlet is not None else None
        self._hub_active = 0           # members stepped by the engine thread (run_inline)
        self.n_inline = 0              # members that have joined through run_inline

    @property
    def n_active(self) -> int:
        return self._active + self._hub_active

    def alone_now(self) -> bool:
        """Whether a generation starting on the calling thread now would be the group's only one: no member
        running, no other job being placed (begin_admission on another thread)."""
        me = threading.get_ident()
        with self._cond:
            return self._active + self._hub_active == 0 and all(t == me for t in self._admitting)

    @property
    def steps_inline(self) -> bool:
        """Whether run_inline() can step members on the engine thread (greenlet is installed)."""
        return self._hub is not None

    def view(self, backend, seq: int) -> "SeqBackend":
        return SeqBackend(self, backend, seq)

    def add_backend(self, backend) -> None:
        """A backend joins the group first in priority (a drafter loaded after the slots were made:
        speculative/lazy.py SlotDrafters). Only while no member runs: the caller checks alone_now()."""
        with self._cond:
            self.backends.insert(0, backend)
            self._pending[id(backend)] = []

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
                if self._hub_active:
                    signal_engine()        # the hub may be waiting for this admission

    def drive(self, steps: Iterator, views: Sequence["SeqBackend"] = (), keep: list | None = None) -> Iterator:
        """Run a decode loop (a generator of Steps) as a member: while it runs Python the group's next
        batch waits for its rows; while its consumer holds a Step (the loop is suspended) the batch
        waits YIELD_GRACE_S for it, then goes on without it; once it has ended, without it. views: the
        loop's sequence views (one per backend), which move() may then give other ids between steps.
        Closing it closes the loop (its rollback), unless keep[0] is true then (run(): the loop goes on
        elsewhere)."""
        me = threading.get_ident()
        self._change(active=1, running=1, joined=True)
        with self._cond:
            self._members[me] = tuple(views)
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
                if not (keep and keep[0]):
                    steps.close()      # the loop's rollback (truncate) runs while this member counts
            finally:
                with self._cond:
                    views = self._members.pop(me, ())
                    if not (keep and keep[0]):   # it has left (not gone on in run_inline): nothing to move
                        self._drop_moves(views)
                self._change(active=-1, running=-1)

    def run(self, steps: Iterator, on_step: Callable, views: Sequence["SeqBackend"] = ()) -> None:
        """Run a decode loop (a generator of Steps) as a member, calling on_step(step) for each Step until
        it returns False or the loop ends; return once the member has left (its loop closed, its caches
        rolled back), raising what the loop or on_step raised.

        A loop that starts alone runs on this thread (as drive() would run it): a lone sequence's next
        evaluation begins before its token is handed over, which one thread cannot do. From the first Step
        at which another member has joined (or a job is being placed) it moves to the engine thread
        (run_inline), as does every loop that starts beside others: the engine thread then steps them all
        with no thread switch between two decodes. Without greenlet every loop runs on its own thread."""
        if self._hub is not None and not self.alone_now():
            return self.run_inline(steps, on_step, views)
        keep = [False]
        it = self.drive(steps, views, keep)
        try:
            for step in it:
                if on_step(step) is False:
                    return
                if self._hub is not None and (self._hub_active or self._active > 1 or self._admitting):
                    keep[0] = True
                    self.begin_admission()      # the step it leaves waits for its rows on the engine thread
                    break
        finally:
            it.close()                          # leaves as a member of drive() (closing the loop unless kept)
        if keep[0]:
            self.run_inline(steps, on_step, views)

    def run_inline(self, steps: Iterator, on_step: Callable, views: Sequence["SeqBackend"] = ()) -> None:
        """Run a decode loop (a generator of Steps) as a member stepped by the engine thread, calling
        on_step(step) there for each Step until it returns False or the loop ends; return when the member
        has left (its loop closed, its caches rolled back), raising what the loop or on_step raised.

        Where drive() gives each member a thread of its own (woken at every step, then taking its turn on
        the GIL), here every member of the group runs as a greenlet of the engine thread, which resumes
        each with its rows, collects the next ones and evaluates them with no thread switch between two
        decodes (docs/batching.md, "One thread steps the batch"). on_step runs on the engine thread: it must
        not block (wrap a wait in blocking(), which parks the member and runs the wait on this thread).
        Members of drive() and of run_inline() may share a group: the hub takes drive()'s posted rows into
        its batches. Needs greenlet (steps_inline); run() falls back to drive() without it."""
        if self._hub is None:
            raise RuntimeError("run_inline needs the greenlet package (BatchGroup.steps_inline)")
        m = _Member(steps, on_step)
        with self._cond:
            self._admitting.pop(threading.get_ident(), None)     # this admission has joined
            self._hub_active += 1
            self.n_inline += 1
            self._members[m] = tuple(views)
            self._hub.inbox.append(m)
        attach_driver(self._hub)
        interrupted = None
        while True:
            try:
                m.mail.acquire()             # the hub posts a wait to run here (blocking()) or the end
            except BaseException as exc:     # interrupted (Ctrl-C): stop the member and wait for it to leave
                interrupted = interrupted or exc
                m.cancelled = True
                continue
            task, m.task = m.task, None
            if task is None:
                break
            try:
                val = task()
            except BaseException as exc:
                val = _Failed(exc)
            with self._cond:
                self._hub.woken.append((m, val))
            signal_engine()
        if interrupted is not None:
            raise interrupted
        if m.error is not None:
            raise m.error

    def move(self, src: Sequence["SeqBackend"], dst: Sequence["SeqBackend"], timeout_s: float = 1.0) -> bool:
        """Move a running member's sequences (src: its views, one per backend, as given to drive) to the ids
        of an idle slot's views (dst, the same backends in the same order), at the next step: when every
        member waits for an evaluation or holds a Step, before the evaluation. The caches move (a state copy,
        ~1 ms per 100 positions), and the views swap ids: src's now name dst's former ids, whose caches they
        hold, and dst's the former ids of src, left empty. The caller owns dst (an idle slot: nothing else
        uses it meanwhile). False when src is not a member's views (not joined yet, or ended: at once, and
        as soon as the member leaves while the move waits), the copy failed, the move was cancelled
        (cancel_moves) or no step came within timeout_s; then nothing moved.

        What it is for: with one KV stream per sequence llama.cpp splits a batch at every gap in the ids, so
        busy sequences 0 and 2 cost two passes over the weights where 0 and 1 cost one (gapfill.py); the
        scheduler closes a gap that a finished job leaves by moving the highest busy sequence into it."""
        src, dst = list(src), list(dst)
        if len(src) != len(dst) or any(a.shared is not b.shared for a, b in zip(src, dst)):
            raise ValueError("move() needs one idle view per backend of the member's, in the same order")
        mv = _Move(src, dst)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if _key(src) not in self._member_keys():
                return False
            self._moves.append(mv)
            while not mv.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._moves.remove(mv)
                    return False
                self._cond.wait(left)
        return mv.ok

    def cancel_moves(self) -> None:
        """End every move still waiting for a step, unapplied (move() returns False). The scheduler cancels
        them when a job arrives: the slot a move would fill takes the job at once instead of holding its
        admission for a step."""
        with self._cond:
            self._drop_moves(None)

    def _drop_moves(self, views) -> None:
        """With the condition held: end the waiting moves of the member whose views these are (it has left:
        no step will move it), or all of them (views None), unapplied."""
        key = None if views is None else _key(views)
        keep = []
        for mv in self._moves:
            if key is None or _key(mv.src) == key:
                mv.done = True
            else:
                keep.append(mv)
        if len(keep) != len(self._moves):
            self._moves = keep
            self._cond.notify_all()

    def _member_keys(self) -> set[tuple[int, ...]]:
        """The _key of every member's views (with the condition held)."""
        return {_key(v) for v in self._members.values()}

    def _apply_moves(self) -> None:
        """Run the requested moves (called by _execute with the condition held, no member running Python)."""
        moves, self._moves = self._moves, []
        members = self._member_keys()
        with self._engine:
            for mv in moves:
                if _key(mv.src) in members:
                    done = []
                    try:
                        for a, b in zip(mv.src, mv.dst):
                            a.shared.move_seq(a.seq, b.seq)
                            a.seq, b.seq = b.seq, a.seq
                            done.append((a, b))
                        mv.ok = True
                        self.n_moves += 1
                    except Exception:           # BackendError: back where they were (the moved ones)
                        for a, b in reversed(done):
                            a.shared.move_seq(a.seq, b.seq)
                            a.seq, b.seq = b.seq, a.seq
                mv.done = True
        self._cond.notify_all()

    def _change(self, *, active: int = 0, running: int = 0, yielded: int = 0, joined: bool = False) -> None:
        with self._cond:
            if joined:                           # an admission ends as its loop becomes a member
                self._admitting.pop(threading.get_ident(), None)
            self._active += active
            self._running += running
            self._yielded += yielded
            if self._running == 0 and running < 0:
                self._cond.notify_all()          # the others all wait for an eval: one of them runs it
                if self._hub_active:
                    signal_engine()              # or the hub does, with its members' rows

    # -- called by SeqBackend ------------------------------------------------------------------
    def _claim_alone(self) -> bool:
        """Whether the calling member is the only one, with nothing else waiting for a step (no admission, no
        move, no evaluation in progress); if so it holds the engine (_executing) from now on."""
        with self._cond:
            alone = (self._active == 1 and self._running == 1 and not self._executing and not self._yielded
                     and not self._admitting and not self._moves and not self._hub_active)
            if alone:
                self._executing = True
            return alone

    def begin(self, view: "SeqBackend", tokens: list[int], k: int):
        """Start evaluating the calling member's rows on the engine thread and return at once, when it is the
        only member (see _claim_alone): the returned function waits for the logits. None otherwise (then
        eval() as usual). The member stays counted as running meanwhile: one that joins waits for this
        evaluation and then for the member's next rows, as after any evaluation."""
        if _greenlet is not None and type(_greenlet.getcurrent()) is _MemberGreenlet:
            return None
        if not self._claim_alone():
            return None
        return on_engine_later(self._eval_alone, view, tokens, k)

    def eval(self, view: "SeqBackend", tokens: list[int], k: int) -> np.ndarray:
        if _greenlet is not None:
            me = _greenlet.getcurrent()
            if type(me) is _MemberGreenlet:     # a member stepped by the engine thread: post, and switch to it
                return _to_hub(me, ("eval", view, tokens, k))
        if self._claim_alone():
            return self._eval_alone(view, tokens, k)
        req = _Request(view, tokens, k)
        with self._cond:
            self._pending[id(view.shared)].append(req)
            self._running -= 1          # the last member to post evaluates the batch itself (no wake-up)
            if self._hub_active and self._running == 0:
                signal_engine()         # with members on the engine thread its hub evaluates: these rows are in
            graced = False
            while not req.done:
                if self._running == 0 and not self._executing and not self._hub_active:
                    if self._yielded and not graced:
                        # a member is handing its token to its consumer and is about to post its next
                        # rows: give it a moment (it then evaluates the batch itself) rather than split
                        # the batch; a consumer that holds its Step longer costs the others only this
                        graced = True
                        handoff.flush()     # no evaluation for a while: deliver what waits for one
                        self._cond.wait(YIELD_GRACE_S)
                        continue
                    if self._admitting:
                        # a job is being placed on a free slot: its prompt joins this batch if it comes
                        # within ADMIT_GRACE_S of the admission's start (it then evaluates the batch
                        # itself), else a later one
                        wait = max(self._admitting.values()) + ADMIT_GRACE_S - time.monotonic()
                        if wait > 0:
                            handoff.flush()
                            self._cond.wait(wait)
                            continue
                    self._execute()
                else:
                    self._cond.wait()
        if req.error is not None:
            raise req.error
        return req.out

    def _eval_alone(self, view: "SeqBackend", tokens: list[int], k: int) -> np.ndarray:
        """The only member's rows, evaluated at once (a lone client's every step): what _execute does for a
        batch of one, with less Python between two evaluations (docs/batching.md). The member stays counted
        as running, so one that joins meanwhile waits for this evaluation and then for the member's next
        rows, as it would in a batch."""
        try:
            return self._evaluate(view.shared, [(view.seq, tokens, k)])[0]
        finally:
            with self._cond:
                self._executing = False
                self.n_steps += 1
                self.n_rows += len(tokens)
                self._cond.notify_all()

    def _evaluate(self, backend, rows):
        """eval_rows under the engine lock, taken on the thread that evaluates: the engine thread for a
        context of several sequences (on_engine). Whoever holds the lock never waits for the engine thread,
        which itself takes the lock (the hub), so neither can wait for the other."""
        def run():
            with self._engine:
                return self._timed(backend, rows)
        if getattr(backend, "n_seq", 1) > 1:
            return on_engine(run)
        return run()

    def _timed(self, backend, rows):
        t0 = time.perf_counter()
        try:
            return backend.eval_rows(rows)
        finally:
            self.eval_s += time.perf_counter() - t0

    def truncate(self, view: "SeqBackend", n: int) -> None:
        with self._engine:                # the id is read under the lock: move() changes it under it too
            view.shared.truncate_seq(view.seq, n)

    def _execute(self) -> None:
        """Evaluate the posted rows of the first backend that has any (called with the condition held)."""
        if self._moves and not self._hub_active:     # with members on the engine thread, its hub moves
            self._apply_moves()
        batch: list[_Request] = []
        for b in self.backends:
            batch = self._pending[id(b)]
            if batch:
                self._pending[id(b)] = []
                break
        if not batch:
            return
        backend = batch[0].view.shared
        self._executing = True
        self._cond.release()
        try:
            try:
                outs = self._evaluate(backend, [(r.view.seq, r.tokens, r.k) for r in batch])
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


def _key(views) -> tuple[int, ...]:
    """A member's views as one comparable value: the views themselves (by identity), in order."""
    return tuple(map(id, views))
