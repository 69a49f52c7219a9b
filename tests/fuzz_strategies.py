"""Hypothesis strategies for hostile grammars and request bodies, shared by tests/test_fuzz.py (a few
seconds in CI) and bench/fuzz.py (as long as you like). They aim at what hurts a grammar engine:
deep nesting, recursion through $ref, wide alternations, huge and nested counted repetitions."""

from __future__ import annotations

from hypothesis import strategies as st

COUNTS = st.one_of(st.integers(0, 12), st.integers(0, 5000), st.sampled_from([1000, 10**6, 2**31]))

# --- regular expressions ------------------------------------------------------------------------------------

_ATOMS = st.sampled_from(["a", "b", "\\d", "\\w", ".", "[a-z]", "[^x]", "\\.", "é", "(?:x)", "\\{", "{"])


def _quantified(inner: st.SearchStrategy) -> st.SearchStrategy:
    def wrap(r: str, q: str) -> str:
        return f"({r}){q}"
    quant = st.one_of(st.sampled_from(["*", "+", "?", ""]),
                      st.builds(lambda m: f"{{{m}}}", COUNTS),
                      st.builds(lambda m, n: f"{{{m},{m + n}}}", COUNTS, COUNTS),
                      st.builds(lambda m: f"{{{m},}}", COUNTS))
    return st.builds(wrap, inner, quant)


REGEX = st.recursive(_ATOMS, lambda inner: st.one_of(
    _quantified(inner),
    st.builds(lambda a, b: a + b, inner, inner),
    st.builds(lambda xs: "(" + "|".join(xs) + ")", st.lists(inner, min_size=1, max_size=6)),
    st.builds(lambda r, n: "(" * n + r + ")" * n, inner, st.integers(1, 400)),
), max_leaves=12)


# --- JSON schemas ------------------------------------------------------------------------------------------

_LEAF_SCHEMAS = st.one_of(
    st.sampled_from([{"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"type": "number"},
                     {"type": "null"}, {}, True, {"const": "x"}, {"type": "integer", "minimum": -5, "maximum": 10**9}]),
    st.builds(lambda p: {"type": "string", "pattern": p}, REGEX),
    st.builds(lambda n: {"type": "string", "maxLength": n}, COUNTS),
    st.builds(lambda n: {"type": "string", "minLength": n}, COUNTS),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.text(max_size=6), min_size=1, max_size=50)),
)


def _extend(inner: st.SearchStrategy) -> st.SearchStrategy:
    props = st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=6)
    return st.one_of(
        st.builds(lambda s, lo, hi: {"type": "array", "items": s, "minItems": lo, "maxItems": lo + hi},
                  inner, COUNTS, COUNTS),
        st.builds(lambda ps, req: {"type": "object", "properties": ps, "required": list(ps)[:req]},
                  props, st.integers(0, 6)),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=5)),
        st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda s: {"type": "object", "additionalProperties": s}, inner),
    )


SCHEMA = st.recursive(_LEAF_SCHEMAS, _extend, max_leaves=25)


def _chain(n: int, kind: str) -> dict:
    if kind == "ref":
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}
    if kind == "recursive":
        return {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}},
                "$ref": "#/$defs/t"}
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {"items": s} if kind == "items" else {"anyOf": [s, {"type": "string"}]}
    return s


DEEP_SCHEMA = st.builds(_chain, st.integers(1, 3000), st.sampled_from(["ref", "items", "anyOf", "recursive"]))


def _fanout(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                       "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


ANY_SCHEMA = st.one_of(SCHEMA, DEEP_SCHEMA, st.builds(_fanout, st.integers(1, 40)))


# --- Lark grammars -------------------------------------------------------------------------------------------

def _lark(n_rules: int, width: int, rep: int, chain: bool, regex: str) -> str:
    lines = ["start: r0"]
    for i in range(n_rules):
        nxt = f"r{i + 1}" if i + 1 < n_rules else '"end"'
        if chain:
            lines.append(f"r{i}: {nxt}")
        else:
            alts = " | ".join(f'"w{i}_{j}"' for j in range(width))
            lines.append(f"r{i}: ({alts}) {nxt}{{0,{rep}}}" if rep else f"r{i}: ({alts}) {nxt}")
    lines.append(f"T: /{regex.replace('/', '')}/")
    lines[0] = "start: r0 T?"
    return "\n".join(lines)


LARK = st.builds(_lark, st.integers(1, 6000), st.integers(1, 300), st.one_of(st.just(0), COUNTS), st.booleans(), REGEX)


# --- request bodies -----------------------------------------------------------------------------------------

JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)

_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "stop", "stream", "stream_options", "seed", "n", "response_format", "json_schema", "tools",
           "tool_choice", "parallel_tool_calls", "user", "logprobs", "logit_bias", "repeat_penalty", "gamma"]

# JSON nested deep and sent as *text*, where a field takes a JSON string (a schema, a tool call's arguments):
# it reaches a JSON parser of its own, past the body's nesting limit
DEEP_JSON_TEXT = st.builds(lambda n, kind: ("[" * n + "]" * n) if kind == "list" else
                           ('{"items": ' * n + "{}" + "}" * n) if kind == "items" else
                           ('{"anyOf": [' * n + "{}" + "]}" * n), st.integers(1, 20_000),
                           st.sampled_from(["list", "items", "anyOf"]))

_TOOL_CALL = st.builds(lambda a: [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": a}}],
                       st.one_of(DEEP_JSON_TEXT, st.text(max_size=20)))

_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                  "content": st.one_of(st.text(max_size=30), JSON_VALUE)},
                                 optional={"name": st.text(max_size=5), "tool_calls": st.one_of(_TOOL_CALL, JSON_VALUE),
                                           "tool_call_id": st.text(max_size=5)})

_FIELD_VALUES = {
    "messages": st.one_of(st.lists(_MESSAGE, max_size=4), JSON_VALUE),
    "max_tokens": st.one_of(st.integers(-5, 10), JSON_VALUE),
    "response_format": st.one_of(
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                  st.one_of(ANY_SCHEMA, DEEP_JSON_TEXT)),
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "nope"}]), JSON_VALUE),
    "json_schema": st.one_of(SCHEMA, DEEP_JSON_TEXT, JSON_VALUE),
    "tools": st.one_of(st.lists(st.builds(lambda s: {"type": "function", "function": {"name": "f", "parameters": s}},
                                          SCHEMA), max_size=2), JSON_VALUE),
    "stream": st.booleans(),
}


def _body(fields: dict) -> dict:
    fields.setdefault("max_tokens", 3)
    if "prompt" not in fields:
        fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return fields


RANDOM_BODY = st.builds(_body, st.dictionaries(
    st.sampled_from(_FIELDS), st.deferred(lambda: JSON_VALUE), max_size=6)).flatmap(
    lambda base: st.fixed_dictionaries({k: _FIELD_VALUES.get(k, st.just(v)) for k, v in base.items()}))


def _chat(extra: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def _history(args: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 3,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


# a well-formed request with one hostile part, so that the part reaches the code that parses it (a random
# body is mostly refused by its first malformed field)
HOSTILE_BODY = st.one_of(
    st.builds(lambda s, stream: _chat({"stream": stream, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
              st.one_of(ANY_SCHEMA, DEEP_JSON_TEXT), st.booleans()),
    st.builds(lambda s: {"prompt": "x", "max_tokens": 3, "json_schema": s}, st.one_of(SCHEMA, DEEP_JSON_TEXT)),
    st.builds(lambda s: _chat({"tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
                               "tool_choice": "required"}), SCHEMA),
    st.builds(_history, st.one_of(DEEP_JSON_TEXT, st.text(max_size=20))),
    st.builds(lambda p: _chat({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": p}}}}), REGEX),
)

REQUEST_BODY = st.one_of(RANDOM_BODY, HOSTILE_BODY)
