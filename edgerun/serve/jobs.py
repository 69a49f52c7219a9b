"""A generation request as the scheduler queues it (Job), how it ended (JobResult), and the refusals a full
or unready server answers with (QueueFull, ClientBusy, Unavailable). serve/scheduler.py runs the jobs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..engine import handoff
from ..engine.events import JobEvents
from ..errors import EdgerunError
from ..generate import GenStats
from ..request import Request

log = logging.getLogger(__name__)


class QueueFull(EdgerunError):
    """Every queue slot is taken; the caller should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClientBusy(QueueFull):
    """One client already holds as many running and waiting requests as one client may."""


class Unavailable(EdgerunError):
    """The worker cannot take jobs: models still loading, loading failed, or shutting down."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class JobResult:
    """How a job ended. outcome: stop | eos | length (normal ends), timeout (time limit reached after
    it started: a normal end too, the text is what was generated), cancelled, shutdown, error."""

    outcome: str
    n_prompt_tokens: int = 0
    n_cached: int = 0               # prompt positions restored from the prompt cache (not evaluated)
    n_tokens: int = 0
    max_tokens: int = 0
    stats: GenStats = field(default_factory=GenStats)
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    error: BaseException | None = None
    started: bool = False

    @property
    def finish_reason(self) -> str:
        """The OpenAI finish_reason: 'length' also covers the server's time limit."""
        return {"eos": "stop", "stop": "stop"}.get(self.outcome, "length")


class Job:
    """One generation request. Created and awaited on the event loop; run on the worker thread."""

    key: int | None = None      # which API key it came with (1, 2, ...; None: a keyless server): its history

    def __init__(self, request: Request, *, timeout_s: float = 300.0, client: Any = None) -> None:
        self.request = request                     # what to generate (checked at the edge: edgerun/request.py)
        self.finished = False                      # set by the event loop once it read the end event
        self.client = client                       # who asked (serve/clients.py): the per-client cap's key
        self.created = time.monotonic()
        self.deadline = self.created + timeout_s
        self.events = JobEvents(asyncio.get_running_loop())
        self._stop_reason: str | None = None       # set once: cancelled | shutdown
        self.deadline_outcome = "timeout"          # how reaching the deadline is reported
        self._stop_lock = threading.Lock()

    # -- called from any thread ----------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        with self._stop_lock:
            if self._stop_reason is None:
                self._stop_reason = reason

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def shorten_deadline(self, deadline: float) -> None:
        self.deadline = min(self.deadline, deadline)

    def _emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the job's event loop. A step goes when the engine next enters native code
        (engine/handoff.py: the event loop's Python per token then runs beside the evaluation, not between
        two); the end goes at once, after every step deferred before it."""
        if kind == "step":
            handoff.defer(partial(self._post, kind, payload))
            return
        handoff.flush()
        self._post(kind, payload)

    def _post(self, kind: str, payload: Any) -> None:
        try:
            self.events.put((kind, payload))
        except RuntimeError:          # the event loop is closed: nobody is listening any more
            log.debug("dropped %s event of a job whose event loop is closed", kind)
