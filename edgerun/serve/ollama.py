"""Ollama's API beside OpenAI's, on the same port and through the same machinery.

Endpoints (Ollama's docs/api.md): POST /api/chat and /api/generate (NDJSON streams by default, `stream: false`
for one object), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, POST /api/pull (only with
--allow-pull: it writes to disk). Other /api/* endpoints of Ollama (create, push, copy, delete, embed,
embeddings, blobs) answer 501.

A request becomes the same scheduler Job the OpenAI routes build: the same checks (serve/protocol.py:
sampling ranges, stop strings, token limits, the context-size precheck), the same structured output
(`format: "json"` or a JSON schema -> response_format), the same tool calling (`tools`, answered as
`message.tool_calls` with arguments as objects), the same queue, time limit and disconnect handling
(app.start_job). The API key, Host/Origin and body-size rules are the app's middleware and body reader.

Ollama's clients send `options` freely (num_ctx, num_thread, mirostat, ...): an option this server
cannot honour is ignored, and a value out of range is clamped, never refused. What was ignored or
clamped is named in the `X-Edgerun-Options` response header and logged. Errors are Ollama's
{"error": "..."} (the middleware at the bottom reshapes the app's OpenAI-style errors on /api/* paths).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..constrain.tools import ToolCallStream, parse_tool_calls
from ..errors import EdgerunError
from . import handling
from .clients import client_key
from .jobs import Job
from .protocol import FAILED, APIError, _Strict, error_from_result, request_from, structure_options, validate
from ..config import MAX_TEMPERATURE, REPEAT_PENALTY_RANGE
from ..request import MAX_STOP_STRINGS

log = logging.getLogger(__name__)

# The Ollama release whose API this module follows; /api/version answers it (clients gate features on it).
OLLAMA_API_VERSION = "0.6.0"
NDJSON = "application/x-ndjson"
UNSUPPORTED = ("/api/create", "/api/push", "/api/copy", "/api/delete", "/api/embed", "/api/embeddings")

# options -> the OpenAI-side field protocol.request_from reads, and the range a value is clamped into
_SAMPLING = {"temperature": ("temperature", 0.0, MAX_TEMPERATURE), "top_p": ("top_p", 1e-6, 1.0),
             "top_k": ("top_k", 0, None), "min_p": ("min_p", 0.0, 0.999999),
             "repeat_penalty": ("repeat_penalty", *REPEAT_PENALTY_RANGE), "seed": ("seed", None, None)}
# options Ollama knows that change nothing here (llama.cpp load-time settings, samplers edgerun lacks)
_IGNORED = frozenset({"num_keep", "typical_p", "repeat_last_n", "presence_penalty", "frequency_penalty",
                      "penalize_newline", "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z", "numa",
                      "num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only", "use_mmap", "use_mlock",
                      "num_thread", "f16_kv", "logits_all", "embedding_only", "use_numa"})


# --- request bodies ------------------------------------------------------------------------------

class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _OllamaCommon(_Strict):
    model: str = ""
    format: Any = None                  # "json" or a JSON schema
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None              # accepted; the model stays loaded for the server's lifetime
    think: Any = None


class ChatBody(_OllamaCommon):
    messages: list[OllamaMessage] | None = None
    tools: Any = None


class GenerateBody(_OllamaCommon):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[Any] | None = None


class NameBody(_Strict):
    model: str = ""
    name: str = ""                      # older clients' spelling of model
    verbose: bool = False
    insecure: bool = False
    stream: bool = True


# --- names, files, details -----------------------------------------------------------------------

def served_name(state) -> str:
    """The served model's name as Ollama's clients see it (a path gives its file's stem)."""
    model = state.model_id
    if "/" in model or model.endswith(".gguf"):
        return Path(model).stem if model.endswith(".gguf") else Path(model).name
    return model


def check_model(state, name: str) -> None:
    """404 "model not found" unless `name` is the served model, as `name` or `name:latest`."""
    if not name:
        raise APIError(400, "model is required", param="model")
    base = name[: -len(":latest")] if name.endswith(":latest") else name
    if name not in state.model_names and base not in state.model_names and base != served_name(state):
        raise APIError(404, f'model "{name}" not found; this server serves "{served_name(state)}:latest"',
                       param="model", code="model_not_found")


def _model_file(state) -> Path | None:
    runtime = state.scheduler.runtime
    path = getattr(getattr(runtime, "target", None), "path", None)
    if path is not None:
        return Path(path)
    try:
        from ..registry.cache import resolve_model

        return Path(resolve_model(state.model_id, pull=False))
    except (EdgerunError, OSError):
        return None


class _Facts:
    """What /api/tags, /show and /ps say about the served model, read once from its file's header."""

    def __init__(self, state) -> None:
        self.path = _model_file(state)
        self.size, self.modified, self.meta = 0, time.time(), {}
        if self.path is not None and self.path.is_file():
            st = self.path.stat()
            self.size, self.modified = st.st_size, st.st_mtime
            try:
                from ..formats.ggufscan import read_info

                self.meta = read_info(self.path).metadata
            except Exception as e:                # noqa: BLE001 - a header we cannot read leaves the details empty
                log.info("could not read the GGUF header of %s: %s", self.path, e)
        pinned = None
        try:
            from ..registry.manifest import get_manifest

            pinned = get_manifest(state.model_id).sha256
        except EdgerunError:
            pass
        # Ollama's digest names a manifest; here: the file's pinned sha256, else a hash of its path, size and time
        self.digest = pinned or hashlib.sha256(f"{self.path}|{self.size}|{self.modified}".encode()).hexdigest()

    def details(self) -> dict:
        arch = str(self.meta.get("general.architecture", ""))
        ftype = self.meta.get("general.file_type")
        quant = _FILE_TYPES.get(ftype, str(ftype) if ftype is not None else "")
        n = self.meta.get("general.size_label") or ""
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
                "parameter_size": str(n), "quantization_level": quant}


# llama.cpp's general.file_type values (the common ones)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


def _facts(state) -> _Facts:
    facts = getattr(state, "_ollama_facts", None)
    if facts is None or (facts.path is None and state.scheduler.runtime is not None):
        facts = state._ollama_facts = _Facts(state)
    return facts


def _iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).isoformat().replace("+00:00", "Z")


# --- options -------------------------------------------------------------------------------------

def options_from(state, options: dict | None, notes: list[str]) -> tuple[SimpleNamespace, int | None]:
    """(the sampling and stop fields as protocol.request_from reads them, max_tokens) from Ollama's options,
    values out of range clamped (the Request checks them once more); what is ignored or clamped is
    appended to `notes`."""
    opts = dict(options or {})
    fields: dict[str, Any] = {}
    for key, (field, lo, hi) in _SAMPLING.items():
        if key not in opts or opts[key] is None:
            continue
        v = opts.pop(key)
        want_int = key in ("top_k", "seed")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            notes.append(f"{key} ignored (not a number)")
            continue
        if want_int and not float(v).is_integer():
            notes.append(f"{key} ignored (not an integer)")
            continue
        c = v if lo is None else max(v, lo)
        c = c if hi is None else min(c, hi)
        if c != v:
            notes.append(f"{key}={v} clamped to {c}")
        fields[field] = int(c) if want_int else float(c)
    if fields.get("seed", 0) < 0:                   # Ollama: a negative seed means a random one
        del fields["seed"]
    max_tokens = None
    if "num_predict" in opts:
        v = opts.pop("num_predict")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() and v > 0:
            max_tokens = int(v)
        elif v not in (None, -1, -2):
            notes.append(f"num_predict={v!r:.20} ignored")
    stop = opts.pop("stop", None)
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        notes.append("stop ignored (not a list of strings)")
        stop = None
    if stop and len(stop) > MAX_STOP_STRINGS:
        notes.append(f"stop: the first {MAX_STOP_STRINGS} of {len(stop)} strings kept")
        stop = stop[:MAX_STOP_STRINGS]
    n_ctx = opts.pop("num_ctx", None)
    runtime = state.scheduler.runtime
    if n_ctx is not None and runtime is not None and n_ctx != runtime.n_ctx:
        notes.append(f"num_ctx={n_ctx!r:.20} ignored (the context is {runtime.n_ctx} tokens, set at start: --ctx)")
    for key in sorted(opts):
        notes.append(f"{key:.40} ignored" + ("" if key in _IGNORED else " (unknown)"))
    req = SimpleNamespace(temperature=None, top_p=None, top_k=None, min_p=None, repeat_penalty=None, seed=None,
                          stop=stop)
    for k, v in fields.items():
        setattr(req, k, v)
    return req, max_tokens


def structure_of(fmt: Any, tools: Any = None, chat: bool = True, tool_choice: Any = None) -> dict:
    """Ollama's `format` and `tools` as the OpenAI routes' structure options (protocol.structure_options).
    tool_choice: edgerun's own option (Ollama has none: the model decides, 'auto'): 'auto', 'none',
    'required', or a tool's name."""
    if fmt in (None, ""):
        rf = None
    elif fmt == "json":
        rf = {"type": "json_object"}
    elif isinstance(fmt, dict):
        rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise APIError(400, f'invalid format {fmt!r:.60}: expected "json" or a JSON schema object', param="format")
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    req = SimpleNamespace(tools=tools if tools else None, tool_choice=tool_choice if tools else None,
                          parallel_tool_calls=None,
                          response_format=rf, json_schema=None)
    return structure_options(req, chat=chat)


def _message(m: OllamaMessage, i: int) -> dict:
    if m.images:
        raise APIError(400, f"messages[{i}] carries images; the served model reads text only", param="messages")
    out: dict = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
        out["tool_calls"] = m.tool_calls           # Ollama's {"function": {name, arguments: {...}}}: tools.py reads both
    return out


def _ollama_calls(calls: list[dict]) -> list[dict]:
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


# --- the routes ----------------------------------------------------------------------------------

def install(app, state) -> None:
    """Register the /api/* routes and the error reshaper on the app (create_app calls this)."""

    config = state.config

    async def body_of(request: Request, cls):
        return validate(cls, await handling._read_json(request, config.max_body_bytes))

    @app.post("/api/chat")
    async def chat(request: Request):
        t0 = time.monotonic()
        req = await body_of(request, ChatBody)
        check_model(state, req.model)
        if not req.messages:                         # Ollama: an empty chat loads the model (or unloads it)
            handling._require_ready(state)
            return _loaded(state, req, chat=True)
        handling._require_ready(state)
        notes: list[str] = []
        handling.check_turns(state, len(req.messages))
        messages = [_message(m, i) for i, m in enumerate(req.messages)]
        handling._check_fits(state, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), chat=True)
        options = dict(req.options or {})
        tool_choice = options.pop("tool_choice", None)        # edgerun's own option (docs/clients.md)
        fields, max_tokens = options_from(state, options, notes)
        structure = await handling.vet_structure(state, structure_of(req.format, req.tools, chat=True,
                                                                     tool_choice=tool_choice))
        _note_rest(req, notes)
        job = Job(request_from(fields, structure, messages=messages, max_tokens=max_tokens),
                  timeout_s=config.timeout_s, client=client_key(request.scope, config))
        return await _answer(state, request, req, job, chat=True, tools=list(structure.tools), notes=notes, t0=t0)

    @app.post("/api/generate")
    async def generate(request: Request):
        t0 = time.monotonic()
        req = await body_of(request, GenerateBody)
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
            return _loaded(state, req, chat=False)
        notes: list[str] = []
        fields, max_tokens = options_from(state, req.options, notes)
        structure = await handling.vet_structure(state, structure_of(req.format, chat=False))
        _note_rest(req, notes)
        if req.template:
            notes.append("template ignored (the model's own chat template is used)")
        if req.raw:
            handling._check_fits(state, len((req.prompt or "").encode("utf-8", "surrogatepass")), chat=False)
            job = Job(request_from(fields, structure, prompt=req.prompt or "", max_tokens=max_tokens),
                      timeout_s=config.timeout_s, client=client_key(request.scope, config))
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                       [{"role": "user", "content": req.prompt or ""}]
            handling._check_fits(state, sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages),
                             chat=True)
            # chat templating is how the prompt gets the model's template; structure applies to the answer
            job = Job(request_from(fields, structure, messages=messages, max_tokens=max_tokens),
                      timeout_s=config.timeout_s, client=client_key(request.scope, config))
        return await _answer(state, request, req, job, chat=False, tools=[], notes=notes, t0=t0)

    @app.get("/api/tags")
    async def tags():
        handling._require_ready(state)
        return {"models": [_model_entry(state)]}

    @app.get("/api/ps")
    async def ps():
        handling._require_ready(state)
        f = _facts(state)
        entry = _model_entry(state)
        runtime = state.scheduler.runtime
        entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0, size=f.size,
                     context_length=getattr(runtime, "n_ctx", 0))
        entry.pop("modified_at", None)
        return {"models": [entry]}

    @app.post("/api/show")
    async def show(request: Request):
        req = await body_of(request, NameBody)
        check_model(state, req.model or req.name)
        handling._require_ready(state)
        f = _facts(state)
        runtime = state.scheduler.runtime
        tok = getattr(runtime, "tokenizer", None)
        template = getattr(tok, "chat_template", None) or ""
        info = {k: v for k, v in f.meta.items() if k.startswith("general.") or "." in k and not k.startswith("tokenizer.")}
        caps = ["completion"] + (["tools"] if template and "tools" in template else [])
        return {"modelfile": f"# served by edgerun\nFROM {f.path or state.model_id}\n",
                "parameters": f"num_ctx {getattr(runtime, 'n_ctx', 0)}", "template": template, "license": "",
                "details": f.details(), "model_info": info, "capabilities": caps, "modified_at": _iso(f.modified)}

    @app.get("/api/version")
    async def version():
        from .. import __version__

        return {"version": OLLAMA_API_VERSION, "edgerun": __version__}

    @app.post("/api/pull")
    async def pull(request: Request):
        req = await body_of(request, NameBody)
        name = req.model or req.name
        if not config.allow_pull:
            raise APIError(403, "pulling models is turned off on this server (it writes to disk); start it with "
                                "--allow-pull / EDGERUN_ALLOW_PULL=1, or run `edgerun pull` on the board",
                           code="pull_disabled")
        if not name:
            raise APIError(400, "model is required", param="model")
        return await _pull(name[: -len(":latest")] if name.endswith(":latest") else name, req.stream)

    for path in UNSUPPORTED:
        app.add_api_route(path, _unsupported(path), methods=["POST", "DELETE", "GET"])
    app.add_api_route("/api/blobs/{digest}", _unsupported("/api/blobs"), methods=["POST", "HEAD"])
    app.add_middleware(OllamaErrors)


def _unsupported(path: str):
    async def refuse():
        raise APIError(501, f"{path} is not supported by edgerun (it serves one model: "
                            "see docs/clients.md)", code="not_implemented")
    return refuse


def _note_rest(req, notes: list[str]) -> None:
    if req.keep_alive is not None:
        notes.append("keep_alive accepted (the model stays loaded while the service runs)")
    if req.think not in (None, False):
        notes.append("think ignored")


def _model_entry(state) -> dict:
    f = _facts(state)
    name = served_name(state) + ":latest"
    return {"name": name, "model": name, "modified_at": _iso(f.modified), "size": f.size, "digest": f.digest,
            "details": f.details()}


def _loaded(state, req, *, chat: bool) -> JSONResponse:
    """Ollama's answer to an empty request: the model is loaded (keep_alive 0 would unload it; here it stays)."""
    reason = "unload" if req.keep_alive in (0, "0", "0s", "0m") else "load"
    body: dict = {"model": req.model, "created_at": _iso(), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    headers = {"X-Edgerun-Options": "keep_alive: the model stays loaded while the service runs"} if reason == "unload" \
        else {}
    return JSONResponse(body, headers=headers)


def _header(notes: list[str]) -> dict:
    if not notes:
        return {}
    text = "; ".join(notes).encode("ascii", "replace").decode("ascii")[:1000]
    return {"X-Edgerun-Options": text}


async def _answer(state, request, req, job, *, chat: bool, tools, notes: list[str], t0: float):
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
                                                                 "X-Accel-Buffering": "no", **_header(notes)})
        texts: list[str] = []
        event = first
        while event[0] == "step":
            texts.append(event[1].text)
            event = await handling._next_event(state, job)
        res = event[1]
        if res.outcome in FAILED:
            raise error_from_result(res, state.config.timeout_s, chat)
        text = "".join(texts)
        body = {"model": req.model, "created_at": _iso()}
        if chat:
            message: dict = {"role": "assistant", "content": text}
            if tools:
                content, calls = parse_tool_calls(text, tools)
                if calls:
                    message = {"role": "assistant", "content": content or "", "tool_calls": _ollama_calls(calls)}
            body["message"] = message
        else:
            body["response"] = text
        body.update(_final(state, res, t0))
        return JSONResponse(body, headers=_header(notes))
    finally:
        if not handed_over:
            handling.release_job(state, job, watcher)


def _final(state, res, t0: float) -> dict:
    st = res.stats
    ns = 1_000_000_000
    return {"done": True, "done_reason": res.finish_reason, "total_duration": int((time.monotonic() - t0) * ns),
            "load_duration": 0, "prompt_eval_count": res.n_prompt_tokens,
            "prompt_eval_duration": int(st.t_prefill_s * ns), "eval_count": res.n_tokens,
            "eval_duration": int(max(0.0, st.t_total_s - st.t_prefill_s) * ns),
            "edgerun": handling._edgerun_field(state, res)}


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


async def _ndjson(state, job, first, watcher, model: str, chat: bool, tools, t0: float) -> AsyncIterator[bytes]:
    """One generation as Ollama's NDJSON stream: a line per token (held tokens go out in one write), tool calls
    whole in one line once their arguments are complete, then the final line with the counts."""
    reader = ToolCallStream(tools) if (chat and tools) else None

    def piece(text: str, calls: list | None = None) -> bytes:
        obj: dict = {"model": model, "created_at": _iso()}
        if chat:
            obj["message"] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        else:
            obj["response"] = text
        obj["done"] = False
        return _line(obj)

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
                    yield _line({"error": err.message})
                    return
        res = event[1]
        if res.outcome in FAILED:
            yield _line({"error": error_from_result(res, state.config.timeout_s, chat).message})
            return
        if reader is not None:
            tail = list(reader.finish())
            text = content_of(tail)
            if reader.calls:
                yield piece(text, _ollama_calls(reader.calls))
            elif text:
                yield piece(text)
        last: dict = {"model": model, "created_at": _iso()}
        last.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        last.update(_final(state, res, t0))
        yield _line(last)
    finally:
        handling.release_job(state, job, watcher)


async def _pull(name: str, stream: bool):
    """edgerun's registry pull on a thread, its progress as Ollama's status lines."""
    from ..registry.fetch import pull
    from ..registry.manifest import get_manifest

    try:
        m = get_manifest(name)
    except EdgerunError as e:
        raise APIError(404, f'pull model manifest: model "{name}" not found in the edgerun registry ({e})',
                       code="model_not_found") from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    digest = "sha256:" + m.sha256

    def progress(stage: str, done: int, total: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"status": f"pulling {m.sha256[:12]}" if stage == "download"
                                                     else stage, "digest": digest, "total": total,
                                                     "completed": done})

    def work():
        try:
            pull(name, progress)
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except BaseException as e:                   # noqa: BLE001 - reported to the client
            loop.call_soon_threadsafe(queue.put_nowait, e)

    async def lines() -> AsyncIterator[dict]:
        yield {"status": "pulling manifest"}
        task = loop.run_in_executor(None, work)
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                yield {"error": f"pull {name}: {item}"}
                await task
                return
            yield item
        await task
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    if stream:
        async def body():
            async for obj in lines():
                yield _line(obj)
        return StreamingResponse(body(), media_type=NDJSON)
    last: dict = {}
    async for obj in lines():
        last = obj
    if "error" in last:
        raise APIError(500 if "No space" not in last["error"] else 507, last["error"])
    return last


class OllamaErrors:
    """ASGI middleware: on /api/* paths an error answered in the app's OpenAI shape ({"error": {"message":
    ...}}) is re-shaped as Ollama's {"error": "..."}, and a 422 (a body of the wrong shape) becomes Ollama's 400.
    Wraps the API-key gate, so its 401 and 403 are re-shaped too. Other paths pass untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/api/"):
            await self.app(scope, receive, send)
            return
        held: dict = {}
        chunks: list[bytes] = []

        async def reshaping_send(message) -> None:
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and ctype.startswith(b"application/json"):
                    held["start"] = message              # buffered: the body is rewritten once whole
                    return
                await send(message)
                return
            if message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start = held.pop("start")
                body = b"".join(chunks)
                try:
                    err = json.loads(body).get("error")
                    if isinstance(err, dict):
                        body = json.dumps({"error": err.get("message", "")}).encode("utf-8")
                except (ValueError, AttributeError):
                    pass
                status = 400 if start["status"] == 422 else start["status"]
                headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        await self.app(scope, receive, reshaping_send)
