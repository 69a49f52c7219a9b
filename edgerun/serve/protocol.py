"""The OpenAI protocol as edgerun speaks it: request bodies and their validation, error and response shapes.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ContextOverflow, EdgerunError, InvalidArgument
from ..request import Request, Structure
from ..util.jsontext import deeper_than
from .scheduler import JobResult


log = logging.getLogger(__name__)


# --- errors --------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered as OpenAI-style JSON. Raised inside request handling only."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


FAILED = ("error", "shutdown", "cancelled", "evicted")     # job outcomes that are answered with an error


def error_from_result(res: JobResult, timeout_s: float, chat: bool) -> APIError:
    """The HTTP error for a job that produced nothing usable."""
    if res.outcome == "error":
        exc = res.error
        if isinstance(exc, ContextOverflow):
            return APIError(400, str(exc), param="messages" if chat else "prompt", code="context_length_exceeded")
        if isinstance(exc, InvalidArgument):
            return APIError(400, str(exc), param=exc.param, code="invalid_value")
        if isinstance(exc, EdgerunError):
            return APIError(500, str(exc), type="server_error", code=type(exc).__name__)
        return APIError(500, "internal error during generation (logged on the server)", type="server_error",
                        code="internal_error")
    if res.outcome == "shutdown":
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                        headers={"Retry-After": "5"})
    if res.outcome == "evicted":
        return APIError(503, "the queue is full and this client holds more requests than another that asked; "
                             "retry later", type="server_error", code="queue_full", headers={"Retry-After": "5"})
    if res.outcome == "timeout":
        return APIError(503, f"the request waited its whole time limit ({timeout_s:g} s) in the queue",
                        type="server_error", code="queue_timeout", headers={"Retry-After": "5"})
    return APIError(499, "the client closed the request", code="cancelled")


# --- request bodies ------------------------------------------------------------------------------

class _Strict(BaseModel):
    """Strict types (no '1' for 1), unknown fields ignored as OpenAI clients send extras."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None       # assistant: the calls it made (checked in constrain/tools.py)
    tool_call_id: str | None = None           # tool: the call this result answers


class StreamOptions(_Strict):
    include_usage: bool = False


class Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None              # llama.cpp-server extensions, honoured when given
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # accepted only at their no-op values (checked in reject_unsupported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    logit_bias: Any = None


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    top_logprobs: Any = None
    tools: Any = None                       # checked by constrain/tools.py (400 invalid_value)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    response_format: Any = None             # checked by constrain/grammar.py


class CompletionRequest(Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: Any = None             # as for chat (an edgerun extension here)
    json_schema: Any = None                 # llama.cpp server's extension: a JSON schema object


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|function-\w+|.*\[.*\]|[A-Z]\w*)$")


def _param_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _TYPE_TAG.match(p))]
    return ".".join(parts)


MAX_NESTING = 512          # arrays/objects inside one another in a request body (a schema needs ~2 per level)


def parse_body(raw: bytes) -> Any:
    """A request body as JSON: UTF-8, nested at most MAX_NESTING deep, no NaN/Infinity, and no string
    anywhere that is not valid Unicode (a lone surrogate written as \\ud800). Parsed first (C speed); the
    nesting is walked only when the body has enough brackets to be that deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not UTF-8 text", code="invalid_json") from None

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        data = _TOO_DEEP
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if data is _TOO_DEEP or (raw.count(b"[") + raw.count(b"{") > MAX_NESTING and deeper_than(data, MAX_NESTING)):
        raise APIError(400, f"request body nests arrays and objects more than {MAX_NESTING} levels deep; that "
                            "is the limit", code="invalid_value")     # valid JSON, over a limit
    if "\\u" in text:        # only an escape can write a lone surrogate in UTF-8 JSON
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"request body holds a string that is not valid Unicode ({e.object[e.start:e.end]!a}, "
                                "a lone surrogate); expected UTF-8 text", code="invalid_value") from None
    return data


_TOO_DEEP = object()


def validate(model_cls, data: Any):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_of(tuple(err.get("loc", ())))
        where = f" at '{param}'" if param else ""
        raise APIError(422, f"invalid request body{where}: {err.get('msg', 'wrong type')}"
                            f" (got {_short(err.get('input'))})", param=param or None, code="invalid_type") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def reject_unsupported(req) -> None:
    def no(param: str, why: str) -> APIError:
        return APIError(400, f"'{param}' {why} is not supported by edgerun", param=param, code="unsupported_parameter")

    if req.n not in (None, 1):
        raise no("n", f"= {req.n} (one choice per request)")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0, 0.0):
            raise no(name, "other than 0 (use repeat_penalty)")
    if req.logprobs not in (None, False, 0):
        raise no("logprobs", "")
    if req.logit_bias not in (None, {}):
        raise no("logit_bias", "")
    if getattr(req, "top_logprobs", None) not in (None, 0):
        raise no("top_logprobs", "")
    if getattr(req, "functions", None) not in (None, []):
        raise no("functions", "(deprecated by OpenAI; use 'tools')")
    if getattr(req, "echo", False):
        raise no("echo", "= true")
    if getattr(req, "suffix", None):
        raise no("suffix", "")
    if getattr(req, "best_of", None) not in (None, 1):
        raise no("best_of", "other than 1")


def sampling_values(req) -> dict:
    """The sampling values a request body set (the rest keep the runtime's defaults); their ranges are
    checked once, by the Request they go into."""
    out = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
           if getattr(req, k) is not None}
    if req.seed is not None:
        out["seed"] = req.seed % 2 ** 63     # OpenAI seeds are int64; a negative one maps to a valid one
    return out


def request_from(req, structure: Structure, *, max_tokens: int | None, messages: list[dict] | None = None,
                 prompt: str | None = None, prompt_tokens: list[int] | None = None) -> Request:
    """The Request of a validated body: a bad value is a 400 naming its field."""
    try:
        return Request.build(messages=messages, prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                             stop=req.stop, structure=structure, **sampling_values(req))
    except InvalidArgument as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def max_tokens_from(value: int | None, param: str) -> int | None:
    if value is None:
        return None
    if value < 1:
        raise APIError(400, f"'{param}' must be an integer >= 1, got {value}", param=param, code="invalid_value")
    return value




def chat_message(m: Message) -> dict:
    """A request message as the runtime takes it (developer -> system; tool calls and results kept)."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": content_text(m.content)}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def structure_options(req, chat: bool) -> dict:
    """The output-structure options a request body set, as Structure.parse takes them (parsed and vetted off
    the event loop: handling.vet_structure)."""
    names = ("tools", "tool_choice", "parallel_tool_calls", "response_format") if chat else \
        ("json_schema", "response_format")
    return {n: getattr(req, n) for n in names if getattr(req, n, None) is not None}


def content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)



def usage(res: JobResult) -> dict:
    return {"prompt_tokens": res.n_prompt_tokens, "completion_tokens": res.n_tokens,
            "total_tokens": res.n_prompt_tokens + res.n_tokens}



def sse_data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n\n"


def sse_framer(obj: dict, mark: str):
    """A function text -> sse_data(obj with `mark`, one of its string values, replaced by text), byte for byte,
    that does not serialise obj again: a stream's token chunks differ only in their text, so the chunk is
    serialised once and each token's text spliced in, off the event loop's per-token path (docs/batching.md)."""
    head, sep, tail = sse_data(obj).partition(json.dumps(mark).encode("utf-8"))
    if not sep or json.dumps(mark).encode("utf-8") in tail:
        raise ValueError("the mark must be exactly one string value of the object")
    return lambda text: head + json.dumps(text).encode("utf-8") + tail

