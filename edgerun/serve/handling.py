"""What every generation route does with a request, for the OpenAI routes (app.py) and Ollama's
(ollama/) alike: read and bound its body, check it fits, vet its grammar off the worker, queue its job
and read the job's events back to the event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..errors import ContextOverflow, InvalidArgument
from ..request import Structure
from .jobs import ClientBusy, Job, JobResult, QueueFull, Unavailable
from .protocol import FAILED, APIError, error_from_result, parse_body
from .scheduler import Scheduler

log = logging.getLogger(__name__)


async def start_job(state, request: Request, job: Job, *, chat: bool) -> tuple[tuple[str, Any], asyncio.Task]:
    """Queue a job (503 when the queue is full or the model is not ready), watch its client, and wait for its
    first event; a job that ends before any token raises its error. Returns (first event, disconnect watcher);
    the caller hands both to its answer or calls release_job. Shared by the OpenAI and Ollama routes."""
    job.key = request.scope.get("edgerun.key")     # set by the API-key check (gate.py)
    try:
        state.scheduler.submit(job)
    except ClientBusy as e:
        raise APIError(429, str(e), code="too_many_requests",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except QueueFull as e:
        raise APIError(503, str(e), type="server_error", code="queue_full",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except Unavailable as e:
        raise APIError(503, str(e), type="server_error", code="unavailable",
                       headers={"Retry-After": str(e.retry_after or 5)}) from None
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.scheduler, job))
    try:
        first = await _next_event(state, job)
        if first[0] == "end" and (not first[1].started or first[1].outcome in FAILED):
            raise error_from_result(first[1], state.config.timeout_s, chat)   # nothing sent yet: a plain error
    except BaseException:
        release_job(state, job, watcher)
        raise
    return first, watcher


def release_job(state, job: Job, watcher: asyncio.Task) -> None:
    """Stop watching a job's client and cancel the job unless it has ended."""
    watcher.cancel()
    job.events.close()
    if not job.finished:
        state.scheduler.cancel(job)


def check_turns(state, n_messages: int) -> None:
    """Every turn takes a token at least: more messages than the context has positions are refused before
    the chat template renders them (10,001 turns cost the worker 1.4 s)."""
    n_ctx = getattr(state.scheduler.runtime, "n_ctx", None)
    if n_ctx and n_messages > n_ctx:
        raise APIError(400, f"the conversation has {n_messages} messages, more than the {n_ctx} tokens the context "
                            "holds (every message takes at least one)", param="messages",
                       code="context_length_exceeded")


async def vet_structure(state, options: dict) -> Structure:
    """A request's structure options parsed and its grammar checked on a thread of its own (limits, then a
    sandboxed compile: see constrain/sandbox.py) before it is queued: a bad one is a 400 and never reaches
    the worker. Returns the Structure, bound to the model's vocabulary once the model is loaded."""
    if not options:
        return Structure()
    vet = getattr(state.scheduler.runtime, "vet_structure", None)

    def parse_and_vet() -> Structure:
        structure = Structure.parse(**options)
        return vet(structure) if structure and vet is not None else structure

    try:
        return await asyncio.get_running_loop().run_in_executor(state.vetting, parse_and_vet)
    except InvalidArgument as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _check_fits(state, n_bytes: int, *, chat: bool) -> None:
    """A prompt too long to fit the context whatever its tokens: 400 here, before it takes a queue slot
    (its tokenization would hold the one worker)."""
    runtime = state.scheduler.runtime
    check = getattr(getattr(runtime, "tokenizer", None), "check_fits", None)
    if check is None:
        return
    try:
        check(n_bytes, runtime.n_ctx)
    except ContextOverflow as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None


def _require_ready(state) -> None:
    sch = state.scheduler
    if sch.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5"})
    if sch.load_error is not None:
        raise APIError(503, f"the model failed to load: {sch.load_error}", type="server_error",
                       code="model_load_failed")
    if not sch.ready.is_set():
        raise APIError(503, f"the model {state.model_id} is still loading; retry shortly", type="server_error",
                       code="model_loading", headers={"Retry-After": "5"})


async def _read_json(request, limit: int) -> Any:
    """The request body parsed as JSON, refusing bodies over `limit` bytes (413), bodies not declared as
    JSON (415: a web form or text/plain, which browsers send cross-site without asking) and bad JSON (400)."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, f"the body must be sent as Content-Type: application/json, got {ctype or 'none'!r:.60}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length {declared!r} is not a number", code="invalid_request")
        if int(declared) > limit:
            raise APIError(413, f"request body is {int(declared)} bytes; the limit is {limit}",
                           code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection while sending the request",
                       code="client_closed_request") from None
    return parse_body(b"".join(chunks))


async def _next_event(state, job: Job) -> tuple[str, Any]:
    """The job's next event. A job still queued at its deadline leaves the queue (503); a running one
    is stopped by the worker at its next step; one stuck longer than the deadline + slack gets 504."""
    event = _ready_event(job)                 # the worker is ahead of the client: no timer, no task
    return event if event is not None else _taken(job, await _wait_event(state, job))


def _ready_event(job: Job) -> tuple[str, Any] | None:
    """The job's next event if it has come, else None (no waiting)."""
    try:
        return _taken(job, job.events.get_nowait())
    except asyncio.QueueEmpty:
        return None


def _taken(job: Job, event: tuple[str, Any]) -> tuple[str, Any]:
    """An event the loop has read: the end marks the job finished."""
    if event[0] == "end":
        job.finished = True
    return event


async def _wait_event(state, job: Job) -> tuple[str, Any]:
    slack = 60.0 + state.config.shutdown_grace_s
    while True:
        now = time.monotonic()
        until = job.deadline + 0.01 if now < job.deadline else job.deadline + slack
        if until <= now:
            state.scheduler.cancel(job, "timeout")
            raise APIError(504, "generation stalled past the request's time limit", type="server_error",
                           code="timeout")
        try:
            event = await job.events.get_until(until)
        except asyncio.TimeoutError:
            state.scheduler.expire(job)      # queued past the deadline: its end event follows
            continue
        return event


async def _cancel_on_disconnect(request, scheduler: Scheduler, job: Job) -> None:
    """Cancel the job when the client goes away (the body is read, so the next message is a disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("client disconnected; cancelling its generation")
            scheduler.cancel(job)
            return


def _edgerun_field(state, res: JobResult) -> dict:
    st = res.stats
    return {
        "finish": res.outcome if res.outcome != "timeout" else "time_limit",
        "max_tokens": res.max_tokens,
        "queue_wait_s": round(res.queue_wait_s, 6),
        "ttft_s": None if res.ttft_s is None else round(res.ttft_s, 6),
        "t_prefill_s": round(st.t_prefill_s, 6),
        "t_total_s": round(st.t_total_s, 6),
        "tokens_per_s": round(st.tokens_per_s, 3),
        "drafter": getattr(state.scheduler.runtime, "draft_name", None),
        "n_cycles": st.n_cycles,
        "n_drafted": st.n_drafted,
        "n_accepted": st.n_accepted,
        "acceptance_rate": round(st.acceptance_rate, 6),
        "mean_accepted_per_cycle": round(st.mean_accepted_per_cycle, 6),
        "gamma_mean": round(st.gamma_mean, 6),
        "accept_histogram": list(st.accept_histogram),
    }
