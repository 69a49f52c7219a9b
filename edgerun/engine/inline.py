"""Members of a batching group stepped on the engine thread (BatchGroup.run_inline): each decode loop is a
greenlet of that thread, which resumes each with its rows, collects the next ones and evaluates them with no
thread switch between two decodes (docs/batching.md, "One thread steps the batch"). `blocking()` parks such
a member while a wait runs on the thread that submitted it."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from . import handoff

try:                        # the engine thread steps the server's sequences itself (run_inline) where it is
    import greenlet as _greenlet
except ImportError:         # pragma: no cover - then every member runs on its own thread (drive)
    _greenlet = None


YIELD_GRACE_S = 0.005     # how long a batch waits for a member whose consumer holds its last Step
ADMIT_GRACE_S = 0.05      # how long a batch waits for jobs being placed on free slots (their prompts join it)


class _Failed:
    """An exception handed into a member stepped by the hub, raised there."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Member:
    """A decode loop stepped by the hub (run_inline) and what it tells the thread that submitted it."""
    __slots__ = ("steps", "on_step", "glet", "mail", "task", "error", "cancelled", "__weakref__")

    def __init__(self, steps: Iterator, on_step: Callable) -> None:
        self.steps, self.on_step = steps, on_step
        self.glet = None
        self.mail = threading.Lock()     # released by the hub: a wait to run (task) or the member's end
        self.mail.acquire()
        self.task: Callable | None = None
        self.error: BaseException | None = None
        self.cancelled = False

    def main(self) -> None:
        """The member's greenlet: its loop's Steps to on_step until one says stop or the loop ends."""
        try:
            for step in self.steps:
                if self.on_step(step) is False or self.cancelled:
                    break
        except BaseException as exc:         # handed to run_inline's caller
            self.error = exc
        finally:
            try:
                self.steps.close()           # the loop's rollback (truncate), still as a member
            except BaseException as exc:
                self.error = self.error or exc


if _greenlet is not None:
    class _MemberGreenlet(_greenlet.greenlet):
        """A member's greenlet (BatchGroup.eval tells a member stepped by the hub by its type)."""
        __slots__ = ()
else:                                        # pragma: no cover
    class _MemberGreenlet:                   # never instantiated: eval's type check fails for every caller
        pass


def blocking(fn: Callable):
    """Run fn() (a wait: for a lock, an event, a file) from a decode loop or its consumer, and return its
    result. In a member stepped by the engine thread (run_inline) fn runs on the thread that submitted
    the member, which waits for it anyway, while the member is parked and the batch goes on without it;
    anywhere else fn() runs here."""
    if _greenlet is None:
        return fn()
    me = _greenlet.getcurrent()
    if type(me) is not _MemberGreenlet:
        return fn()
    return _to_hub(me, ("park", fn))


def _to_hub(me, msg: tuple):
    """Switch from a member's greenlet to the hub with msg; what the hub hands back (raised if a _Failed)."""
    out = me.parent.switch(msg)
    if type(out) is _Failed:
        raise out.exc
    return out


class _Hub:
    """Steps the members of one BatchGroup that joined through run_inline, on the engine thread
    (thread.attach_driver): resume each with its rows, let it run to its next post, evaluate the posted
    rows of one backend (drafters first), again. Between two decodes there is no thread switch: the
    members' Python runs back to back on the thread that evaluates."""

    def __init__(self, group) -> None:          # a BatchGroup
        self.group = group
        self.inbox: list[_Member] = []           # joined, not started (appended under the group's condition)
        self.woken: list[tuple[_Member, object]] = []   # parked members whose wait ended, with its result
        self._ready: list[tuple[_Member, object]] = []  # to resume, with what to hand them
        self._posted: dict[int, list] = {id(b): [] for b in group.backends}   # backend -> [(member, view, tokens, k)]
        self._parked = 0
        self._grace_until: float | None = None   # how long this step waits for parked members (YIELD_GRACE_S)

    def step(self) -> float | None:
        g = self.group
        if self.inbox or self.woken:             # (read unlocked: a list's truth is one load; taken under the lock)
            with g._cond:
                new, self.inbox = self.inbox, []
                woken, self.woken = self.woken, []
            for m in new:
                m.glet = _MemberGreenlet(m.main)
                self._ready.append((m, None))
            self._parked -= len(woken)
            self._ready.extend(woken)
        ready, self._ready = self._ready, []
        for m, val in ready:
            msg = m.glet.switch(val) if m.glet else m.glet.switch()     # a new one starts in main()
            if m.glet.dead:
                self._leave(m)
            elif msg[0] == "eval":
                self._posted[id(msg[1].shared)].append((m, msg[1], msg[2], msg[3]))
            else:                                # "park": the submitting thread runs the wait
                self._parked += 1
                m.task = msg[1]
                m.mail.release()
        if not g._hub_active:
            return None                          # no member here: drive()'s members evaluate their own batches
        if g._active and (g._running or g._executing):
            return None                          # a member of drive() is running Python: its rows join this
                                                 # step (its post signals the engine)
        batch = None
        for b in g.backends:
            if self._posted[id(b)] or g._pending[id(b)]:
                batch = b
                break
        if batch is None:
            return None                          # nothing posted: members parked (woken by a signal)
        if self._parked or g._yielded:           # a member parked in a wait (blocking()), or one of drive()'s
            now = time.monotonic()               # whose consumer holds a Step, is back in a moment, usually:
            if self._grace_until is None:        # the step waits YIELD_GRACE_S for it, as drive()'s batches do
                self._grace_until = now + YIELD_GRACE_S
            if now < self._grace_until:
                handoff.flush()
                return self._grace_until - now
        if g._admitting or g._moves:
            with g._cond:
                if g._admitting:                 # a job being placed on a free slot joins this step if it comes
                    wait = max(g._admitting.values()) + ADMIT_GRACE_S - time.monotonic()     # within the grace
                    if wait > 0:
                        handoff.flush()
                        return wait
                if g._moves and g._running == 0 and not g._executing:   # nor drive()'s members' Python or batch
                    g._apply_moves()
        self._grace_until = None
        posted, self._posted[id(batch)] = self._posted[id(batch)], []
        theirs: list = []                        # drive()'s members' rows of this backend join the batch
        if g._pending[id(batch)]:
            with g._cond:
                theirs, g._pending[id(batch)] = g._pending[id(batch)], []
        # ids read now: a move may have changed them
        rows = [(view.seq, toks, k) for _, view, toks, k in posted] + [(r.view.seq, r.tokens, r.k) for r in theirs]
        try:
            outs = g._evaluate(batch, rows)
        except BaseException as exc:             # every row of a failed batch gets the error
            outs = [_Failed(exc)] * len(rows)
        g.n_steps += 1
        g.n_rows += sum(len(r[1]) for r in rows)
        self._ready = [(m, out) for (m, _, _, _), out in zip(posted, outs)]
        if theirs:
            with g._cond:
                for r, out in zip(theirs, outs[len(posted):]):
                    if type(out) is _Failed:
                        r.error = out.exc
                    else:
                        r.out = out
                    r.done = True
                g._running += len(theirs)
                g._cond.notify_all()
        return 0

    def _leave(self, m: _Member) -> None:
        g = self.group
        with g._cond:
            g._hub_active -= 1
            g._drop_moves(g._members.pop(m, ()))
            g._cond.notify_all()
        m.glet = None
        m.mail.release()                         # task is None: the end
