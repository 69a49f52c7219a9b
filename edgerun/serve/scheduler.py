"""The generation workers: slots that run jobs from a bounded FIFO queue.

The worker thread loads the models itself (the HTTP socket is already serving /health meanwhile). A
Runtime loaded with parallel 1 serves one generation at a time on that thread, as it always did. With
parallel N (continuous batching) it runs N slot threads, one per sequence of the shared contexts
(Runtime.slots): a free slot takes the oldest waiting job as soon as its previous one ends (and passes
it to the free slot that keeps the busy sequence ids packed, copying in the cache of a free slot that holds
a longer prefix of its prompt: engine/packing.py), and the slots' decode steps are evaluated together
(edgerun/engine/). Jobs (serve/jobs.py) start in arrival order. Each job streams its events (Step records,
then one JobResult) back to the asyncio event loop that submitted it (a step as the engine next enters
native code: engine/handoff.py). A job stops early when it is cancelled (client gone), when its deadline
passes, or when the server drains for shutdown; stopping closes the Runtime's stream, whose `finally` rolls
the KV caches back to the committed tokens.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

from ..errors import EdgerunError, InvalidArgument
from ..engine.events import JobEvents
from ..engine.packing import SeqPacking
from .jobs import ClientBusy, Job, JobResult, QueueFull, Unavailable
from .promptcache import MIN_GAIN

__all__ = ["ClientBusy", "Job", "JobEvents", "JobResult", "QueueFull", "Scheduler", "Unavailable"]

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the worker thread, the Runtime it loads, and the bounded FIFO of waiting jobs."""

    def __init__(self, load: Callable[[], Any], *, queue_limit: int = 8,
                 on_ready: Callable[[Any], None] | None = None,
                 on_load_error: Callable[[BaseException], None] | None = None,
                 on_result: Callable[[JobResult], None] | None = None, prompt_cache: Any = None) -> None:
        self.prompt_cache = prompt_cache            # serve/promptcache.PromptCache, or None
        self.history: Any = None                    # speculative/history.SuffixHistory (--suffix-history), or None
        if not isinstance(queue_limit, int) or queue_limit < 0:
            raise InvalidArgument(f"queue_limit must be an integer >= 0, got {queue_limit!r}")
        self.queue_limit = queue_limit
        self._load = load
        self._on_ready = on_ready
        self._on_load_error = on_load_error
        self._on_result = on_result
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []               # jobs the slots run, in the order they started
        self.n_slots = 1                            # generations that run at once (the Runtime's parallel)
        self.max_per_client = 0                     # requests one client may hold running + waiting (0: no cap)
        self.slots: list[Any] = []                  # the Runtime of each slot (the Runtime itself for one)
        self._draining = False
        self._stopping = False
        self._step_started: dict[int, float] = {}   # slot -> monotonic time its current blocking step began
        self._idle: set[int] = set()                # slots without a job (running or handed to them)
        self._dispatch = threading.Lock()           # held by the slot taking and placing a job
        self._handoff: dict[int, tuple] = {}        # slot -> (job, prepared prompt) another slot passed it
        self._mean_job_s = 5.0                      # running mean of job durations, for Retry-After
        self.packing = SeqPacking()                 # the slots' sequence ids, kept packed (set up with them)
        self.runtime: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="edgerun-worker", daemon=True)

    # -- state seen by the event loop ----------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> Job | None:
        """The oldest running job (None when idle); `running_jobs` lists them all."""
        running = self._running
        return running[0] if running else None

    @property
    def running_jobs(self) -> list[Job]:
        return list(self._running)

    @property
    def draining(self) -> bool:
        return self._draining

    def stuck_for(self) -> float:
        """Seconds the worker has been inside one blocking step (0 when idle)."""
        started = list(self._step_started.values())
        return 0.0 if not started else time.monotonic() - min(started)

    def retry_after(self) -> int:
        """A guess at when a slot frees: the mean job time times the jobs ahead per slot, 1..120 s."""
        ahead = len(self._waiting) + len(self._running)
        return int(min(120, max(1, math.ceil(self._mean_job_s * max(ahead, 1) / self.n_slots))))

    # -- control -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job (FIFO). Raises QueueFull or Unavailable instead of waiting."""
        with self._cond:
            if self._draining or self._stopping:
                raise Unavailable("the server is shutting down and takes no new requests")
            if self.load_error is not None:
                raise Unavailable(f"the model failed to load: {self.load_error}")
            if not self.ready.is_set():
                raise Unavailable("the model is still loading; retry shortly", retry_after=5)
            held = Counter(j.client for j in (*self._running, *self._waiting))
            cap = self.max_per_client
            if cap and held[job.client] >= cap:
                raise ClientBusy(f"this client already has {cap} requests running or waiting, the most one client "
                                 "may hold (--max-per-client); retry later", self.retry_after())
            free = max(0, self.n_slots - len(self._running))      # slots that take a job at once
            evicted = None
            if len(self._waiting) >= self.queue_limit + free:
                evicted = self._fair_victim(job.client, held)
                if evicted is None:
                    raise QueueFull(f"all {self.queue_limit} queue slots are taken and every generation slot is "
                                    f"busy; retry later", self.retry_after())
                self._waiting.remove(evicted)
            self._waiting.append(job)
            self._cond.notify_all()
            group = getattr(self.slots[0], "group", None) if len(self.slots) > 1 else None
        if evicted is not None:
            log.info("queue full: a client holding fewer requests took the place of one of client %s's",
                     evicted.client)
            evicted.request_stop("evicted")
            self._end_unstarted(evicted, "evicted")
        if group is not None:       # a slot freed by a finished job may be holding for a move (_compact):
            group.cancel_moves()    # it takes this job now instead, as it would had the job come first

    def _fair_victim(self, client: Any, held: Counter) -> "Job | None":
        """With the queue full, the newest waiting job of the client holding the most requests, if that
        client holds at least two more than `client` does: one client's flood cannot keep the others out,
        and one client alone is queued exactly as before."""
        others = [(n, c) for c, n in held.items() if c != client]
        if not others:
            return None
        n, heavy = max(others, key=lambda nc: nc[0])
        if n < held[client] + 2:
            return None
        return next((j for j in reversed(self._waiting) if j.client == heavy), None)

    def _next_job(self) -> Job:
        """The oldest waiting job of the client holding the fewest requests, running and waiting (under
        self._cond): a client admitted into a queue another client floods is served next, not after the
        flood. One client alone, or clients holding as many each, are served in arrival order as before."""
        if len(self._waiting) > 1:
            held = Counter(j.client for j in (*self._running, *self._waiting))
            best = min(self._waiting, key=lambda j: held[j.client])         # the first (oldest) of the least
            if held[best.client] < held[self._waiting[0].client]:
                self._waiting.remove(best)
                return best
        return self._waiting.popleft()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: a waiting one leaves the queue at once, a running one stops after its current step."""
        job.request_stop(reason)
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return                      # running or already finished: the worker sees the flag
        self._end_unstarted(job, reason)

    def expire(self, job: Job) -> bool:
        """End a job whose deadline passed while it waited in the queue. False if it is not waiting."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
        job.request_stop("timeout")
        self._end_unstarted(job, "timeout")
        return True

    def drain(self, grace_s: float) -> None:
        """Shutdown, first half: refuse new jobs, end the waiting ones, give the running one grace_s."""
        with self._cond:
            self._draining = True
            waiting = list(self._waiting)
            self._waiting.clear()
            running = list(self._running)
        for job in waiting:
            job.request_stop("shutdown")
            self._end_unstarted(job, "shutdown")
        for job in running:
            job.deadline_outcome = "shutdown"
            job.shorten_deadline(time.monotonic() + grace_s)

    def _end_unstarted(self, job: Job, outcome: str) -> None:
        res = JobResult(outcome=outcome, queue_wait_s=time.monotonic() - job.created)
        if self._on_result is not None:
            self._on_result(res)
        job._emit("end", res)

    def stop(self, timeout: float = 30.0) -> None:
        """Shutdown, second half: end the worker (it closes the Runtime) and wait for it."""
        self.drain(0.0)
        with self._cond:
            self._stopping = True
            running = list(self._running)
            self._cond.notify_all()
        for job in running:
            job.request_stop("shutdown")
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the generation worker did not stop within %.0f s", timeout)

    # -- the worker thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            runtime = self._load()
        except Exception as exc:          # report every load failure: the server must not hang unready
            self.load_error = exc
            log.error("loading the model failed: %s", exc, exc_info=not isinstance(exc, EdgerunError))
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        try:
            slots = runtime.slots() if getattr(runtime, "parallel", 1) > 1 else [runtime]
        except Exception as exc:
            self.load_error = exc
            log.error("setting up the generation slots failed: %s", exc)
            runtime.close()
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        if self._stopping:
            runtime.close()
            return
        self.n_slots = len(slots)
        self.slots = slots
        self.packing = SeqPacking(slots, self.prompt_cache, MIN_GAIN)
        self._idle = set(range(len(slots)))
        self.runtime = runtime
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready(runtime)
        try:
            if len(slots) == 1:
                self._serve(0, runtime)
            else:
                threads = [threading.Thread(target=self._serve, args=(i, slot), name=f"edgerun-slot-{i}",
                                            daemon=True) for i, slot in enumerate(slots)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        finally:
            self.runtime = None
            runtime.close()

    def _serve(self, slot: int, runtime: Any) -> None:
        """One slot: take the oldest waiting job, run it, repeat until the server stops."""
        while True:
            with self._cond:
                while not self._waiting and slot not in self._handoff and not self._stopping:
                    self._cond.wait()
                if slot not in self._handoff and self._stopping:
                    break
            group = getattr(runtime, "group", None)
            try:
                with self._dispatch:                # one slot at a time takes a job and places it
                    with self._cond:
                        handed = self._handoff.pop(slot, None)
                        if handed is None:
                            if not self._waiting:
                                continue            # another slot took it
                            job = self._next_job()
                            self._running.append(job)
                        self._idle.discard(slot)
                    if group is not None:           # the running sequences' next step waits for its prompt
                        group.begin_admission()
                    if handed is not None:
                        job, prepared = handed
                    else:
                        target, prepared = self._affinity(slot, runtime, job)
                        if target != slot:          # handed to the slot that holds the prompt's prefix
                            with self._cond:
                                self._idle.add(slot)
                            continue
                t0 = time.monotonic()
                try:
                    result = self._run(runtime, job, slot, prepared)
                    if result.started:
                        self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.monotonic() - t0)
                    if self._on_result is not None:
                        self._on_result(result)
                    job._emit("end", result)
                finally:
                    with self._cond:               # the slot is free once its job's end is recorded
                        self._running.remove(job)
                        self._idle.add(slot)
                        idle = not self._running and not self._waiting
                    if idle and hasattr(self.runtime, "idle"):
                        self.runtime.idle()         # nothing runs: work for long runs only may start now
                if group is not None:
                    self._compact(group)
            finally:
                if group is not None:               # a no-op once the job's decode loop has joined
                    group.end_admission()

    @staticmethod
    def _prepare(runtime: Any, job: Job) -> Any:
        """The job's Plan: prompt tokens and compiled grammar (InvalidArgument etc. on bad input)."""
        return runtime.prepare(job.request)

    def _affinity(self, slot: int, runtime: Any, job: Job) -> tuple[int, Any]:
        """(the slot to run the job on, its prepared prompt or None). Called with the dispatch lock held:
        of this slot and the free ones, the one the packing picks (engine/packing.py), with the prompt's
        longest cached prefix copied in; another slot than this one gets the job handed over."""
        if len(self.slots) == 1:
            return slot, None
        try:
            prepared = self._prepare(runtime, job)
        except Exception:                    # bad input: _run reports it
            return slot, None
        with self._cond:
            free = sorted(self._idle | {slot})
            best = self.packing.best_slot(free)
            if best != slot:
                self._idle.discard(best)
        self.packing.bring_prefix(free, best, prepared.prompt_tokens)
        if best != slot:
            with self._cond:
                self._handoff[best] = (job, prepared)
                self._cond.notify_all()
        return best, prepared

    def _compact(self, group: Any) -> None:
        """Close the gaps a finished job left in the busy sequence ids (SeqPacking.compact), not while jobs
        wait; no slot places a job meanwhile."""
        def idle_now() -> "set[int] | None":
            with self._cond:
                return None if self._waiting or self._handoff else set(self._idle)

        with self._dispatch:
            self.packing.compact(group, idle_now)

    def _history_for(self, runtime: Any, job: Job) -> Any:
        """The history bucket of the job's API key, handed to the slot's suffix drafter (None: off)."""
        drafter = runtime.drafter
        if not hasattr(drafter, "history"):
            return None
        drafter.history = None if self.history is None else \
            self.history.bucket(job.key, "none" if job.key is None else str(job.key))
        return drafter.history

    def _run(self, runtime: Any, job: Job, slot: int = 0, prepared: Any = None) -> JobResult:
        now = time.monotonic()
        res = JobResult(outcome="length", queue_wait_s=now - job.created)
        if job.stop_reason is not None:
            res.outcome = job.stop_reason
            return res
        if now >= job.deadline:
            res.outcome = "timeout"
            return res
        stream = None
        try:
            self._step_started[slot] = now
            plan = prepared if prepared is not None else self._prepare(runtime, job)
            prompt_tokens = plan.prompt_tokens
            res.n_prompt_tokens = len(prompt_tokens)
            if self.prompt_cache is not None and callable(getattr(runtime.target, "save_state", None)):
                res.n_cached = self.prompt_cache.prepare(runtime.target, prompt_tokens)
            room = runtime.n_ctx - len(prompt_tokens)
            res.max_tokens = max(0, room if job.request.max_tokens is None else min(job.request.max_tokens, room))
            bucket = self._history_for(runtime, job)
            stream = runtime.start(job.request, plan=plan, max_tokens=res.max_tokens, stats=res.stats)
            res.started = True
            stopped = False
            answer: list[int] = []

            def on_step(step) -> bool:
                # in a batching group this runs on the engine thread, between two evaluations: keep it short
                nonlocal stopped
                if bucket is not None:
                    answer.append(step.token)
                now = self._step_started[slot] = time.monotonic()
                if res.ttft_s is None:
                    res.ttft_s = now - job.created
                job._emit("step", step)
                if job.stop_reason is not None:
                    res.outcome, stopped = job.stop_reason, True
                elif now >= job.deadline:
                    res.outcome, stopped = job.deadline_outcome, True
                return not stopped

            stream.run(on_step)
            if not stopped:
                res.outcome = res.stats.finish_reason or "length"
            if bucket is not None:
                bucket.add(answer, prompt_tokens)
        except EdgerunError as exc:
            res.outcome, res.error = "error", exc
        except Exception as exc:          # a bug or an engine failure: report it, keep serving
            log.exception("generation failed")
            res.outcome, res.error = "error", exc
        finally:
            self._step_started.pop(slot, None)
            if stream is not None:
                stream.close()               # the decode loop's finally rolls the caches back
        res.n_tokens = res.stats.n_tokens
        return res
