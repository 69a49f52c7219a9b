"""The engine thread: one long-lived thread that evaluates every multi-sequence context, and the calls made on
it (on_engine, on_engine_later) and the drivers it steps between calls (attach_driver: the batch hub of
engine/inline.py). Why one thread evaluates them all is on_engine's docstring."""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from typing import Callable

from . import handoff

log = logging.getLogger(__name__)


class _Call:
    __slots__ = ("fn", "args", "result", "error", "done", "waited", "after")

    def __init__(self, fn, args, after=None) -> None:
        self.fn, self.args = fn, args
        self.result = self.error = None
        self.done = threading.Lock()
        self.done.acquire()                  # released by the engine once fn has run
        self.waited = False
        self.after = after                   # called once fn has run (on_engine_later's gate)

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:         # handed to the caller, raised there
            self.error = exc
        self.done.release()
        if self.after is not None:
            self.after()

    def wait(self):
        """fn's result (or its exception, raised here) once it has run; the same again on later calls."""
        if not self.waited:
            try:
                self.done.acquire()
            except BaseException:            # interrupted (Ctrl-C): the evaluation goes on; wait for it first
                self.done.acquire()
                self.waited = True
                raise
            self.waited = True
        if self.error is not None:
            raise self.error
        return self.result


class _Engine:
    """One long-lived thread running calls in the order they come. Hand-offs are bare locks (a caller
    blocks in one, the engine in another), not concurrent.futures: between two evaluations of a small
    model every line of Python counts, and a Future with its Condition cost ~50 µs a step more than
    this (docs/batching.md, "Between two evaluations")."""

    def __init__(self) -> None:
        self._calls: deque[_Call] = deque()
        self._drivers: list = []             # attach_driver(): stepped between calls (batch.py's hub)
        self._wake = threading.Lock()
        self._wake.acquire()                 # released when a call is queued
        self._stopping = False
        self.thread = threading.Thread(target=self._main, name="edgerun-engine", daemon=True)
        self.thread.start()
        atexit.register(self.stop)           # the call in progress ends before the interpreter frees anything

    def _main(self) -> None:
        global _engine_ident
        _engine_ident = threading.get_ident()
        wait = None                          # what the drivers asked for: None, sleep until signalled
        while not self._stopping:
            if wait is None:
                self._wake.acquire()
            elif wait > 0:
                self._wake.acquire(timeout=wait)
            while self._calls:
                self._calls.popleft().run()
            wait = None
            for driver in self._drivers:
                try:
                    w = driver.step()
                except BaseException:        # a driver's bug must not end the engine: log it, go on
                    log.exception("an engine driver failed")
                    w = None
                if w is not None and (wait is None or w < wait):
                    wait = w

    def _signal(self) -> None:
        try:
            self._wake.release()
        except RuntimeError:                 # already released: the engine looks at the queue before it sleeps
            pass

    def submit(self, fn, args, after=None) -> _Call:
        call = _Call(fn, args, after)
        if self._stopping:                   # the interpreter is exiting: no engine any more
            call.run()
            return call
        self._calls.append(call)
        self._signal()
        return call

    def stop(self) -> None:
        self._stopping = True
        self._signal()
        self.thread.join(timeout=30)


_engine: _Engine | None = None
_engine_ident: int | None = None
_engine_lock = threading.Lock()


def on_engine(fn, *args):
    """fn(*args) on the process's one engine thread, which evaluates every multi-sequence context.

    llama.cpp's CPU backend (built with OpenMP) runs a call on a thread team of the calling thread, and the
    team lives as long as that thread. With more libgomp threads than cores, libgomp spins only ~100 times
    at a barrier before sleeping (GOMP_SPINCOUNT in its manual), and a graph has a barrier per operation:
    a second live team, idle or not, slowed the working one on 2 cores (bench/omp_teams.py; a --parallel 4
    server whose loader thread had run the cost probe, 0.83x of one that read the probe's cache;
    docs/batching.md has the figures). So whoever calls (a slot's
    decode loop, the start-up cost probe, an API user's thread), a context of several sequences is evaluated
    here. An interrupted caller waits for the evaluation in progress before the exception goes on (the
    context is not freed under llama.cpp)."""
    if threading.get_ident() == _engine_ident:
        return fn(*args)
    return _engine_submit(fn, args).wait()


def attach_driver(driver) -> None:
    """Step `driver` on the engine thread, between queued calls, from now on: driver.step() -> float | None
    is called after every wake-up and returns when to call it again (0: at once, after any queued calls;
    s > 0: after s seconds or the next signal, whichever comes first; None: at the next signal). Wake the
    engine with signal_engine(). batch.py's hub steps the sequences of a batching group this way."""
    eng = _engine_get()
    with _engine_lock:
        if driver not in eng._drivers:
            eng._drivers.append(driver)
    eng._signal()


def signal_engine() -> None:
    """Wake the engine thread so that its drivers step (a no-op before the engine exists)."""
    if _engine is not None:
        _engine._signal()


def on_engine_later(fn, *args) -> Callable[[], object]:
    """Start fn(*args) (an evaluation) on the engine thread; return once it is inside native code (the next
    llama_decode has begun: engine/handoff.py's next flush) or has ended, whichever comes first. Calling the
    returned function waits for fn and returns its result (or raises its exception). The caller's Python
    after this runs beside the evaluation: returning at once instead, the caller would hold the GIL while
    the engine thread waits for it to set the evaluation up (~40 µs a token, docs/batching.md). On the
    engine thread itself fn runs now."""
    if threading.get_ident() == _engine_ident:
        call = _Call(fn, args)
        call.run()
        return call.wait
    gate = threading.Lock()
    gate.acquire()

    def open_gate() -> None:
        try:
            gate.release()
        except RuntimeError:                 # opened already (by the decode, then by the end)
            pass

    handoff.defer(open_gate)
    call = _engine_submit(fn, args, open_gate)
    gate.acquire()
    return call.wait


def _engine_get() -> _Engine:
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = _Engine()
    return _engine


def _engine_submit(fn, args, after=None) -> _Call:
    return _engine_get().submit(fn, args, after)
