"""The ASGI application: routes, server-sent events, the API-key gate, the watchdog ping.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health (200 only once the
models are loaded), GET /metrics (Prometheus text).

Generation runs on one worker thread fed by a bounded FIFO queue (edgerun.serve.scheduler). The socket
is bound first and the models load in the background, so /health answers 503 meanwhile; systemd
hears READY=1 once they are loaded. A client that disconnects cancels its generation; every
request has a server-side time limit; SIGTERM drains (no new work, the running stream gets a grace
period) and the process exits 0. Errors are OpenAI-shaped JSON: {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import logging
import math
import secrets
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import GenerationRecord, Metrics
from . import ollama, promptcache, ui
from .clients import client_key
from .handling import (_cancel_on_disconnect, _check_fits, _edgerun_field, _next_event, _read_json, _ready_event,
                       _require_ready, _taken, _vet, check_turns, release_job, start_job)
from .scheduler import ClientBusy, Job, JobResult, QueueFull, Scheduler, Unavailable
from . import systemd as service
from ..constrain.tools import ToolCallStream, parse_tool_calls
from ..errors import ContextOverflow, EdgerunError, InvalidArgument
from .protocol import (FAILED, APIError, ChatRequest, CompletionRequest, chat_message, error_from_result,
                       max_tokens_from, parse_body, reject_unsupported, sampling_from, sse_data, sse_framer,
                       stop_from, structure_from, usage, validate)
from .settings import ServerConfig


log = logging.getLogger(__name__)


# --- the application -----------------------------------------------------------------------------

class _State:
    """Everything the handlers share. Lives on app.state.edgerun."""

    def __init__(self, config: ServerConfig, load: Callable[[], Any], request_exit: Callable[[], None]) -> None:
        self.config = config
        self.metrics = Metrics(model=config.model)
        self.request_exit = request_exit
        cache = promptcache.sized(config.prompt_cache_mib)
        self.scheduler = Scheduler(load, queue_limit=config.queue, on_ready=self._on_ready,
                                   on_load_error=self._on_load_error, on_result=self._on_result, prompt_cache=cache)
        self.scheduler.max_per_client = config.max_per_client
        # grammars are vetted on one thread of their own (constrain/sandbox.py): one child at a time, and
        # one malloc arena instead of one per pool thread
        self.vetting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgerun-vet")
        self.model_names: set[str] = {config.model}
        if "/" in config.model or config.model.endswith(".gguf"):
            self.model_names.add(Path(config.model).name)
            self.model_names.add(Path(config.model).stem)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self.bound: tuple[str, int] | None = None     # where the watchdog's self-probe connects (run.py sets it)
        self.integrity: dict[str, str] = {}      # registry model -> checking | ok | corrupt (pinned sha256)
        self.lost_worker: str | None = None      # set when an RPC worker of a split model is gone (fatal)
        self.open_paths: set[str] = {"/health"}  # answered without the API key (ui.py adds the page's files)

    @property
    def model_id(self) -> str:
        return self.config.model

    # worker-thread callbacks
    def _on_ready(self, runtime) -> None:
        tok = getattr(runtime, "tokenizer", None)
        if hasattr(tok, "max_token_bytes"):
            tok.max_token_bytes          # computed once here (worker thread), not in a request handler
        log.info("model %s loaded (drafter: %s); ready", self.config.model, getattr(runtime, "draft_name", None))
        if runtime.drafter is None:
            self.metrics.observe_gamma(0)
        service.notify("READY=1", f"STATUS=serving {self.config.model} on {self.config.host}:{self.config.port}")
        threading.Thread(target=self._verify_models, args=(getattr(runtime, "draft_name", None),),
                         name="edgerun-verify", daemon=True).start()
        if getattr(runtime, "cluster", None) is not None:
            threading.Thread(target=self._watch_workers, args=(runtime.cluster,), name="edgerun-workers",
                             daemon=True).start()

    def _watch_workers(self, cluster, interval: float = 0.5) -> None:
        """An idle server notices a lost RPC worker too: /health answers 503 `worker_lost`, the error names
        the worker, and the server exits non-zero (a generation that meets the dead worker ends the process
        at once through the abort hook, _exit_lost_worker)."""
        from ..cluster.rpc import describe_loss

        while not cluster.lost():
            time.sleep(interval)
        self.lost_worker = describe_loss(cluster.endpoints)
        log.error("%s; stopping (systemd restarts the service)", self.lost_worker)
        service.notify(f"STATUS={self.lost_worker}")
        time.sleep(1.0)                       # load balancers see the 503 before the socket closes
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.request_exit)

    def _verify_models(self, draft_name: str | None) -> None:
        """After a load, re-hash the cached registry files against their pinned sha256 (same-size
        corruption, e.g. SD-card bit rot, passes every load check). A mismatch is logged as an error
        and /health answers 503 `corrupt_model`: the answers of a corrupt file are garbage."""
        from ..registry.fetch import verify_cached
        from ..registry.manifest import get_manifest

        for name in (self.config.model, draft_name):
            if not name or "@" in name or name in ("auto", "none", "lookup", "suffix"):
                continue
            try:
                get_manifest(name)
            except EdgerunError:
                continue                         # a path: nothing pins its content
            self.integrity[name] = "checking"
            try:
                ok = verify_cached(name)
            except OSError as e:
                log.error("could not re-read the cached model %s: %s", name, e)
                ok = False
            self.integrity[name] = "ok" if ok else "corrupt"
            if ok:
                log.info("cached model %s matches its pinned sha256", name)
            else:
                log.error("CACHED MODEL %s IS CORRUPT: its file no longer matches the sha256 its manifest pins; "
                          "answers are unreliable. Run `edgerun pull %s --verify` and restart the service.",
                          name, name)
                service.notify(f"STATUS=corrupt model file: {name} (edgerun pull {name} --verify)")

    def _on_load_error(self, exc: BaseException) -> None:
        service.notify(f"STATUS=failed to load the model: {exc}")
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.request_exit)

    def _on_result(self, res: JobResult) -> None:
        st = res.stats
        self.metrics.record_generation(GenerationRecord(
            n_prompt_tokens=res.n_prompt_tokens, n_tokens=res.n_tokens,
            t_decode_s=max(0.0, st.t_total_s - st.t_prefill_s), n_drafted=st.n_drafted,
            n_accepted=st.n_accepted, gamma_mean=st.gamma_mean if st.n_cycles else None, ttft_s=res.ttft_s,
            outcome=res.outcome))

    # event-loop side
    def begin_drain(self) -> None:
        if not self.scheduler.draining:
            log.info("shutting down: no new requests; the running one has %.0f s to finish",
                     self.config.shutdown_grace_s)
            service.notify("STOPPING=1", "STATUS=shutting down")
        self.scheduler.drain(self.config.shutdown_grace_s)

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def create_app(config: ServerConfig, *, load: Callable[[], Any] | None = None,
               request_exit: Callable[[], None] | None = None):
    """The ASGI app. `load` returns a Runtime (default: edgerun.runtime.load with the config's options);
    `request_exit` stops the HTTP server (called when loading fails)."""
    load = load or default_loader(config)
    state = _State(config, load, request_exit or (lambda: None))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        service.notify(f"STATUS=loading {config.model}")
        state.scheduler.start()
        watchdog = asyncio.create_task(_watchdog(state))
        try:
            yield
        finally:
            watchdog.cancel()
            state.vetting.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(state.scheduler.stop, 30.0)

    app = FastAPI(title="edgerun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.edgerun = state

    # -- error shapes ------------------------------------------------------------------------
    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error (logged on the server)", type="server_error",
                                       code="internal_error"))

    # -- auth and per-endpoint counts (plain ASGI: keeps streaming and disconnects untouched) --
    app.add_middleware(_Gate, state=state)

    # -- plain endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        sch = state.scheduler
        if state.lost_worker is not None:
            body, status = {"status": "worker_lost", "error": state.lost_worker}, 503
        elif sch.draining:
            body, status = {"status": "shutting_down"}, 503
        elif sch.load_error is not None:
            body, status = {"status": "error", "error": str(sch.load_error)}, 503
        elif not sch.ready.is_set():
            body, status = {"status": "loading", "model": state.model_id}, 503
        elif "corrupt" in state.integrity.values():
            body, status = {"status": "corrupt_model", "model": state.model_id, "integrity": state.integrity}, 503
        else:
            body, status = {"status": "ok", "model": state.model_id, "queue_depth": sch.depth, "busy": sch.busy,
                            "integrity": state.integrity}, 200
            body["gpu"] = _gpu_dict(sch.runtime)         # where the target's layers run (device/gpu.py)
        headers = {"Retry-After": "5"} if status == 503 else {}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/metrics")
    async def metrics():
        sch = state.scheduler
        group = getattr(sch.slots[0], "group", None) if sch.slots else None
        pc = sch.prompt_cache
        text = state.metrics.render(queue_depth=sch.depth, queue_limit=sch.queue_limit, busy=sch.busy,
                                    ready=sch.ready.is_set() and not sch.draining, slots=sch.n_slots,
                                    running=len(sch.running_jobs),
                                    batch=(group.n_steps, group.n_rows, group.eval_s, group.n_moves) if group is not None
                                    else (0, 0, 0.0, 0),
                                    prompt_cache=(pc.hits, pc.saved_positions, pc.nbytes, len(pc)) if pc is not None
                                    else (0, 0, 0, 0),
                                    gpu=_gpu_dict(sch.runtime))
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        _require_ready(state)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "edgerun"}]}

    # -- generation --------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = validate(ChatRequest, await _read_json(request, config.max_body_bytes))
        _require_ready(state)
        state.check_model(req.model)
        reject_unsupported(req)
        if not req.messages:
            raise APIError(400, "'messages' must hold at least one message", param="messages", code="invalid_value")
        check_turns(state, len(req.messages))
        messages = [chat_message(m) for m in req.messages]
        _check_fits(state, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), chat=True)
        mt = max_tokens_from(req.max_tokens, "max_tokens")
        if req.max_completion_tokens is not None:
            mt = max_tokens_from(req.max_completion_tokens, "max_completion_tokens")
        structure, tools, choice = structure_from(req, chat=True)
        await _vet(state, structure)
        job = Job(messages=messages, max_tokens=mt, stop=stop_from(req), sampling=sampling_from(req),
                  timeout_s=config.timeout_s, structure=structure, client=client_key(request.scope, config))
        return await _respond(state, request, req, job, chat=True, tools=tools if choice.mode != "none" else [])

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = validate(CompletionRequest, await _read_json(request, config.max_body_bytes))
        _require_ready(state)
        state.check_model(req.model)
        reject_unsupported(req)
        prompt = req.prompt
        tokens = None
        if isinstance(prompt, list):
            if not prompt:
                raise APIError(400, "'prompt' must not be an empty list", param="prompt", code="invalid_value")
            if all(isinstance(x, int) for x in prompt):
                tokens, prompt = list(prompt), None
            elif len(prompt) == 1:
                prompt = prompt[0]
            else:
                raise APIError(400, f"'prompt' must be one string or one list of token ids; batches of "
                                    f"{len(prompt)} prompts are not supported", param="prompt",
                               code="unsupported_parameter")
        if isinstance(prompt, str):
            _check_fits(state, len(prompt.encode("utf-8", "surrogatepass")), chat=False)
        structure, _, _ = structure_from(req, chat=False)
        await _vet(state, structure)
        job = Job(prompt=prompt, prompt_tokens=tokens, max_tokens=max_tokens_from(req.max_tokens, "max_tokens"),
                  stop=stop_from(req), sampling=sampling_from(req), timeout_s=config.timeout_s, structure=structure,
                  client=client_key(request.scope, config))
        return await _respond(state, request, req, job, chat=False)

    async def _respond(state: _State, request: Request, req, job: Job, *, chat: bool, tools=()):
        # the loop is woken for a streamed token at most once per --stream-interval (the tokens between
        # go out together); an answer that is not streamed needs only the end
        job.events.hold_s = config.stream_interval_ms / 1000 if req.stream else math.inf
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        first, watcher = await start_job(state, request, job, chat=chat)
        handed_over = False
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                handed_over = True            # _sse now owns the job and the disconnect watcher
                return StreamingResponse(
                    _sse(state, job, first, watcher, ident=ident, chat=chat, include_usage=include_usage,
                         tools=tools),
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            texts: list[str] = []
            event = first
            while event[0] == "step":
                texts.append(event[1].text)
                event = await _next_event(state, job)
            res: JobResult = event[1]
            if res.outcome in FAILED:
                raise error_from_result(res, config.timeout_s, chat)
            return _full_response(state, ident, chat, "".join(texts), res, tools)
        finally:
            if not handed_over:
                release_job(state, job, watcher)

    ollama.install(app, state)
    ui.install(app, state)
    return app


def _gpu_dict(runtime) -> dict | None:
    gpu = getattr(runtime, "gpu", None)
    return gpu.to_dict() if gpu is not None else None


def default_loader(config: ServerConfig) -> Callable[[], Any]:
    def load():
        from ..runtime import load as load_runtime

        opts = {k: v for k, v in dict(n_ctx=config.n_ctx, n_threads=config.n_threads, gamma=config.gamma).items()
                if v is not None}
        opts["parallel"] = config.parallel          # None: the device profile's
        opts["require_gpu"] = config.require_gpu
        if config.rpc:
            opts.update(rpc=list(config.rpc), tensor_split=list(config.tensor_split) or None,
                        on_lost_worker=_exit_lost_worker)
        opts.update(config.load_opts)
        return load_runtime(config.model, draft=config.draft, profile=config.profile, pull=config.pull, **opts)
    return load


EXIT_LOST_WORKER = 3


def _exit_lost_worker(endpoints, msg: str = "") -> None:
    """The abort hook of a server whose target is split over RPC workers: ggml met a dead worker in the
    middle of a step and cannot continue. Log the worker's name and exit (systemd's Restart= brings the
    service back; its start-up check waits for the worker)."""
    import os

    from ..cluster.rpc import describe_loss

    text = describe_loss(endpoints, msg)
    log.error("%s; exiting with status %d (systemd restarts the service)", text, EXIT_LOST_WORKER)
    service.notify(f"STATUS={text}")
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(EXIT_LOST_WORKER)


class _Gate:
    """ASGI middleware: refuses requests without the API key (401) and counts answers by endpoint."""

    def __init__(self, app, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = self.state.metrics.endpoint_of(path)
        metrics = self.state.metrics

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                metrics.count_request(endpoint, message["status"])
            await send(message)

        config = self.state.config
        headers = {k: v for k, v in scope.get("headers", ())}
        refused = _browser_refusal(config, headers)
        if refused is not None:
            await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, counting_send)
            return
        origin = headers.get(b"origin", b"").decode("latin-1")
        if origin:                                   # an allowed browser origin: CORS headers on the answer
            inner = counting_send

            async def counting_send(message) -> None:            # noqa: F811 - wraps the counter
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
                await inner(message)

            if scope.get("method") == "OPTIONS":               # a preflight: answered here, before the key
                await Response(status_code=204)(scope, receive, counting_send)
                return
        key = config.api_key
        if key is not None and path not in self.state.open_paths and not _authorized(scope, key):
            err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await JSONResponse(err.body(), status_code=401, headers=err.headers)(scope, receive, counting_send)
            return
        await self.app(scope, receive, counting_send)


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def _browser_refusal(config, headers: dict) -> APIError | None:
    """Requests a web page (not the board's user) could have made: a Host that is not this server's
    loopback name (DNS rebinding) or an Origin that is not allowed (cross-site requests)."""
    from .settings import is_loopback, is_loopback_address

    if is_loopback(config.host):
        host = headers.get(b"host", b"").decode("latin-1").strip().lower()
        name = host[: host.rindex("]") + 1] if host.startswith("[") else host.split(":", 1)[0]
        allowed = _LOOPBACK_NAMES | {h.lower() for h in config.allowed_hosts} | {config.host}
        if host and name not in allowed and not is_loopback_address(name):
            return APIError(403, f"Host {name!r:.60} is not this server's name (a web page using DNS rebinding?); "
                                 "allow it with --allow-host / EDGERUN_ALLOW_HOST", code="host_not_allowed")
    origin = headers.get(b"origin", b"").decode("latin-1").strip()
    # the server's own page (ui.py) is same-origin: its Host passed the check above, or the API key guards it
    own = origin.lower() == "http://" + headers.get(b"host", b"").decode("latin-1").strip().lower() and \
        (is_loopback(config.host) or config.api_key is not None)
    if origin and not own and origin not in config.cors_origins and "*" not in config.cors_origins:
        return APIError(403, f"requests from the web page at {origin!r:.80} are not allowed; allow its origin with "
                             "--cors-origin / EDGERUN_CORS_ORIGIN", code="origin_not_allowed")
    return None


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"access-control-max-age", b"600")]


def _authorized(scope, key: str) -> bool:
    header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        token = b""
    return hmac.compare_digest(token.strip(), key.encode("utf-8"))


def _full_response(state: _State, ident: str, chat: bool, text: str, res: JobResult, tools=()) -> dict:
    base = {"id": ident, "created": int(time.time()), "model": state.model_id, "system_fingerprint": None}
    if chat:
        message: dict = {"role": "assistant", "content": text}
        finish = res.finish_reason
        if tools:
            content, calls = parse_tool_calls(text, tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish != "length" else finish
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage(res),
                "edgerun": _edgerun_field(state, res)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": res.finish_reason}
    return {**base, "object": "text_completion", "choices": [choice], "usage": usage(res),
            "edgerun": _edgerun_field(state, res)}


def _tool_delta(event: tuple) -> dict:
    """A ToolCallStream event as a chat.completion.chunk delta, in OpenAI's shape."""
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "call":
        _, index, ident, name = event
        return {"tool_calls": [{"index": index, "id": ident, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


_TEXT_MARK = "\ue000edgerun-text\ue000"       # stands for a token's text in a pre-serialised chunk (sse_framer)


async def _sse(state: _State, job: Job, first: tuple[str, Any], watcher: asyncio.Task, *, ident: str,
               chat: bool, include_usage: bool, tools=()) -> AsyncIterator[bytes]:
    """Server-sent events of one generation. The watcher cancels the job as soon as the client goes
    away, even while this generator is suspended; closing the generator cancels it too."""
    created = int(time.time())
    base = {"id": ident, "created": created, "model": state.model_id, "system_fingerprint": None}

    reader = ToolCallStream(tools) if (chat and tools) else None

    def delta_chunk(delta: dict) -> dict:
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

    def chunk(text: str | None, finish: str | None, **extra) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            return {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}], **extra}

    text_chunk = sse_framer(chunk(_TEXT_MARK, None), _TEXT_MARK)      # chunk(text, None), serialised once

    try:
        if chat:
            yield sse_data({**base, "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
        event = first
        while event[0] == "step":
            # every step that has come goes out in one write (one ASGI message, one send): held steps
            # (JobEvents.hold_s, --stream-interval) arrive together; each is still its own SSE event
            parts: list[bytes] = []
            while event is not None and event[0] == "step":
                if reader is not None:
                    parts.extend(sse_data(delta_chunk(_tool_delta(ev))) for ev in reader.feed(event[1].text))
                elif event[1].text:
                    parts.append(text_chunk(event[1].text))
                event = _ready_event(job)
            if parts:
                yield b"".join(parts)
            if event is None:
                try:
                    event = await _next_event(state, job)
                except APIError as err:
                    yield sse_data(err.body())
                    yield b"data: [DONE]\n\n"
                    return
        res: JobResult = event[1]
        if res.outcome in FAILED:
            yield sse_data(error_from_result(res, state.config.timeout_s, chat).body())
        else:
            finish = res.finish_reason
            if reader is not None:
                for ev in reader.finish():
                    yield sse_data(delta_chunk(_tool_delta(ev)))
                if reader.calls and finish != "length":
                    finish = "tool_calls"
            yield sse_data(chunk(None, finish, edgerun=_edgerun_field(state, res)))
            if include_usage:
                usage_chunk = {**base, "object": "chat.completion.chunk" if chat else "text_completion",
                               "choices": [], "usage": usage(res)}
                yield sse_data(usage_chunk)
        yield b"data: [DONE]\n\n"
    finally:
        watcher.cancel()
        job.events.close()
        if not job.finished:
            state.scheduler.cancel(job)


async def _watchdog(state: _State) -> None:
    """WATCHDOG=1 at half of WatchdogSec while the event loop runs, the worker is not stuck in one step
    longer than the request time limit (+60 s) and the server's own socket answers HTTP (two misses in a
    row withhold it); systemd then restarts the service."""
    interval = service.watchdog_interval()
    if interval is None:
        return
    limit = state.config.timeout_s + 60.0
    failures = 0
    while True:
        stuck = state.scheduler.stuck_for()
        answering = state.bound is None or await http_answers(*state.bound, timeout=min(5.0, interval))
        failures = 0 if answering else failures + 1
        if stuck > limit:
            log.error("the generation worker has been inside one step for %.0f s; withholding the watchdog "
                      "ping so systemd restarts the service", stuck)
        elif failures >= 2:
            log.error("the server's own HTTP socket has not answered /health %d times in a row; withholding the "
                      "watchdog ping so systemd restarts the service", failures)
        else:
            service.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def http_answers(host: str, port: int, timeout: float = 5.0) -> bool:
    """Whether an HTTP server answers GET /health on host:port within `timeout` (any status counts: the
    question is whether requests get answers at all). The watchdog asks its own socket."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.startswith(b"HTTP/1.")
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
