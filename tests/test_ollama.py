"""Ollama's API on the real `edgerun serve`, driven by Ollama's own Python client (PyPI `ollama`): chat and
generate, streamed and not; `format` with a JSON schema (the answer validates); a tool call answered as
message.tool_calls; tags / show / ps / version; names with and without `:latest`; options Ollama's
clients send routinely (num_ctx, mirostat, ...) never refused; bad requests get Ollama's {"error": ...}
with the right status and the server keeps serving; the API key is enforced; a second port for Ollama's
clients (--ollama-port); /api/pull refused unless allowed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from edgerun.registry.cache import cache_dir
from server_fixtures import ollama_server
from server_harness import ServerProcess, clean_env

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0, "num_predict": 24}



@pytest.fixture(scope="module")
def server():
    srv = ollama_server(MODEL, "--draft", "lookup", "--threads", "2", "--ctx", "1024",
                       "--api-key", KEY, "--max-body", "64")
    yield srv
    assert srv.terminate() == 0, srv.output


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


def _error(call) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as info:
        call()
    return info.value


def test_chat_not_streamed(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], stream=False, options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and r.message.content.strip()
    assert r.eval_count >= 1 and r.prompt_eval_count > 5 and r.total_duration > 0


def test_chat_streamed_carries_the_same_text(client):
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat(model=MODEL, messages=msgs, stream=False, options=GREEDY)
    parts = list(client.chat(model=MODEL, messages=msgs, stream=True, options=GREEDY))
    assert len(parts) >= 3 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


@pytest.mark.parametrize("stream", [False, True])
def test_generate(client, stream):
    kw = dict(model=MODEL + ":latest", prompt="The capital of France is", options=GREEDY)
    if stream:
        parts = list(client.generate(stream=True, **kw))
        text, last = "".join(p.response for p in parts), parts[-1]
        assert len(parts) >= 3
    else:
        last = client.generate(stream=False, **kw)
        text = last.response
    assert last.done and text.strip() and last.eval_count >= 1


def test_generate_raw_and_system(client):
    raw = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    assert raw.response.strip()
    pirate = "You are a pirate. " * 30
    sys_ = client.generate(model=MODEL, prompt="Who are you?", system=pirate, options=GREEDY)
    plain = client.generate(model=MODEL, prompt="Who are you?", options=GREEDY)
    assert sys_.prompt_eval_count > plain.prompt_eval_count + 100   # the system prompt reached the template


@pytest.mark.parametrize("seed", range(3))
def test_format_schema_answer_validates(client, seed):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
                    format=PERSON, options={"temperature": 0.8, "seed": seed, "num_predict": 120})
    jsonschema.validate(json.loads(r.message.content), PERSON)


def test_format_json_streamed_parses(client):
    parts = list(client.generate(model=MODEL, prompt='Give a JSON object with one key "color": the colour of the sky.',
                                 format="json", stream=True, options={"temperature": 0, "num_predict": 200}))
    assert parts[-1].done_reason == "stop"
    assert isinstance(json.loads("".join(p.response for p in parts)), dict)


def test_tool_choice_none_answers_in_text(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                    tools=[WEATHER], options={**GREEDY, "tool_choice": "none"})
    assert not r.message.tool_calls and r.message.content.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call(client, stream):
    # SmolLM2-135M never calls a tool by itself (Ollama's only mode, 'auto'): edgerun's own option tool_choice
    # asks for a call, which the grammar then keeps to the tool's schema
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER],
              options={"temperature": 0, "num_predict": 60, "tool_choice": "required"})
    if stream:
        parts = list(client.chat(stream=True, **kw))
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
    else:
        calls = client.chat(**kw).message.tool_calls or []
    assert calls
    for call in calls:                   # one, or more: Ollama's clients take parallel calls
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    call = calls[0]
    # the call and its result go back in Ollama's shape (arguments an object, tool_name)
    follow = client.chat(model=MODEL, options=GREEDY, tools=[WEATHER], messages=[
        *msgs, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}', "tool_name": "get_weather"}])
    assert follow.done


def test_tags_show_ps_version(client, server):
    (m,) = client.list().models
    assert m.model == MODEL + ":latest" and m.size > 50_000_000 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.quantization_level
    shown = client.show(MODEL)
    assert "{%" in shown.template and shown.details.family == "llama" and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    (running,) = client.ps().models
    assert running.model == MODEL + ":latest" and running.size == m.size
    v = httpx.get(server.url + "/api/version", headers=AUTH).json()
    assert v["version"].count(".") == 2 and "edgerun" in v


def test_options_ollama_clients_send_are_never_refused(server):
    body = {"model": MODEL, "prompt": "Hi", "stream": False, "keep_alive": "5m",
            "options": {"num_ctx": 8192, "num_thread": 3, "mirostat": 2, "repeat_last_n": 64, "temperature": 7e9,
                        "top_p": 3, "num_predict": 8, "seed": -1, "something_new": True}}
    r = httpx.post(server.url + "/api/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    note = r.headers["x-edgerun-options"]
    for word in ("num_ctx=8192 ignored", "temperature=7000000000.0 clamped to 100.0", "top_p=3 clamped to 1.0",
                 "mirostat ignored", "something_new ignored (unknown)", "keep_alive accepted"):
        assert word in note, note
    assert r.json()["eval_count"] <= 8


def test_an_empty_request_loads_the_model(server):
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL}, headers=AUTH)
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    r = httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": [], "keep_alive": 0}, headers=AUTH)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]}, 404, "not found"),
    ("/api/chat", {"model": MODEL + ":7b", "messages": [{"role": "user", "content": "hi"}]}, 404, "not found"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model is required"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "format": "yaml"}, 400,
     "invalid format"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": []}, 400, "options"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"type": "function"}]}, 400, "tools"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20000}]}, 400, "context"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "context": [1, 2, 3]}, 400, "context"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "images"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
    ("/api/pull", {"model": MODEL}, 403, "--allow-pull"),
    ("/api/create", {"model": "x"}, 501, "not supported"),
    ("/api/embed", {"model": MODEL, "input": "hi"}, 501, "not supported"),
    ("/api/nothing", {}, 404, "not found"),
])
def test_bad_requests_get_ollamas_error_shape(server, path, body, status, words):
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err, str) and words.lower() in err.lower(), err


def test_bad_json_and_a_huge_body(server):
    r = httpx.post(server.url + "/api/chat", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]},
                   headers=AUTH)
    assert r.status_code == 413 and "limit" in r.json()["error"]


def test_the_client_sees_a_clear_error_and_the_server_keeps_serving(client):
    e = _error(lambda: client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}]))
    assert e.status_code == 404 and "not found" in e.error
    e = _error(lambda: client.chat(model=MODEL, messages=[{"role": "robot", "content": "hi"}]))
    assert e.status_code == 400 and "role" in e.error
    assert client.generate(model=MODEL, prompt="Hi", options=GREEDY).done


def test_the_api_key_is_enforced(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        c = ollama.Client(host=server.url, headers=headers)
        e = _error(lambda: c.list())
        assert e.status_code == 401 and "API key" in e.error
        e = _error(lambda: c.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}]))
        assert e.status_code == 401
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "hi"},
                   headers={**AUTH, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "not allowed" in r.json()["error"]


def test_the_ollama_port_serves_the_same_api(server):
    c = ollama.Client(host=server.ollama_url, headers=AUTH, timeout=120)
    assert c.list().models[0].model == MODEL + ":latest"
    assert c.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options=GREEDY).done
    assert httpx.get(server.ollama_url + "/health").json()["status"] == "ok"
    assert "for Ollama's clients" in server.output


def test_pull_with_allow_pull_streams_ollamas_progress(server):
    srv = ServerProcess(["--model", MODEL, "--no-pull", "--draft", "none", "--threads", "1", "--ctx", "256",
                         "--allow-pull"], env=clean_env(cache_dir()))
    try:
        c = ollama.Client(host=srv.url, timeout=120)
        statuses = [p.status for p in c.pull(MODEL + ":latest", stream=True)]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
        e = _error(lambda: c.pull("no-such-model"))
        assert e.status_code == 404 and "not found" in e.error
    finally:
        assert srv.terminate() == 0, srv.output
