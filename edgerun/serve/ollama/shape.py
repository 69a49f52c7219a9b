"""A generation's answer in Ollama's shapes: one JSON object (`stream: false`) or an NDJSON stream of a line per
token and a final line with the counts; tool calls as `message.tool_calls` with arguments as objects; what
was ignored or clamped in the `X-Edgerun-Options` header."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from ...constrain.tools import ToolCallStream, parse_tool_calls
from .. import handling
from ..protocol import FAILED, APIError, error_from_result
from .facts import iso

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


def line(obj: dict) -> bytes:
    """One NDJSON line."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls (arguments a JSON string) in Ollama's shape (arguments an object)."""
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except json.JSONDecodeError:
            args = {}
        out.append({"id": c.get("id"), "function": {"index": i, "name": fn["name"], "arguments": args}})
    return out


def options_header(notes: list[str]) -> dict:
    """The X-Edgerun-Options header naming what was ignored or clamped (none when nothing was)."""
    if not notes:
        return {}
    text = "; ".join(notes).encode("ascii", "replace").decode("ascii")[:1000]
    return {"X-Edgerun-Options": text}


def loaded(req, *, chat: bool) -> JSONResponse:
    """Ollama's answer to an empty request: the model is loaded (keep_alive 0 would unload it; here it stays)."""
    reason = "unload" if req.keep_alive in (0, "0", "0s", "0m") else "load"
    body: dict = {"model": req.model, "created_at": iso(), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    headers = {"X-Edgerun-Options": "keep_alive: the model stays loaded while the service runs"} if reason == "unload" \
        else {}
    return JSONResponse(body, headers=headers)


def _final(state, res, t0: float) -> dict:
    st = res.stats
    ns = 1_000_000_000
    return {"done": True, "done_reason": res.finish_reason, "total_duration": int((time.monotonic() - t0) * ns),
            "load_duration": 0, "prompt_eval_count": res.n_prompt_tokens,
            "prompt_eval_duration": int(st.t_prefill_s * ns), "eval_count": res.n_tokens,
            "eval_duration": int(max(0.0, st.t_total_s - st.t_prefill_s) * ns),
            "edgerun": handling._edgerun_field(state, res)}


async def answer(state, request, req, job, *, chat: bool, tools, notes: list[str], t0: float):
    """Run the job and answer it: a StreamingResponse of NDJSON, or one JSON object once it has ended."""
    if notes:
        log.info("%s %s: %s", request.method, request.url.path, "; ".join(notes))
    job.events.hold_s = state.config.stream_interval_ms / 1000 if req.stream else math.inf
    first, watcher = await handling.start_job(state, request, job, chat=chat)
    handed_over = False
    try:
        if req.stream:
            handed_over = True
            return StreamingResponse(_ndjson(state, job, first, watcher, req.model, chat, tools, t0),
                                     media_type=NDJSON, headers={"Cache-Control": "no-cache",
                                                                 "X-Accel-Buffering": "no", **options_header(notes)})
        texts: list[str] = []
        event = first
        while event[0] == "step":
            texts.append(event[1].text)
            event = await handling._next_event(state, job)
        res = event[1]
        if res.outcome in FAILED:
            raise error_from_result(res, state.config.timeout_s, chat)
        text = "".join(texts)
        body = {"model": req.model, "created_at": iso()}
        if chat:
            message: dict = {"role": "assistant", "content": text}
            if tools:
                content, calls = parse_tool_calls(text, tools)
                if calls:
                    message = {"role": "assistant", "content": content or "", "tool_calls": ollama_calls(calls)}
            body["message"] = message
        else:
            body["response"] = text
        body.update(_final(state, res, t0))
        return JSONResponse(body, headers=options_header(notes))
    finally:
        if not handed_over:
            handling.release_job(state, job, watcher)


async def _ndjson(state, job, first, watcher, model: str, chat: bool, tools, t0: float) -> AsyncIterator[bytes]:
    """One generation as Ollama's NDJSON stream: a line per token (held tokens go out in one write), tool calls
    whole in one line once their arguments are complete, then the final line with the counts."""
    reader = ToolCallStream(tools) if (chat and tools) else None

    def piece(text: str, calls: list | None = None) -> bytes:
        obj: dict = {"model": model, "created_at": iso()}
        if chat:
            obj["message"] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        else:
            obj["response"] = text
        obj["done"] = False
        return line(obj)

    def content_of(events) -> str:
        return "".join(ev[1] for ev in events if ev[0] == "content")

    try:
        event = first
        while event[0] == "step":
            parts: list[bytes] = []
            while event is not None and event[0] == "step":
                text = event[1].text
                if reader is not None:
                    text = content_of(reader.feed(text))
                if text:
                    parts.append(piece(text))
                event = handling._ready_event(job)
            if parts:
                yield b"".join(parts)
            if event is None:
                try:
                    event = await handling._next_event(state, job)
                except APIError as err:
                    yield line({"error": err.message})
                    return
        res = event[1]
        if res.outcome in FAILED:
            yield line({"error": error_from_result(res, state.config.timeout_s, chat).message})
            return
        if reader is not None:
            tail = list(reader.finish())
            text = content_of(tail)
            if reader.calls:
                yield piece(text, ollama_calls(reader.calls))
            elif text:
                yield piece(text)
        last: dict = {"model": model, "created_at": iso()}
        last.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        last.update(_final(state, res, t0))
        yield line(last)
    finally:
        handling.release_job(state, job, watcher)
