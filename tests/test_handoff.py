"""What runs between two evaluations: deferred hand-offs (engine/handoff.py), the engine thread's calls
(engine/thread.py on_engine) and the logits a backend returns (its own arrays, not llama.cpp's buffer)."""

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from edgerun.backends.llamacpp import LlamaCppBackend
from edgerun.config import BackendArgs
from edgerun.request import Request
from edgerun.engine import handoff, thread as engine_thread
from edgerun.engine import on_engine


@pytest.fixture(autouse=True)
def _empty():
    handoff.flush()
    yield
    handoff.flush()


def test_deferred_calls_run_in_order_at_flush_and_a_failing_one_spares_the_rest(caplog):
    seen = []
    handoff.defer(lambda: seen.append(1))
    handoff.defer(lambda: 1 / 0)
    handoff.defer(lambda: seen.append(2))
    assert seen == [] and handoff.pending() == 3
    handoff.flush()
    assert seen == [1, 2] and handoff.pending() == 0
    assert "a deferred hand-off failed" in caplog.text
    handoff.flush()                                   # nothing left: nothing runs twice
    assert seen == [1, 2]


@pytest.mark.parametrize("n_seq", [1, 2])
def test_an_evaluation_delivers_what_waits_right_before_its_decode(tiny_llama, n_seq):
    """A deferred call runs as the next llama_decode begins (before the tokens are in the cache), on the
    thread that evaluates (the engine thread for a multi-sequence context)."""
    be = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=64, n_threads=1, n_seq=n_seq))
    try:
        be.eval([1, 2, 3], 1)
        seen = []
        handoff.defer(lambda: seen.append((be.n_past, threading.current_thread().name)))
        be.eval([4], 1)
        assert len(seen) == 1 and seen[0][0] == 3          # ran before the decode appended token 4
        assert be.n_past == 4 and handoff.pending() == 0
        expected = "edgerun-engine" if n_seq > 1 else threading.current_thread().name
        assert seen[0][1] == expected
    finally:
        be.close()


def test_logits_are_the_callers_own_arrays(tiny_llama):
    """Each eval returns fresh arrays: a later decode (which reuses llama.cpp's output buffer, read through
    a cached view) leaves earlier results as they were."""
    be = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=64, n_threads=1))
    try:
        a = be.eval([1, 2, 3], 1)
        kept = a.copy()
        b = be.eval([7], 1)
        c = be.eval([9, 10], 2)
        np.testing.assert_array_equal(a, kept)
        assert not np.shares_memory(a, b) and not np.shares_memory(b, c)
        assert not np.array_equal(a[0], b[0])
        be.truncate(3)
        np.testing.assert_array_equal(be.eval([7], 1), b)     # the same position again: the same logits
    finally:
        be.close()


def test_engine_runs_calls_on_one_thread_and_returns_results_and_errors():
    names = {on_engine(lambda: threading.current_thread().name) for _ in range(3)}
    assert names == {"edgerun-engine"}
    assert on_engine(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        on_engine(lambda: 1 / 0)
    assert on_engine(lambda: on_engine(lambda: "nested")) == "nested"   # from the engine itself: inline
    # many callers at once: each gets its own result
    out: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, on_engine(lambda: i * i)))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {i: i * i for i in range(16)}
    assert engine_thread._engine.thread.is_alive()


def test_a_jobs_steps_reach_its_event_loop_in_order_before_its_end():
    """The scheduler defers each step's hand-off to the next evaluation; the end goes at once, after them."""
    from edgerun.serve.scheduler import Job

    async def main():
        job = Job(Request(prompt="x"))
        worker = threading.Thread(target=lambda: ([job._emit("step", i) for i in range(5)], job._emit("end", "done")))
        worker.start()
        await asyncio.to_thread(worker.join)
        got = [await asyncio.wait_for(job.events.get(), 5) for _ in range(6)]
        return got

    got = asyncio.run(main())
    assert got == [("step", i) for i in range(5)] + [("end", "done")]


def test_job_events_reach_the_loop_in_order_without_a_lost_wake():
    """JobEvents (the job's channel to its event loop): events put by another thread arrive in order, and
    one put just after the loop found the channel empty but before it registered as waiting (the race an
    eager-sleeping reader loses: the event would wait for the deadline) is delivered at once."""
    import random

    from edgerun.serve.scheduler import JobEvents

    class RacyLoop:                              # puts an event inside get_until's window, deterministically
        def __init__(self, loop):
            self.loop, self.inject = loop, []

        def create_future(self):
            while self.inject:
                ev.put(self.inject.pop())
            return self.loop.create_future()

        def __getattr__(self, name):
            return getattr(self.loop, name)

    n = 2000

    async def main():
        nonlocal ev
        racy = RacyLoop(asyncio.get_running_loop())
        ev = JobEvents(racy)
        racy.inject.append("raced")
        first = await asyncio.wait_for(ev.get_until(time.monotonic() + 60), 10)
        rnd = random.Random(7)

        def produce():
            for i in range(n):
                for _ in range(rnd.randrange(200)):
                    pass
                ev.put(i)
        th = threading.Thread(target=produce)
        th.start()
        got = [await asyncio.wait_for(ev.get_until(time.monotonic() + 60), 30) for _ in range(n)]
        th.join()
        ev.close()
        return first, got

    ev = None
    first, got = asyncio.run(main())
    assert first == "raced" and got == list(range(n))


def test_job_events_wait_until_the_deadline_and_rearm_when_it_moves():
    """get_until raises TimeoutError once its deadline passes with nothing come; a later wait with another
    deadline gets what comes meanwhile; get_nowait raises QueueEmpty on an empty channel."""
    from edgerun.serve.scheduler import JobEvents

    async def main():
        loop = asyncio.get_running_loop()
        ev = JobEvents(loop)
        with pytest.raises(asyncio.QueueEmpty):
            ev.get_nowait()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ev.get_until(time.monotonic() + 0.05), 30)
        loop.call_later(0.05, lambda: threading.Thread(target=ev.put, args=("late",)).start())
        got = await asyncio.wait_for(ev.get_until(time.monotonic() + 60), 30)
        ev.put("now")
        assert ev.get_nowait() == "now"
        ev.close()
        return got

    assert asyncio.run(main()) == "late"


class _CountingLoop:
    """An event loop that counts the wakes sent to it from other threads (call_soon_threadsafe)."""

    def __init__(self, loop):
        self.loop, self.wakes = loop, 0

    def call_soon_threadsafe(self, *args):
        self.wakes += 1
        return self.loop.call_soon_threadsafe(*args)

    def __getattr__(self, name):
        return getattr(self.loop, name)


def _produce_while_waiting(ev, items, waiting):
    """Put each item from another thread once the loop waits on the channel (so a put can wake it)."""
    def go():
        for item in items:
            assert waiting(), "the loop never waited"
            ev.put(item)
    th = threading.Thread(target=go)
    th.start()
    return th


@pytest.mark.parametrize("hold_s, wakes", [(0.0, 6), (3600.0, 2), (float("inf"), 1)],
                         ids=["every-token", "held", "not-streamed"])
def test_job_events_hold_steps_that_come_within_the_interval(hold_s, wakes):
    """hold_s (--stream-interval): a step coming within hold_s of the last wake is held and reaches the loop
    with the job's next event; the end is never held; math.inf holds every step until the end (an answer
    that is not streamed). Every event arrives, in order, whatever the holding."""
    from edgerun.serve.scheduler import JobEvents

    async def main():
        loop = _CountingLoop(asyncio.get_running_loop())
        ev = JobEvents(loop, hold_s=hold_s)

        def waiting():                       # the loop waits, and no wake has been sent to this wait yet
            deadline = time.monotonic() + 30
            while (ev._waiter is None or ev._woken is ev._waiter) and time.monotonic() < deadline:
                time.sleep(0.001)
            return ev._waiter is not None and ev._woken is not ev._waiter
        items = [("step", i) for i in range(5)] + [("end", "done")]
        got = []
        if hold_s < math.inf:                 # the first step wakes the loop
            th = _produce_while_waiting(ev, items[:1], waiting)
            got.append(await asyncio.wait_for(ev.get(), 30))
            await asyncio.to_thread(th.join)
        th = _produce_while_waiting(ev, items[len(got):], waiting)   # quicker than hold_s: held, then the end
        while len(got) < len(items):
            got.append(await asyncio.wait_for(ev.get(), 30))
        await asyncio.to_thread(th.join)
        ev.close()
        return got, loop.wakes, items

    got, n_wakes, items = asyncio.run(main())
    assert got == items
    assert n_wakes == wakes


def test_a_step_held_before_a_pause_is_nudged_out():
    """A step held (it came within hold_s of the last wake) when the producer then pauses (a long step, a
    stalled engine) still reaches the loop: once events flow, a wait arms a nudge at 2 * hold_s. Without
    the nudge the step would wait for the job's next event, which here never comes."""
    from edgerun.serve.scheduler import JobEvents

    async def main():
        loop = asyncio.get_running_loop()
        ev = JobEvents(loop, hold_s=0.05)
        held = []

        def put_while_waiting(item):
            while ev._waiter is None or ev._woken is ev._waiter:
                time.sleep(0.001)
            woke_at = ev._woke_at
            ev.put(item)
            held.append(ev._woke_at == woke_at)  # no wake was sent for it
        th = threading.Thread(target=put_while_waiting, args=(("step", 0),))
        th.start()
        first = await asyncio.wait_for(ev.get(), 30)
        await asyncio.to_thread(th.join)
        th = threading.Thread(target=put_while_waiting, args=(("step", 1),))
        th.start()
        second = await asyncio.wait_for(ev.get(), 30)
        await asyncio.to_thread(th.join)
        ev.close()
        return first, second, held

    first, second, held = asyncio.run(main())
    assert (first, second) == (("step", 0), ("step", 1))
    # step 0 woke the loop; step 1 came within 50 ms of that wake and was held (on a machine so slow that
    # it came later, it woke the loop itself and the nudge was not needed)
    assert held[0] is False
