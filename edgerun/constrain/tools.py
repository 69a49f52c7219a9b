"""OpenAI tool calling on a local model: the tools' grammar, the prompt, and reading calls back.

The model is asked (by its chat template, or by a system message where the template knows no
tools) to answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the
Hermes / Qwen2.5 convention. The grammar is lazy under tool_choice "auto": free text until the
`<tool_call>` trigger, then the body is constrained to {"name": one of the tools, "arguments":
that tool's parameters schema}; under "required" or a named tool it is constrained from the first
token. Calls are read back from the text; a fenced or bare JSON object naming a tool is accepted
too (small models write those when no grammar holds them).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..errors import InvalidArgument
from ..util import jsontext
from .grammar import JSON_OPTIONS, Grammar, special_token_name
from .limits import check_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                     # 'auto' | 'none' | 'required'
    name: str | None = None       # a named tool (mode 'required')


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI `tools` ([{'type': 'function', 'function': {'name', 'description', 'parameters'}}]) -> Tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidArgument(f"'tools' must be a list of tool objects, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS} are accepted")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidArgument(f"{where} must be an object, got {t!r:.60}")
        if t.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type must be 'function', got {t.get('type')!r:.60}")
        fn = t.get("function", t if "name" in t else None)
        if not isinstance(fn, dict):
            raise InvalidArgument(f"{where} needs a 'function' object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                  f"got {name!r:.60}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidArgument(f"{where}.function.parameters must be a JSON schema of type 'object', "
                                  f"got {params!r:.60}")
        try:                    # the limits of a schema from a request (limits.py): depth, size, repetitions
            check_schema(params)
        except InvalidArgument as e:
            raise InvalidArgument(f"{where}.function.parameters: {e}") from None
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise InvalidArgument(f"{where}.function.description must be a string")
        if any(o.name == name for o in out):
            raise InvalidArgument(f"{where}: two tools are named {name!r}")
        out.append(Tool(name, desc, params))
    return out


def parse_tool_choice(choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidArgument(f"tool_choice must be 'auto', 'none', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.60}")
        if choice != "none" and not tools:
            raise InvalidArgument(f"tool_choice {choice!r} needs 'tools'")
        return ToolChoice(choice)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidArgument("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in {t.name for t in tools}:
            raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools "
                                  f"{sorted(t.name for t in tools)}")
        return ToolChoice("required", name)
    raise InvalidArgument(f"tool_choice must be a string or an object, got {type(choice).__name__}")


# ---------------------------------------------------------------------------------- grammar

def call_schema(tools: Sequence[Tool]) -> dict:
    """{"name": one of the tools, "arguments": its parameters}, name first, on one line. Arguments hold
    the declared parameters only, unless a tool's schema sets additionalProperties itself. Each tool's
    `$defs` (or `definitions`) move to the root, renamed t<i>_<name>, and its `$ref`s follow them:
    nested under `arguments`, "#/$defs/Item" would point nowhere (pydantic writes tools that way)."""
    defs: dict = {}
    options = []
    for i, t in enumerate(tools):
        params = _hoist_defs(t.parameters, f"t{i}_", defs)
        options.append({"type": "object", "properties": {"name": {"const": t.name},
                                                         "arguments": {"additionalProperties": False, **params}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_OPTIONS}


_DEFS = ("$defs", "definitions")


def _hoist_defs(params: dict, prefix: str, defs: dict) -> dict:
    """`params` without its root `$defs`/`definitions`, which go into `defs` as prefix + name, with every
    local `$ref` to them rewritten (params passed limits.check_schema: nested at most 128 schemas deep)."""
    if not any(isinstance(params.get(k), dict) for k in _DEFS):
        return params

    def ref(r: str) -> str:
        for k in _DEFS:
            head = f"#/{k}/"
            if r.startswith(head):
                return f"#/$defs/{prefix}{r[len(head):]}"
        return r

    def walk(node):
        if isinstance(node, dict):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else walk(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    for k in _DEFS:
        if isinstance(params.get(k), dict):
            defs.update({prefix + name: walk(d) for name, d in params[k].items()})
    return walk({k: v for k, v in params.items() if k not in _DEFS})


def tool_grammar(tools: Sequence[Tool], choice: ToolChoice, *, parallel: bool = True,
                 special_ids: tuple[int, int] | None = None) -> Grammar | None:
    """The Lark grammar of an answer under tool_choice. special_ids: the token ids of <tool_call> and
    </tool_call> where the vocabulary has them as single special tokens (Qwen2.5), else they are text."""
    if choice.mode == "none" or not tools:
        return None
    chosen = [t for t in tools if choice.name in (None, t.name)]
    schema = json.dumps(call_schema(chosen), separators=(",", ":"))
    if special_ids is not None:
        open_, close = f"<[{special_ids[0]}]>", f"<[{special_ids[1]}]>"
    else:
        open_, close = json.dumps(OPEN), json.dumps(CLOSE)
    more = ' ("\\n" call)*' if parallel else ""
    lines = ["%llguidance {}"]
    if choice.mode == "required":
        lines += [f"start: call{more}", f'call: {open_} "\\n" %json {schema} "\\n" {close}']
    elif special_ids is not None:
        # free text, then calls: the trigger is a token of its own, never part of the text
        lines += ["start: TEXT | TEXT? calls", f"calls: call{more}",
                  f'call: {open_} "\\n" %json {schema} "\\n" {close}', "TEXT: /(.|\\n)+/"]
    else:
        # free text until the trigger string (a lazy lexeme: it ends at the first <tool_call>)
        lines += ["start: TEXT | calls", f"calls: first{more.replace('call', 'body_call')}",
                  "first: trig body", f"body_call: {open_} body", f"trig[lazy]: TEXT {open_}",
                  f'body: "\\n" %json {schema} "\\n" {close}', "TEXT: /(.|\\n)*/"]
    return Grammar("tools", Grammar.lark("\n".join(lines)).source, "the tools' call grammar")


def special_tag_ids(tokenizer) -> tuple[int, int] | None:
    """Token ids of <tool_call> and </tool_call> if both are single special tokens of this vocabulary."""
    if not (special_token_name(tokenizer, OPEN) and special_token_name(tokenizer, CLOSE)):
        return None
    return (tokenizer.tokenize(OPEN, special=True, add_bos=False)[0],
            tokenizer.tokenize(CLOSE, special=True, add_bos=False)[0])


# ---------------------------------------------------------------------------------- prompt

def _tools_system_text(tools: Sequence[Tool]) -> str:
    sigs = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, one JSON object per line:\n<tools>\n" + sigs +
            "\n</tools>\nTo call a function, answer only with\n" + OPEN +
            '\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n' + CLOSE +
            "\nA function's result comes back in <tool_response></tool_response>.")


def _call_text(call: dict) -> str:
    fn = call["function"]
    return f'{OPEN}\n{json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)}\n{CLOSE}'


def chat_messages(messages: Sequence[dict], tools: Sequence[Tool], template_knows_tools: bool) -> list[dict]:
    """Messages as the chat template gets them: assistant tool calls with their arguments as objects
    (templates write them with tojson); for a template that knows no tools, the tools described in
    the system message, calls written as <tool_call> text and tool results as user turns."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if m.get("role") != "assistant":
                raise InvalidArgument(f"message {i}: only assistant messages carry tool_calls")
            m["tool_calls"] = [_normal_call(c, i, j) for j, c in enumerate(calls)]
            m["content"] = m.get("content") or ""
        if m.get("role") == "tool" and not isinstance(m.get("content"), str):
            raise InvalidArgument(f"message {i}: a tool message needs a string 'content' (the tool's result)")
        if not template_knows_tools:
            if m.get("tool_calls"):
                text = "\n".join(_call_text(c) for c in m.pop("tool_calls"))
                m["content"] = (m["content"] + "\n" if m["content"] else "") + text
            if m.get("role") == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not template_knows_tools:
        text = _tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _normal_call(call: Any, i: int, j: int) -> dict:
    where = f"message {i} tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidArgument(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = jsontext.loads(args, f"{where}.function.arguments") if args.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{where}.function.arguments is not valid JSON: {e.msg}") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---------------------------------------------------------------------------------- reading calls

def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _as_call(obj: Any, names: set[str]) -> dict | None:
    if not (isinstance(obj, dict) and obj.get("name") in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


_FENCED = re.compile(r"^\s*```(?:json)?\s*(\{.*\})\s*```\s*$", re.DOTALL)


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[str | None, list[dict]]:
    """Split a model's answer into (content, OpenAI tool_calls). Calls come from <tool_call> blocks, or
    from a whole answer that is a fenced or bare JSON object naming a tool."""
    names = {t.name for t in tools}
    calls: list[dict] = []
    rest: list[str] = []
    pos = 0
    for m in re.finditer(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text, re.DOTALL):
        body = m.group(1).strip()
        try:
            call = _as_call(jsontext.loads(_FENCED.sub(r"\1", body), "a tool call"), names)
        except (json.JSONDecodeError, InvalidArgument):     # not JSON, or nested past the limit: text
            call = None
        if call is None:
            if not m.group(0).endswith(CLOSE):   # a call cut short at the end of the answer: dropped
                rest.append(text[pos:m.start()])
                pos = m.end()
            continue                          # not a call (another tool's name, not JSON): left as text
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    rest.append(text[pos:])
    content = "".join(rest).strip()
    if not calls and content:
        m = _FENCED.match(content)
        candidate = m.group(1) if m else content
        if candidate.startswith("{"):
            try:
                call = _as_call(jsontext.loads(candidate, "a tool call"), names)
            except (json.JSONDecodeError, InvalidArgument):
                call = None
            if call is not None:
                return None, [call]
    return (content or None), calls


class ToolCallStream:
    """Incremental reader of a streamed answer: feed() text as it comes, get OpenAI-style events.

    Events: ('content', text) | ('call', index, id, name) | ('arguments', index, fragment).
    Text that may begin a <tool_call> is held back until it is known not to; an answer that starts
    like a JSON object is held to the end (it may be a bare call)."""

    _HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.DOTALL)

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = list(tools)
        self.calls: list[dict] = []
        self._buf = ""                 # text not yet turned into events
        self._in_call = False
        self._args: list[str] = []     # the current call's argument text
        self._depth, self._in_str, self._esc, self._args_done = 0, False, False, False
        self._all_text: list[str] = []   # content so far (for the held-to-the-end case)
        self._held_json = None           # None: undecided; True: holding a JSON answer; False: plain text

    def feed(self, text: str) -> Iterator[tuple]:
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i >= 0:
                    yield from self._content(self._buf[:i])
                    self._buf = self._buf[i + len(OPEN):]
                    self._start_call()
                    continue
                keep = max((k for k in range(1, len(OPEN)) if self._buf.endswith(OPEN[:k])), default=0)
                yield from self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            if self._name is None:
                m = self._HEAD.match(self._buf)
                if not m:
                    return
                self._name = json.loads('"' + m.group(1) + '"')
                self._buf = self._buf[m.end():]
                idx = len(self.calls)
                self.calls.append({"id": new_call_id(), "type": "function",
                                   "function": {"name": self._name, "arguments": ""}})
                yield ("call", idx, self.calls[-1]["id"], self._name)
            if not self._args_done:
                frag = self._scan_args()
                if frag:
                    self.calls[-1]["function"]["arguments"] += frag
                    yield ("arguments", len(self.calls) - 1, frag)
                if not self._args_done:
                    return
            j = self._buf.find(CLOSE)
            if j < 0:
                return
            self._buf = self._buf[j + len(CLOSE):]
            self._in_call = False

    def _start_call(self) -> None:
        self._in_call, self._name = True, None
        self._depth, self._in_str, self._esc, self._args_done = 0, False, False, False

    def _scan_args(self) -> str:
        """Consume the arguments' JSON text from the buffer up to where its value ends."""
        out = []
        i = 0
        buf = self._buf
        while i < len(buf):
            ch = buf[i]
            if self._depth == 0 and not out and ch.isspace():
                i += 1
                continue
            out.append(ch)
            i += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_done = True
                    break
        self._buf = buf[i:]
        return "".join(out)

    def _content(self, text: str) -> Iterator[tuple]:
        if not text:
            return
        if self._held_json is None and not self.calls:
            stripped = "".join(self._all_text + [text]).lstrip()
            if not stripped or (len(stripped) < 3 and "```".startswith(stripped)):
                self._all_text.append(text)              # undecided yet
                return
            self._held_json = stripped.startswith("{") or stripped.startswith("```")
            if not self._held_json:
                text = "".join(self._all_text) + text
                self._all_text = []
        if self._held_json:
            self._all_text.append(text)
            return
        yield ("content", text)

    def finish(self) -> Iterator[tuple]:
        """End of the answer: release what was held (a held JSON answer becomes a call if it is one)."""
        if not self._in_call and self._buf:
            yield from self._content(self._buf)
            self._buf = ""
        if self._held_json:
            text = "".join(self._all_text)
            self._all_text = []
            content, calls = parse_tool_calls(text, self.tools)
            if calls and not self.calls:
                for call in calls:
                    idx = len(self.calls)
                    self.calls.append(call)
                    yield ("call", idx, call["id"], call["function"]["name"])
                    yield ("arguments", idx, call["function"]["arguments"])
            elif text:
                yield ("content", text)
        elif self._all_text:
            yield ("content", "".join(self._all_text))
            self._all_text = []
