"""Structured output and tool calling on a real model (smollm2-135m-instruct from the registry), through the
Python API and through the real `edgerun serve` with the official `openai` client.

Every output under a JSON schema parses and validates (jsonschema); tools with tool_choice auto /
required / named / none, streamed and not; a two-turn exchange with a tool result; the incremental
tool-call reader against the whole-answer reader.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from edgerun.constrain.tools import ToolCallStream, parse_tool_calls, parse_tools
from edgerun.registry.cache import cache_dir
from server_harness import ServerProcess, clean_env

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
KEY = "structured-test-key"

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
LIGHT = {"type": "function", "function": {
    "name": "turn_on", "description": "Turn on a light",
    "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}},
                   "required": ["room"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]


@pytest.fixture(scope="module")
def pulled():
    r = CliRunner().invoke(main, ["pull", MODEL])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def rt(pulled):
    from edgerun import load

    with load(MODEL, draft="none", pull=False, n_ctx=1024) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def oai(pulled):
    srv = ServerProcess(["--model", MODEL, "--no-pull", "--draft", "lookup", "--threads", "2", "--ctx", "1024",
                         "--api-key", KEY], env=clean_env(cache_dir()))
    srv.wait_ready(timeout=300)        # the first start measures the cost curve (cached after)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert srv.terminate() == 0, srv.output


# ---------------------------------------------------------------- Python API

@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate(rt, seed):
    c = rt.chat([{"role": "user", "content": "Invent a person. Answer in JSON."}], json_schema=PERSON,
                max_tokens=80, temperature=0.8, seed=seed)
    assert c.finish_reason == "eos", c.text
    jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_and_lark_grammars(rt):
    c = rt.generate("The answer, yes or no:", grammar=r" ?(yes|no)\.", max_tokens=8, temperature=0)
    assert c.text.strip() in ("yes.", "no.") and c.finish_reason == "eos"
    lark = 'start: " " NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/'
    c = rt.generate("Arithmetic:", grammar=lark, max_tokens=20, temperature=0)
    a, b, s = (int(x) for x in c.text.replace("+", " ").replace("=", " ").split())
    assert c.finish_reason == "eos"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse(rt, choice):
    c = rt.chat(ASK, tools=[WEATHER, LIGHT], tool_choice=choice, parallel_tool_calls=False, max_tokens=80,
                temperature=0)
    assert c.finish_reason == "tool_calls", c.text
    (call,) = c.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LIGHT)}
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), tools[call["function"]["name"]])
    assert c.message()["tool_calls"] == c.tool_calls


def test_tool_choice_none_is_plain_text(rt):
    c = rt.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    assert c.tool_calls is None and c.finish_reason in ("eos", "length")


def test_stream_reader_matches_the_whole_answer_reader(rt):
    """The incremental reader (server streaming) yields the calls the whole-answer reader finds."""
    tools = parse_tools([WEATHER, LIGHT])
    steps = list(rt.chat_stream(ASK, tools=[WEATHER, LIGHT], tool_choice="required", parallel_tool_calls=False,
                                max_tokens=120, temperature=0.7, seed=3))
    text = "".join(s.text for s in steps)
    reader = ToolCallStream(tools)
    events = [e for s in steps for e in reader.feed(s.text)] + list(reader.finish())
    _, whole = parse_tool_calls(text, tools)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    args = "".join(e[2] for e in events if e[0] == "arguments" and e[1] == 0)
    assert json.loads(args) == json.loads(whole[0]["function"]["arguments"])
    assert not [e for e in events if e[0] == "content"]


# ---------------------------------------------------------------- the server, the official client

def _tools_by_name():
    return {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LIGHT)}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "turn_on"}}])
def test_openai_client_tool_calls(oai, choice):
    parallel = choice == "auto"           # parallel calls (OpenAI's default): a small model may repeat them
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, LIGHT], tool_choice=choice,
                                    parallel_tool_calls=parallel, max_tokens=100, temperature=0)
    ch = r.choices[0]
    if choice == "auto" and not ch.message.tool_calls:          # the model may answer in text
        assert ch.finish_reason in ("stop", "length") and ch.message.content
        return
    assert ch.finish_reason == ("tool_calls" if not parallel else ch.finish_reason)
    assert ch.finish_reason in ("tool_calls", "length")
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _tools_by_name()[call.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in ch.message.tool_calls} == {"turn_on"}


def test_openai_client_tool_choice_none(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                    max_tokens=16, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_openai_client_streamed_tool_calls(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, LIGHT], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=100, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or ():
            if tc.id is not None:                  # the first chunk of a call
                assert tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    jsonschema.validate(json.loads(call["arguments"]), _tools_by_name()[call["name"]])
    # the same request, not streamed, gives the same call (greedy)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, LIGHT], tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=100, temperature=0)
    whole = r.choices[0].message.tool_calls[0]
    assert (whole.function.name, json.loads(whole.function.arguments)) == (call["name"], json.loads(call["arguments"]))


def test_openai_client_two_turns_with_a_tool_result(oai):
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=80, temperature=0)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=40, temperature=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    alone = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20      # the call and its result are in the prompt


def test_openai_client_response_format_json_schema(oai):
    for stream in (False, True):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80,
                  temperature=0.7, seed=5,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                          "strict": True}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            text = oai.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


def test_openai_client_bad_schema_is_a_400_and_the_server_keeps_serving(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}})
    assert e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, tools=[{"type": "function",
                                                                                    "function": {"name": "a b"}}])
    # a grammar the model cannot finish within max_tokens: 'length', and the next request is served
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "length"
    assert oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices[0].message.content is not None


def test_a_corrupt_cached_model_is_noticed_by_serve(pulled, tmp_path):
    """Issue 20: same-size corruption of a cached registry file (SD-card bit rot) passes every load check;
    serve re-hashes it in the background after loading, logs it loudly and /health answers 503."""
    import shutil
    import time

    import httpx

    from edgerun.registry.cache import cached_path

    src = cached_path(MODEL)
    home = tmp_path / "home"
    dest = home / src.relative_to(cache_dir())
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as f:                  # flip one byte of tensor data, far from the header
        f.seek(dest.stat().st_size - 4096)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    srv = ServerProcess(["--model", MODEL, "--no-pull", "--draft", "none", "--threads", "1", "--ctx", "256"],
                        env=clean_env(home))
    try:
        deadline = time.monotonic() + 120
        r = None
        while time.monotonic() < deadline:
            r = httpx.get(srv.url + "/health")
            if r.json()["status"] == "corrupt_model":
                break
            time.sleep(0.5)
        assert r is not None and r.status_code == 503 and r.json()["integrity"] == {MODEL: "corrupt"}, r.text
        assert f"CACHED MODEL {MODEL} IS CORRUPT" in srv.output and f"edgerun pull {MODEL} --verify" in srv.output
    finally:
        srv.terminate()
