"""OpenAI's API: POST /v1/chat/completions and POST /v1/completions, whole or as server-sent events ending in
`data: [DONE]`. Requests become a Request (protocol.py, edgerun/request.py) in a Job (scheduler.py)."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..constrain.tools import ToolCallStream, parse_tool_calls
from .clients import client_key
from .handling import (_check_fits, _edgerun_field, _next_event, _read_json, _ready_event, _require_ready, check_turns,
                       release_job, start_job, vet_structure)
from .protocol import (FAILED, APIError, ChatRequest, CompletionRequest, chat_message, error_from_result,
                       max_tokens_from, reject_unsupported, request_from, sse_data, sse_framer, structure_options,
                       usage, validate)
from .scheduler import Job, JobResult
from .state import _State


def install(app, state: _State) -> None:
    """Add the OpenAI routes to `app`."""

    @app.post("/v1/chat/completions")
    async def _chat_completions(request: Request):
        return await chat_completions(state, request)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(state, request)


async def _body(state: _State, request: Request, model_cls):
    """A generation request's body, validated, for a ready server serving the model it names."""
    req = validate(model_cls, await _read_json(request, state.config.max_body_bytes))
    _require_ready(state)
    state.check_model(req.model)
    reject_unsupported(req)
    return req


async def chat_completions(state: _State, request: Request):
    config = state.config
    req = await _body(state, request, ChatRequest)
    if not req.messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages", code="invalid_value")
    check_turns(state, len(req.messages))
    messages = [chat_message(m) for m in req.messages]
    _check_fits(state, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), chat=True)
    mt = max_tokens_from(req.max_tokens, "max_tokens")
    if req.max_completion_tokens is not None:
        mt = max_tokens_from(req.max_completion_tokens, "max_completion_tokens")
    structure = await vet_structure(state, structure_options(req, chat=True))
    job = Job(request_from(req, structure, messages=messages, max_tokens=mt), timeout_s=config.timeout_s,
              client=client_key(request.scope, config))
    return await _respond(state, request, req, job, chat=True, tools=list(structure.tools))


async def completions(state: _State, request: Request):
    config = state.config
    req = await _body(state, request, CompletionRequest)
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
    structure = await vet_structure(state, structure_options(req, chat=False))
    job = Job(request_from(req, structure, prompt=prompt, prompt_tokens=tokens,
                           max_tokens=max_tokens_from(req.max_tokens, "max_tokens")),
              timeout_s=config.timeout_s, client=client_key(request.scope, config))
    return await _respond(state, request, req, job, chat=False)


async def _respond(state: _State, request: Request, req, job: Job, *, chat: bool, tools=()):
    config = state.config
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
