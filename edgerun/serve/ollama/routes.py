"""The /api/* routes: one module-level handler per route, taking the app's state and the request, wired to
the app by install()."""

from __future__ import annotations

import time

from fastapi import Request

from ...version import __version__
from .. import handling
from ..protocol import APIError, validate
from . import facts
from .errors import UNSUPPORTED, OllamaErrors, unsupported
from .pull import pull as pull_model
from .shape import answer, loaded
from .translate import (ChatBody, GenerateBody, NameBody, check_model, job_of, message_of, note_rest, parts_of)

# The Ollama release whose API this package follows; /api/version answers it (clients gate features on it).
OLLAMA_API_VERSION = "0.6.0"


async def _body(state, request: Request, cls):
    return validate(cls, await handling._read_json(request, state.config.max_body_bytes))


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


async def chat(state, request: Request):
    t0 = time.monotonic()
    req = await _body(state, request, ChatBody)
    check_model(state, req.model)
    handling._require_ready(state)
    if not req.messages:                         # Ollama: an empty chat loads the model (or unloads it)
        return loaded(req, chat=True)
    notes: list[str] = []
    handling.check_turns(state, len(req.messages))
    messages = [message_of(m, i) for i, m in enumerate(req.messages)]
    handling._check_fits(state, sum(_utf8_len(m["content"]) for m in messages), chat=True)
    parts = await parts_of(state, req, notes, chat=True)
    note_rest(req, notes)
    job = job_of(state, request, parts, messages=messages)
    return await answer(state, request, req, job, chat=True, tools=parts.tools, notes=notes, t0=t0)


async def generate(state, request: Request):
    t0 = time.monotonic()
    req = await _body(state, request, GenerateBody)
    check_model(state, req.model)
    if req.images:
        raise APIError(400, "images are not supported: the served model reads text only", param="images")
    if req.suffix:
        raise APIError(400, "suffix (fill in the middle) is not supported by this server", param="suffix")
    if req.context:
        raise APIError(400, "context is not supported (this server returns none): send the conversation to "
                            "/api/chat instead", param="context")
    handling._require_ready(state)
    if not req.prompt and not req.system:
        return loaded(req, chat=False)
    notes: list[str] = []
    parts = await parts_of(state, req, notes, chat=False)
    note_rest(req, notes)
    if req.template:
        notes.append("template ignored (the model's own chat template is used)")
    if req.raw:
        handling._check_fits(state, _utf8_len(req.prompt or ""), chat=False)
        job = job_of(state, request, parts, prompt=req.prompt or "")
    else:
        # chat templating is how the prompt gets the model's template; structure applies to the answer
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                   [{"role": "user", "content": req.prompt or ""}]
        handling._check_fits(state, sum(_utf8_len(m["content"]) for m in messages), chat=True)
        job = job_of(state, request, parts, messages=messages)
    return await answer(state, request, req, job, chat=False, tools=[], notes=notes, t0=t0)


async def tags(state, request: Request):
    handling._require_ready(state)
    return {"models": [facts.model_entry(state)]}


async def ps(state, request: Request):
    handling._require_ready(state)
    return {"models": [facts.running_entry(state)]}


async def show(state, request: Request):
    req = await _body(state, request, NameBody)
    check_model(state, req.model or req.name)
    handling._require_ready(state)
    return facts.show(state)


async def version(state, request: Request):
    return {"version": OLLAMA_API_VERSION, "edgerun": __version__}


async def pull(state, request: Request):
    req = await _body(state, request, NameBody)
    name = req.model or req.name
    if not state.config.allow_pull:
        raise APIError(403, "pulling models is turned off on this server (it writes to disk); start it with "
                            "--allow-pull / EDGERUN_ALLOW_PULL=1, or run `edgerun pull` on the board",
                       code="pull_disabled")
    if not name:
        raise APIError(400, "model is required", param="model")
    return await pull_model(name[: -len(":latest")] if name.endswith(":latest") else name, req.stream)


# (method, path, handler) of every route this package serves
ROUTES = (("POST", "/api/chat", chat), ("POST", "/api/generate", generate), ("GET", "/api/tags", tags),
          ("GET", "/api/ps", ps), ("POST", "/api/show", show), ("GET", "/api/version", version),
          ("POST", "/api/pull", pull))


def _bound(handler, state):
    async def endpoint(request: Request):
        return await handler(state, request)
    endpoint.__name__ = handler.__name__
    return endpoint


def install(app, state) -> None:
    """Register the /api/* routes and the error reshaper on the app (create_app calls this)."""
    for method, path, handler in ROUTES:
        app.add_api_route(path, _bound(handler, state), methods=[method])
    for path in UNSUPPORTED:
        app.add_api_route(path, unsupported(path), methods=["POST", "DELETE", "GET"])
    app.add_api_route("/api/blobs/{digest}", unsupported("/api/blobs"), methods=["POST", "HEAD"])
    # /metrics counts these under their own endpoint label (edgerun_requests_total{endpoint="/api/chat"}), as /v1/*
    state.metrics.name_endpoints([path for _, path, _ in ROUTES] + list(UNSUPPORTED), prefixes=["/api/blobs"])
    app.add_middleware(OllamaErrors)
