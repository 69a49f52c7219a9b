"""A job's events, from the thread that generates it to the asyncio event loop that answers it (JobEvents):
the serve scheduler's channel between its slots and the HTTP server."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque


class JobEvents:
    """A job's events, from the thread that runs it to the event loop that answers it: put() from any
    thread, get_until() on the loop. An asyncio.Queue fed by call_soon_threadsafe and read under an
    asyncio.timeout cost the loop a callback, a timer and a getter future per token, CPU that on a 2-core
    board comes out of the model's evaluation running beside it (docs/batching.md); here a token costs a
    deque append, the loop is woken only while it waits (once per wait), and one deadline timer per job
    is re-armed only when the deadline changes.

    hold_s: a step ("step" event) that comes less than hold_s after the last wake is held, not woken for:
    it reaches the loop with the job's next event (the next step, or the end), so a fast decode wakes the
    loop once per hold_s instead of once per token and the loop writes the held tokens in one go
    (`edgerun serve --stream-interval`, docs/batching.md). Once events flow, each wait also arms a nudge
    at 2 * hold_s, so a step held before a long pause (a newcomer's prompt in the batch, a stalled engine)
    reaches the loop within 2 * hold_s; a decode that keeps pace never lets the nudge ring.
    0 wakes for every event; math.inf holds every step until the end (a response that is not streamed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold_s: float = 0.0) -> None:
        self._loop = loop
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._woken: asyncio.Future | None = None   # the waiter a wake was sent to (one per wait)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None     # the monotonic time the timer rings for
        self.hold_s = hold_s
        self._woke_at = -math.inf                # when put() last woke the loop (the producer's clock)
        self._flowing = False                    # an event has been read: waits arm the nudge (hold_s finite)

    def put(self, item) -> None:
        """Hand an event over (any thread). RuntimeError if the loop is closed."""
        self._items.append(item)
        waiter = self._waiter                    # set by get_until before it re-checks the items: no lost wake
        if waiter is not None and self._woken is not waiter:
            if self.hold_s and item[0] == "step":
                now = time.monotonic()
                if now - self._woke_at < self.hold_s or self.hold_s == math.inf:
                    return                       # held: the job's next event wakes the loop for both
                self._woke_at = now
            self._woken = waiter
            self._loop.call_soon_threadsafe(_wake, waiter)

    def get_nowait(self):
        """The next event; asyncio.QueueEmpty if none has come."""
        try:
            return self._pop()
        except IndexError:
            raise asyncio.QueueEmpty from None

    async def get_until(self, when: float):
        """The next event, waiting until time.monotonic() reaches `when` at most (asyncio.TimeoutError)."""
        while True:
            if self._items:
                return self._pop()
            left = when - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            if self._timer_at != when and when != math.inf:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._timer_at = self._loop.call_later(left, self._ring), when
            fut = self._loop.create_future()
            self._waiter = fut
            if self._items:                      # came between the check above and the waiter being set
                self._waiter = None
                continue
            nudge = (self._loop.call_later(2 * self.hold_s, _wake, fut)
                     if self._flowing and 0 < self.hold_s < math.inf else None)
            try:
                await fut
            finally:
                if nudge is not None:
                    nudge.cancel()
                if self._waiter is fut:
                    self._waiter = None

    def _pop(self):
        item = self._items.popleft()
        self._flowing = True
        return item

    async def get(self):
        """The next event, however long it takes."""
        return await self.get_until(math.inf)

    def close(self) -> None:
        """Cancel the deadline timer (the job has ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None

    def _ring(self) -> None:
        self._timer = self._timer_at = None      # re-armed by the next wait if it rang early
        if self._waiter is not None:
            _wake(self._waiter)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
