"""An Ollama request as edgerun's: the request bodies, model names, `options` (clamped or ignored, never
refused), `format` and `tools`, and the one place (`parts_of`, `job_of`) that hands them to protocol.py's
checks, vets the grammar and builds the scheduler Job the OpenAI routes build too."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, NamedTuple

from .. import handling
from ..clients import client_key
from ..jobs import Job
from ...config import MAX_TEMPERATURE, REPEAT_PENALTY_RANGE
from ...request import MAX_STOP_STRINGS, Structure
from ..protocol import APIError, _Strict, request_from, structure_options

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


# --- names ---------------------------------------------------------------------------------------

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


# --- options, format, messages -------------------------------------------------------------------

def _clamped(key: str, v: Any, lo, hi, notes: list[str]) -> int | float | None:
    """One sampling option as a number in its range (clamped, and said in `notes`); None: ignored."""
    want_int = key in ("top_k", "seed")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        notes.append(f"{key} ignored (not a number)")
        return None
    if want_int and not float(v).is_integer():
        notes.append(f"{key} ignored (not an integer)")
        return None
    c = v if lo is None else max(v, lo)
    c = c if hi is None else min(c, hi)
    if c != v:
        notes.append(f"{key}={v} clamped to {c}")
    return int(c) if want_int else float(c)


def options_from(state, options: dict | None, notes: list[str]) -> tuple[dict, int | None, list[str] | None]:
    """(sampling fields, num_predict, stop) from Ollama's options, values out of range clamped; what is
    ignored or clamped is appended to `notes`. protocol.py's own checks run on them in parts_of."""
    opts = dict(options or {})
    fields: dict[str, Any] = {}
    for key, (field, lo, hi) in _SAMPLING.items():
        if key in opts and opts[key] is not None:
            c = _clamped(key, opts.pop(key), lo, hi, notes)
            if c is not None:
                fields[field] = c
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
    return fields, max_tokens, stop


def response_format_of(fmt: Any) -> dict | None:
    """Ollama's `format` ("json" or a JSON schema) as the OpenAI routes' response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError(400, f'invalid format {fmt!r:.60}: expected "json" or a JSON schema object', param="format")


def message_of(m: OllamaMessage, i: int) -> dict:
    """An Ollama chat message as the runtime takes it."""
    if m.images:
        raise APIError(400, f"messages[{i}] carries images; the served model reads text only", param="messages")
    out: dict = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
        out["tool_calls"] = m.tool_calls           # Ollama's {"function": {name, arguments: {...}}}: tools.py reads both
    return out


def note_rest(req, notes: list[str]) -> None:
    """Fields accepted and not acted on, said in `notes`."""
    if req.keep_alive is not None:
        notes.append("keep_alive accepted (the model stays loaded while the service runs)")
    if req.think not in (None, False):
        notes.append("think ignored")


# --- the one door to protocol.py's checks and the Job --------------------------------------------

class Parts(NamedTuple):
    fields: SimpleNamespace         # sampling values and stop strings, as protocol.request_from reads them
    max_tokens: int | None
    structure: Structure

    @property
    def tools(self) -> list:
        return list(self.structure.tools)


async def parts_of(state, req, notes: list[str], *, chat: bool) -> Parts:
    """A chat or generate body's sampling, limit, stop and structure (the structure parsed and its grammar
    vetted off the worker: a bad one is a 400). tool_choice: edgerun's own option in `options` (Ollama has
    none: the model decides, 'auto'): 'auto', 'none', 'required', or a tool's name."""
    options = dict(req.options or {})
    tool_choice = options.pop("tool_choice", None) if chat else None     # docs/clients.md
    fields, max_tokens, stop = options_from(state, options, notes)
    ns = SimpleNamespace(**dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed")))
    ns.__dict__.update(fields, stop=stop)
    tools = getattr(req, "tools", None) if chat else None
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    body = SimpleNamespace(tools=tools if tools else None, tool_choice=tool_choice if tools else None,
                           parallel_tool_calls=None, response_format=response_format_of(req.format), json_schema=None)
    structure = await handling.vet_structure(state, structure_options(body, chat=chat))
    return Parts(ns, max_tokens, structure)


def job_of(state, request, parts: Parts, *, messages: list[dict] | None = None, prompt: str | None = None) -> Job:
    """The scheduler Job of a checked request (messages for a chat template, or a raw prompt): the one call
    into protocol.request_from, whose Request checks every value once more."""
    text = {"messages": messages} if messages is not None else {"prompt": prompt or ""}
    return Job(request_from(parts.fields, parts.structure, max_tokens=parts.max_tokens, **text),
               timeout_s=state.config.timeout_s, client=client_key(request.scope, state.config))
