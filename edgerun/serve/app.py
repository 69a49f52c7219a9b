"""The ASGI application: error shapes, GET /health (200 only once the models are loaded), GET /metrics
(Prometheus text), GET /v1/models, and the systemd watchdog ping. The rooms around it: the OpenAI routes
(openai.py), Ollama's (ollama.py), the page (ui.py), the gate every request passes (gate.py), the state
the handlers share and the model loader (state.py), what every generation route does (handling.py).

Generation runs on worker threads fed by a bounded queue (scheduler.py). The socket is bound first and the
models load in the background, so /health answers 503 meanwhile; systemd hears READY=1 once they are
loaded. A client that disconnects cancels its generation; every request has a server-side time limit;
SIGTERM drains (no new work, the running stream gets a grace period) and the process exits 0. Errors are
OpenAI-shaped JSON: {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import ollama, openai, ui
from . import systemd as service
from .gate import _Gate
from .handling import _require_ready
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .protocol import APIError
from .settings import ServerConfig
from .loading import default_loader
from .state import _State, _drafter_dict, _gpu_dict

log = logging.getLogger(__name__)


# --- the application -----------------------------------------------------------------------------

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

    _install_error_shapes(app)

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
            body["drafter"] = _drafter_dict(sch.runtime)   # loaded, or loading / deferred (speculative/lazy.py)
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
                                    gpu=_gpu_dict(sch.runtime),
                                    suffix_history=sch.history.stats() if sch.history is not None else None)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        _require_ready(state)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "edgerun"}]}

    openai.install(app, state)
    ollama.install(app, state)
    ui.install(app, state)
    return app


def _install_error_shapes(app) -> None:
    """Every error answers OpenAI-shaped JSON; an unexpected one is logged and answers 500 without details."""
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
