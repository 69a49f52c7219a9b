"""The one request type (edgerun/request.py): built once at each edge, every check in one place."""

from __future__ import annotations

import dataclasses

import pytest

from edgerun.errors import InvalidArgument
from edgerun.request import MAX_STOP_STRINGS, Request, Structure

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tiny_runtime(tiny_llama):
    from edgerun.runtime import load

    rt = load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=128, n_threads=1)
    yield rt
    rt.close()


def test_a_request_is_frozen_and_holds_exactly_one_input():
    r = Request.build(prompt="hi", max_tokens=3, temperature=0, stop="\n", gamma="2")
    assert r.sampling_kw == {"temperature": 0} and r.stop == ("\n",) and r.gamma == 2 and not r.structure
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_tokens = 5
    for kw in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        with pytest.raises(InvalidArgument, match="exactly one of prompt, messages and prompt_tokens"):
            Request.build(**kw)


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -1}, "temperature"), ({"temperature": 1e9}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"min_p": 1}, "min_p"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"seed": -3}, "seed"), ({"max_tokens": -1}, "max_tokens"), ({"gamma": 99}, "gamma"),
    ({"gamma": "many"}, "gamma"), ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["y" * 300]}, "stop"), ({"tools": "nope"}, "tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "json_schema": {"type": "object"}}, "json_schema"),
])
def test_each_bad_value_is_refused_once_naming_its_option(kw, param):
    with pytest.raises(InvalidArgument) as e:
        Request.build(prompt="hi", **kw)
    assert e.value.param == param, (kw, e.value.param, str(e.value))


def test_unknown_options_are_refused():
    with pytest.raises(InvalidArgument, match="unknown option"):
        Request.build(prompt="hi", temprature=0.5)


def test_structure_parses_tools_once_and_binds_their_grammar_to_a_vocabulary(tiny_runtime):
    s = Structure.parse(tools=[TOOL])
    assert s.reads_calls and s.grammar is None and s.tools[0].name == "get_weather"
    bound = s.bind(tiny_runtime.tokenizer)
    assert bound.grammar is not None and bound.grammar.kind == "tools" and bound.bind(None) is bound
    assert not Structure.parse(tools=[TOOL], tool_choice="none")        # 'none': no tools shown, no grammar
    assert Structure.parse(json_schema={"type": "object"}).grammar.kind == "json_schema"
    # response_format 'text' beside tools is no structure of its own
    assert Structure.parse(tools=[TOOL], response_format={"type": "text"}).reads_calls


def test_the_runtime_runs_a_request_and_caps_it_by_the_context(tiny_runtime):
    r = Request.build(prompt="hello", max_tokens=4, temperature=0)
    c = tiny_runtime.complete(r)
    assert c.n_tokens <= 4 and c.finish_reason in ("length", "eos", "stop")
    plan = tiny_runtime.prepare(Request.build(prompt="hello"))
    steps = list(tiny_runtime.start(Request.build(prompt="hello", temperature=0), plan=plan))
    assert len(steps) <= tiny_runtime.n_ctx - len(plan.prompt_tokens)          # no max_tokens: the context's room
    with pytest.raises(InvalidArgument, match="out of range") as e:
        tiny_runtime.prepare(Request.build(prompt_tokens=[0, 10 ** 9]))
    assert e.value.param == "prompt"
