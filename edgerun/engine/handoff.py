"""Hand-offs to other threads, started while the engine runs native code.

CPython runs one thread's Python at a time (the GIL). A decode loop that hands a committed token to the
server's event loop at once wakes that thread while the loop itself still has Python to run before its next
evaluation (sampling, the batch's bookkeeping, the evaluation's set-up): the two take turns on the GIL, and
the event loop's turn (a streamed token's SSE chunk, the ASGI calls, the socket write: ~0.25 ms) comes out
of the gap between two evaluations, where the model waits. Deferred here, the hand-off is made right before
the next evaluation's native call (llama_decode, onnxruntime's run), which releases the GIL for its whole
length: the event loop's Python then runs beside the evaluation instead of between evaluations.
docs/batching.md has the measurement.

Every backend calls flush() before its native evaluation and marks the call (native(True) / native(False)):
a hand-off made while an evaluation runs goes at once, since the GIL is free then (a decode loop that starts
its next evaluation before it hands over the last token, generate.py, hands over during it). A producer that
ends (or stops producing for a while) calls flush() itself, so nothing deferred waits for an evaluation that
is not coming.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

_pending: deque = deque()        # process-wide: whichever engine evaluates next delivers (order kept)
_native = 0                      # evaluations inside native code now (several contexts may evaluate at once)
_native_lock = threading.Lock()
_flush_lock = threading.Lock()


def native(entering: bool) -> None:
    """A backend enters (True) or leaves (False) its native evaluation call."""
    global _native
    with _native_lock:
        _native += 1 if entering else -1


def defer(fn: Callable[[], object]) -> None:
    """Run fn() right before the next native evaluation (on the thread that makes it), or at the next
    flush(); at once if an evaluation is in native code now. fn must be quick and must not evaluate
    (e.g. loop.call_soon_threadsafe)."""
    _pending.append(fn)
    if _native > 0:
        flush()


def flush() -> None:
    """Run the deferred calls now, oldest first (one thread at a time, so two flushing threads cannot
    deliver a stream's tokens out of order). One that raises is logged; the rest still run."""
    if not _pending:
        return
    with _flush_lock:
        while _pending:
            fn = _pending.popleft()
            try:
                fn()
            except Exception:
                log.exception("a deferred hand-off failed")


def pending() -> int:
    """How many calls wait (for tests and diagnostics)."""
    return len(_pending)
