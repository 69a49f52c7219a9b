"""`edgerun serve` over real HTTP: the server (uvicorn) on a loopback port with a tiny GGUF, driven by
httpx and by the official openai client: chat, completions, streaming, stop strings, the bad-input
suite; then queueing, cancellation and time limits on an in-process server whose real Runtime can be
held at a gate."""

from __future__ import annotations

import json
import re
import socket
import threading

import httpx
import openai
import pytest

from edgerun.serve.metrics import GenerationRecord, Metrics
from edgerun.backends.base import common_prefix
from edgerun.runtime import load
from edgerun.serve.settings import ServerConfig
from server_harness import (TINY_ARGS, GatedRuntime, InProcessServer, Meter, ServerProcess, clean_env, sse_events,
                            wait_until)

KEY = "sk-edgerun-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 256
MSGS = [{"role": "user", "content": "Hello there"}]
ERROR_KEYS = {"message", "type", "param", "code"}
# generation slots (continuous batching): every server test runs with one and with four
PARALLEL = pytest.mark.parametrize("parallel", [1, 4], ids=["parallel1", "parallel4"])


# --- the server as users run it: a subprocess -----------------------------------------------------

@pytest.fixture(scope="module", params=[1, 4], ids=["parallel1", "parallel4"])
def server(tiny_llama, tmp_path_factory, request):
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key", KEY, "--max-body", "64", "--queue", "4",
                         "--parallel", request.param], env=clean_env(tmp_path_factory.mktemp("home")))
    srv.wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.output


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def stream_events(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def streamed_text(chunks: list, chat: bool) -> str:
    if chat:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_health_is_open_and_the_api_needs_the_key(server, http, model):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(server.url + "/v1/models")
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [model]


def test_chat_completion_shape(http, model):
    r = http.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == model
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 5 and 0 <= usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 12
    ext = body["edgerun"]
    assert ext["finish"] in ("eos", "stop", "length") and ext["max_tokens"] == 12
    for key in ("tokens_per_s", "acceptance_rate", "accept_histogram", "gamma_mean", "queue_wait_s", "t_prefill_s"):
        assert key in ext


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_stream_carries_the_same_text_as_the_plain_response(http, model, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            **({"messages": MSGS} if chat else {"prompt": "the water is"})}
    full = http.post(path, json=body).json()
    chunks = stream_events(http, path, {**body, "stream_options": {"include_usage": True}})
    ident = {c["id"] for c in chunks}
    assert len(ident) == 1 and ident.pop().startswith("chatcmpl-" if chat else "cmpl-")
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    full_text = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    assert streamed_text(chunks, chat) == full_text
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert finals[0]["edgerun"]["finish"] == full["edgerun"]["finish"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def _pick_stop(text: str) -> str:
    for i in range(1, len(text) - 1):
        s = text[i:i + 2]
        if "\ufffd" not in s and s.strip():
            return s
    raise AssertionError(f"no printable two-character stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_strings_cut_the_text(http, model, stream):
    body = {"model": model, "prompt": "the cat sat on", "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = _pick_stop(full)
    expected = full[:full.index(stop)]
    body = {**body, "stop": ["never-appears-9", stop]}
    if stream:
        chunks = stream_events(http, "/v1/completions", body)
        text = streamed_text(chunks, chat=False)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finish == ["stop"]
    else:
        r = http.post("/v1/completions", json=body).json()
        text = r["choices"][0]["text"]
        assert r["choices"][0]["finish_reason"] == "stop" and r["edgerun"]["finish"] == "stop"
    assert text == expected and stop not in text


def test_token_id_prompt(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": [116, 104, 101], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_official_openai_client(oai, model):
    c = oai.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0, seed=7)
    assert isinstance(c.choices[0].message.content, str) and c.usage.completion_tokens <= 8
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.model_extra["edgerun"]["max_tokens"] == 8
    pieces = [ch.choices[0].delta.content or "" for ch in
              oai.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0, stream=True)
              if ch.choices]
    assert "".join(pieces) == c.choices[0].message.content

    t = oai.completions.create(model=model, prompt="the cat", max_tokens=10, temperature=0, top_p=0.9)
    assert isinstance(t.choices[0].text, str) and t.usage.prompt_tokens > 0
    pieces = [ch.choices[0].text for ch in
              oai.completions.create(model=model, prompt="the cat", max_tokens=10, temperature=0, top_p=0.9,
                                     stream=True) if ch.choices]
    assert "".join(pieces) == t.choices[0].text
    assert oai.models.list().data[0].id == model


def test_official_openai_client_errors(server, oai, model):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=4)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 400}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", max_tokens=-1)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.APIError):         # an error inside a stream surfaces as an exception too
        list(oai.completions.create(model=model, prompt="x " * 400, max_tokens=4, stream=True))


# --- the bad-input suite: each gets its status and an OpenAI-style error; the server keeps serving -

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"

BAD_INPUTS = [
    # id, path, body (a dict is merged into a valid body; None deletes a key; bytes are sent raw), status, code, param
    ("malformed-json", CHAT, b'{"model": "m", "messages": [', 400, "invalid_json", None),
    ("not-utf8", CHAT, b'\xff\xfe{"model": 1}', 400, "invalid_json", None),
    ("nan-literal", COMPL, "NaN", 400, "invalid_json", None),
    ("json-array", CHAT, b"[1, 2]", 422, "invalid_type", None),
    ("missing-model", CHAT, {"model": None}, 422, "invalid_type", "model"),
    ("missing-messages", CHAT, {"messages": None}, 422, "invalid_type", "messages"),
    ("max-tokens-string", CHAT, {"max_tokens": "10"}, 422, "invalid_type", "max_tokens"),
    ("max-tokens-float", CHAT, {"max_tokens": 10.5}, 422, "invalid_type", "max_tokens"),
    ("temperature-string", CHAT, {"temperature": "hot"}, 422, "invalid_type", "temperature"),
    ("messages-string", CHAT, {"messages": "hi"}, 422, "invalid_type", "messages"),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 422, "invalid_type", "messages.0.role"),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 422, "invalid_type",
     "messages.0.content"),
    ("prompt-number", COMPL, {"prompt": 5}, 422, "invalid_type", "prompt"),
    ("stream-string", CHAT, {"stream": "yes"}, 422, "invalid_type", "stream"),
    ("stop-number", COMPL, {"stop": 3}, 422, "invalid_type", "stop"),
    ("negative-max-tokens", CHAT, {"max_tokens": -5}, 400, "invalid_value", "max_tokens"),
    ("zero-max-tokens", COMPL, {"max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("negative-max-completion-tokens", CHAT, {"max_completion_tokens": -1}, 400, "invalid_value",
     "max_completion_tokens"),
    ("negative-temperature", CHAT, {"temperature": -0.5}, 400, "invalid_value", "temperature"),
    ("top-p-zero", COMPL, {"top_p": 0}, 400, "invalid_value", "top_p"),
    ("top-p-above-one", COMPL, {"top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("n-two", CHAT, {"n": 2}, 400, "unsupported_parameter", "n"),
    # issue 17: structured output and tools are checked before any token is generated
    ("tool-without-name", CHAT, {"tools": [{"type": "function", "function": {"description": "x"}}]}, 400,
     "invalid_value", "tools"),
    ("tool-parameters-not-object", CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                                     {"type": "array"}}}]},
     400, "invalid_value", "tools"),
    ("tool-choice-unknown-tool", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "invalid_value", "tool_choice"),
    ("tool-choice-without-tools", CHAT, {"tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ("response-format-unknown", CHAT, {"response_format": {"type": "xml"}}, 400, "invalid_value", None),
    ("response-format-bad-schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, 400, "invalid_value", None),
    ("json-schema-bad", COMPL, {"json_schema": {"type": "object", "properties": {"a": {"type": 5}}}}, 400,
     "invalid_value", None),
    ("functions-deprecated", CHAT, {"functions": [{"name": "f"}]}, 400, "unsupported_parameter", "functions"),
    ("empty-messages", CHAT, {"messages": []}, 400, "invalid_value", "messages"),
    ("too-many-stops", COMPL, {"stop": ["a"] * 17}, 400, "invalid_value", "stop"),
    ("prompt-batch", COMPL, {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("token-id-out-of-range", COMPL, {"prompt": [1, 10 ** 6]}, 400, "invalid_value", None),
    ("unknown-model", CHAT, {"model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("prompt-over-context", CHAT, {"messages": [{"role": "user", "content": "hello " * 300}]}, 400,
     "context_length_exceeded", None),
    ("completion-over-context", COMPL, {"prompt": "hello " * 300}, 400, "context_length_exceeded", None),
    # issue 20, defect 2: a lone surrogate was a 500
    ("lone-surrogate-chat", CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "invalid_value", None),
    ("lone-surrogate-system", CHAT, {"messages": [{"role": "system", "content": "\ud800"}, *MSGS]}, 400,
     "invalid_value", None),
    ("lone-surrogate-prompt", COMPL, {"prompt": "\udfff"}, 400, "invalid_value", None),
]


@pytest.mark.parametrize("path, body, status, code, param", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(http, model, path, body, status, code, param):
    valid = {"model": model, "max_tokens": 4, **({"messages": MSGS} if path == CHAT else {"prompt": "hi"})}
    if isinstance(body, dict):
        payload = {k: v for k, v in {**valid, **body}.items() if v is not None}
        # json.dumps escapes non-ASCII (\ud800 stays an escape, as a client's JSON would carry it)
        r = http.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})
    elif body == "NaN":
        r = http.post(path, content=json.dumps(valid)[:-1] + ', "temperature": NaN}',
                      headers={"content-type": "application/json"})
    else:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(r, status, code, param)


def test_huge_body_is_refused(http, model):
    big = {"model": model, "prompt": "a" * (70 * 1024), "max_tokens": 1}
    assert_error(http.post(COMPL, json=big), 413, "request_too_large")

    def chunks():                 # no Content-Length: the limit is enforced while reading
        yield b'{"model": "m", "prompt": "'
        for _ in range(80):
            yield b"a" * 1024
        yield b'"}'

    assert_error(http.post(COMPL, content=chunks(), headers={"content-type": "application/json"}), 413,
                 "request_too_large")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": f"Bearer {KEY}x"}], ids=["missing", "wrong", "basic", "longer"])
def test_missing_or_wrong_api_key(server, model, headers):
    r = httpx.post(server.url + CHAT, json={"model": model, "messages": MSGS}, headers=headers)
    assert_error(r, 401, "invalid_api_key")
    assert_error(httpx.get(server.url + "/metrics", headers=headers), 401, "invalid_api_key")


def test_huge_max_tokens_is_clamped_to_the_context(http, model):
    r = http.post(COMPL, json={"model": model, "prompt": "the cat", "max_tokens": 10 ** 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["edgerun"]["max_tokens"] == CTX - body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] <= body["edgerun"]["max_tokens"]


def test_wrong_method_and_unknown_path(http):
    assert_error(http.get(CHAT), 405, "method_not_allowed")
    assert_error(http.get("/v2/nothing"), 404, "not_found")


def test_client_vanishing_mid_body(server, model):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n".encode()
                     + b'{"model": "' + model.encode() + b'", "prompt": "a')
    # the server notices on its own; the next test checks it logged no traceback and still serves


def test_still_serving_after_the_bad_inputs(server, http, model):
    r = http.post(CHAT, json={"model": model, "messages": MSGS, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert server.proc.poll() is None
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = metrics.text
    assert 'status="500"' not in text and "Traceback" not in server.output
    for status in ("400", "401", "404", "413", "422"):
        assert f'status="{status}"' in text, status
    for name in ("edgerun_tokens_generated_total", "edgerun_tokens_per_second", "edgerun_acceptance_rate",
                 "edgerun_gamma", "edgerun_queue_depth", "edgerun_time_to_first_token_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert "\nedgerun_gamma 0\n" in text                       # no drafter: speculation off


# --- concurrency on an in-process server (the real Runtime, held at a gate) -------------------------

def _loader(tiny_llama, holder: dict, load_gate: threading.Event | None = None, parallel: int = 1):
    def load_gated():
        if load_gate is not None:
            assert load_gate.wait(60), "load gate never opened"
        rt = GatedRuntime(load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1,
                               parallel=parallel))
        rt.gate.set()
        holder["rt"] = rt
        return rt
    return load_gated


def _post_in_thread(url: str, path: str, body: dict, out: dict, key: str) -> threading.Thread:
    def go():
        out[key] = httpx.post(url + path, json=body, timeout=60)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _raw_request(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so the test can vanish like a real client) and return the socket."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _metric(url: str, line_prefix: str) -> float:
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@PARALLEL
def test_health_is_not_ready_until_the_model_is_loaded(tiny_llama, parallel):
    holder, load_gate = {}, threading.Event()
    with InProcessServer(ServerConfig(model=str(tiny_llama)), _loader(tiny_llama, holder, load_gate, parallel)) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and int(r.headers["retry-after"]) > 0
        r = httpx.post(srv.url + CHAT, json={"model": str(tiny_llama), "messages": MSGS})
        assert_error(r, 503, "model_loading")
        assert _metric(srv.url, f'edgerun_ready{{model="{tiny_llama}"}}') == 0
        load_gate.set()
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        r = httpx.post(srv.url + CHAT, json={"model": str(tiny_llama), "messages": MSGS, "max_tokens": 3})
        assert r.status_code == 200, r.text


def _hold(srv, rt, model: str, n: int, out: dict, max_tokens: int = 6, **body) -> list[threading.Thread]:
    """Fill the n generation slots with requests held at the gate ("h0", "h1", ... in `out`); `body` adds
    fields to each request (temperature=0 where a test needs a known first token, not a sampled EOS)."""
    threads = []
    for i in range(n):
        threads.append(_post_in_thread(srv.url, COMPL, {"model": model, "prompt": f"held {i}",
                                                        "max_tokens": max_tokens, **body}, out, f"h{i}"))
        assert rt.entered.acquire(timeout=30)                      # running, held at the gate
    return threads


@PARALLEL
def test_queue_is_fifo_and_rejects_past_its_bound(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    with InProcessServer(ServerConfig(model=model, queue=2), _loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt, sch = holder["rt"], srv.state.scheduler
        wait_until(sch.ready.is_set, what="ready")
        assert sch.n_slots == parallel
        rt.gate.clear()
        prompts = {"a": "one two", "b": "three four", "c": "five six"}
        threads = _hold(srv, rt, model, parallel - 1, out)          # the other slots are taken too
        threads.append(_post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts["a"], "max_tokens": 6},
                                       out, "a"))
        assert rt.entered.acquire(timeout=30)                      # a is running, held at the gate
        for k in ("b", "c"):
            threads.append(_post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts[k], "max_tokens": 6},
                                           out, k))
            wait_until(lambda: sch.depth == ("bc".index(k) + 1), what=f"{k} queued")
        assert [j.prompt for j in sch._waiting] == [prompts["b"], prompts["c"]]        # in arrival order
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "seven", "max_tokens": 6})
        assert_error(r, 503, "queue_full")
        assert int(r.headers["retry-after"]) >= 1
        # issue 20: a prompt that cannot fit is refused at once (400), even with the queue full: it never
        # takes a queue slot nor the worker's time to tokenize
        flood = {"model": model, "messages": [{"role": "user", "content": "<|im_start|>" * 4000}], "max_tokens": 1}
        assert_error(httpx.post(srv.url + CHAT, json=flood), 400, "context_length_exceeded", "messages")
        assert_error(httpx.post(srv.url + COMPL, json={"model": model, "prompt": "<|im_start|>" * 4000}), 400,
                     "context_length_exceeded", "prompt")
        assert _metric(srv.url, "edgerun_queue_depth") == 2 and _metric(srv.url, "edgerun_busy") == 1
        rt.gate.set()
        for t in threads:
            t.join(60)
        for k in [*"abc", *(f"h{i}" for i in range(parallel - 1))]:
            body = out[k].json()
            assert out[k].status_code == 200, body
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert body["usage"]["completion_tokens"] <= 6
        order = [next((k for k, p in prompts.items() if rt.tokenize(p) == toks), "held") for toks in rt.started]
        assert order[:parallel] == ["held"] * (parallel - 1) + ["a"]
        if parallel == 1:                   # one slot: b then c; several: both start as the held ones end
            assert order == ["a", "b", "c"]
        assert sorted(order[parallel:]) == ["b", "c"]
        assert _metric(srv.url, 'edgerun_requests_total{endpoint="/v1/completions",status="503"}') == 1


@PARALLEL
def test_client_disconnect_cancels_its_generation_and_frees_the_slot(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    probe = {"model": model, "prompt": "the water is", "max_tokens": 12, "temperature": 0}
    with InProcessServer(ServerConfig(model=model, queue=2), _loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt, sch = holder["rt"], srv.state.scheduler
        first = httpx.post(srv.url + COMPL, json=probe).json()
        before, before_tokens = first["choices"][0]["text"], first["usage"]["completion_tokens"]
        assert rt.entered.acquire(timeout=30)          # the probe's: from here on one release per held request

        # a queued request whose client goes away leaves the queue at once
        rt.gate.clear()
        running = _raw_request(srv.url, COMPL, {"model": model, "prompt": "held", "max_tokens": 50, "stream": True,
                                                "temperature": 0})
        assert rt.entered.acquire(timeout=30)
        fillers = _hold(srv, rt, model, parallel - 1, out, max_tokens=1)   # one token each, then they end
        queued = _raw_request(srv.url, CHAT, {"model": model, "messages": MSGS, "max_tokens": 50})
        wait_until(lambda: sch.depth == 1, what="queued")
        queued.close()
        wait_until(lambda: sch.depth == 0, what="the queued request to leave")

        # a running stream whose client goes away mid-stream stops at its next token
        rt.meter = Meter(2)
        rt.gate.set()
        buf = b""
        while buf.count(b"data: ") < 2:                 # headers + the first tokens arrived
            data = running.recv(65536)
            assert data, f"the stream ended early: {buf!r}"
            buf += data
        # close only once the generation waits for its 4th token: a disconnect noticed between two tokens
        # would end it after its 3rd (a race the test must not depend on)
        assert rt.meter.blocked.wait(30)
        running.close()
        wait_until(lambda: sch.running is not None and sch.running.stop_reason == "cancelled",
                   what="the disconnect to be noticed")
        rt.meter.release(1)
        wait_until(lambda: not sch.busy, what="the worker to stop")
        rt.meter = None
        for t in fillers:
            t.join(60)
        assert all(out[f"h{i}"].status_code == 200 for i in range(parallel - 1))
        assert _metric(srv.url, 'edgerun_generations_total{outcome="cancelled"}') == 2
        # the 50-token stream was cut after its 4th token (the first three, then one more permit); in a batch
        # the cancelled sequence may leave the step that computes the 4th before it is counted
        cut = _metric(srv.url, "edgerun_tokens_generated_total") - before_tokens - (parallel - 1)
        assert cut == 4 or (parallel > 1 and cut == 3), cut

        # the caches were rolled back: the same greedy request gives the same text
        after = httpx.post(srv.url + COMPL, json=probe).json()["choices"][0]["text"]
        assert after == before


@PARALLEL
def test_time_limit_ends_running_and_queued_requests(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    with InProcessServer(ServerConfig(model=model, queue=2, timeout_s=0.5),
                         _loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt = holder["rt"]
        rt.gate.clear()
        t = _post_in_thread(srv.url, COMPL, {"model": model, "prompt": "slow one", "max_tokens": 20,
                                             "temperature": 0}, out, "a")
        assert rt.entered.acquire(timeout=30)
        # greedy: a sampled request can draw EOS as its first token (CI saw it once) and end "stop"
        others = _hold(srv, rt, model, parallel - 1, out, max_tokens=20, temperature=0)
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "waits", "max_tokens": 5}, timeout=60)
        assert_error(r, 503, "queue_timeout")            # waited its whole limit behind the held request
        rt.gate.set()
        for t in [t, *others]:
            t.join(60)
        for k in ["a", *(f"h{i}" for i in range(parallel - 1))]:
            body = out[k].json()
            assert out[k].status_code == 200, body
            assert body["choices"][0]["finish_reason"] == "length" and body["edgerun"]["finish"] == "time_limit"
            assert body["usage"]["completion_tokens"] == 1     # stopped after the first token it produced
        assert _metric(srv.url, 'edgerun_generations_total{outcome="timeout"}') == 1 + parallel


@PARALLEL
def test_server_output_equals_the_offline_runtime(tiny_llama, parallel):
    model = str(tiny_llama)
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        offline = rt.generate("the quick brown fox", max_tokens=20, temperature=0)
    with InProcessServer(ServerConfig(model=model), _loader(tiny_llama, {}, parallel=parallel)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        body = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "the quick brown fox", "max_tokens": 20,
                                                 "temperature": 0}, timeout=60).json()
    assert body["choices"][0]["text"] == offline.text
    assert body["usage"]["completion_tokens"] == offline.n_tokens
    assert body["edgerun"]["finish"] == offline.finish_reason


@pytest.mark.parametrize("interval_ms", [0.0, 1000.0], ids=["each-token", "held"])
def test_a_stream_carries_one_event_per_token_whatever_the_interval(tiny_llama, interval_ms):
    """--stream-interval changes when a stream's tokens are written, not what is written: every token is
    still its own SSE event, in order, and the text is the plain answer's. At 1000 ms the tokens after the
    first are held and go out together (with the end, or when a nudge finds them)."""
    model = str(tiny_llama)
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 20, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        pieces = [step.text for step in rt.stream("the quick brown fox", max_tokens=20, temperature=0)]
    config = ServerConfig(model=model, stream_interval_ms=interval_ms)
    with InProcessServer(config, _loader(tiny_llama, {}, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            plain = client.post(COMPL, json=body).json()
            events = stream_events(client, COMPL, body)
    texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert texts == [p for p in pieces if p]
    assert "".join(texts) == plain["choices"][0]["text"]


@PARALLEL
def test_speculative_stats_reach_the_response_and_metrics(tiny_llama, parallel):
    """With a drafter (prompt lookup, gamma 2) the server reports drafted/accepted tokens and gamma,
    and greedy speculative output is the same streamed or not."""
    model = str(tiny_llama)

    def load_spec():
        return load(model, draft="lookup", gamma=2, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1,
                    parallel=parallel)

    body = {"model": model, "prompt": "one two three one two three one two three one two", "max_tokens": 24,
            "temperature": 0}
    with InProcessServer(ServerConfig(model=model), load_spec) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            full = client.post(COMPL, json=body).json()
            chunks = stream_events(client, COMPL, body)
        ext = full["edgerun"]
        assert ext["drafter"] == "lookup" and ext["n_drafted"] > 0 and ext["n_cycles"] > 0
        assert sum(ext["accept_histogram"]) >= 1 and 0 <= ext["n_accepted"] <= ext["n_drafted"]
        assert streamed_text(chunks, chat=False) == full["choices"][0]["text"]
        assert _metric(srv.url, "edgerun_draft_tokens_total") >= ext["n_drafted"]
        assert _metric(srv.url, "edgerun_gamma") == pytest.approx(ext["gamma_mean"], abs=1e-5)
        assert 0 < ext["gamma_mean"] <= 2


def test_concurrent_requests_are_batched_and_each_equals_its_answer_alone(tiny_llama):
    """Four clients at once (the official openai client, one thread each) on four slots: each greedy answer
    is the one the offline runtime gives alone, and the batches held several sequences' rows."""
    model = str(tiny_llama)
    prompts = ["the quick brown fox", "one two three", "hello there", "a b c d"]
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = [rt.generate(p, max_tokens=24, temperature=0).text for p in prompts]
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), _loader(tiny_llama, holder, parallel=4)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        holder["rt"].gate.clear()                      # all four start together

        def ask(i):
            out[i] = client.completions.create(model=model, prompt=prompts[i], max_tokens=24, temperature=0)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(4):
            assert holder["rt"].entered.acquire(timeout=30)
        holder["rt"].gate.set()
        for t in threads:
            t.join(60)
        assert [out[i].choices[0].text for i in range(4)] == alone
        group = srv.state.scheduler.slots[0].group
        assert group.n_rows > group.n_steps            # batches held rows of several sequences
        assert _metric(srv.url, "edgerun_slots") == 4
        assert _metric(srv.url, "edgerun_batch_rows_total") > _metric(srv.url, "edgerun_batch_steps_total") > 0
        assert 0 < _metric(srv.url, "edgerun_batch_eval_seconds_total") == pytest.approx(group.eval_s)



def test_a_gap_a_finished_job_leaves_is_closed_by_moving_a_running_sequence(tiny_llama):
    """Jobs on slots 0, 1 and 2; the one on slot 1 ends first. llama.cpp would evaluate the busy ids 0 and
    2 in two passes, so the scheduler moves slot 2's running sequence to id 1 at the next step: both long
    answers are still the ones given alone, the move is counted, and the next job is placed on the id after
    them."""
    model = str(tiny_llama)
    prompts = {"long one": 48, "short": 2, "long two": 48}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=n, temperature=0).text for p, n in prompts.items()}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), _loader(tiny_llama, holder, parallel=4)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()
        threads = []
        for p, n in prompts.items():                    # in order: slots 0, 1, 2
            threads.append(_post_in_thread(srv.url, COMPL, {"model": model, "prompt": p, "max_tokens": n,
                                                            "temperature": 0}, out, p))
            assert rt.entered.acquire(timeout=30)
        assert [sch._seq_id(i) for i in range(4)] == [0, 1, 2, 3]
        rt.gate.set()
        for t in threads:
            t.join(60)
        assert {p: out[p].json()["choices"][0]["text"] for p in prompts} == alone
        assert _metric(srv.url, "edgerun_batch_moves_total") == 1
        assert [sch._seq_id(i) for i in range(4)] == [0, 2, 1, 3]
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "short", "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.json()["choices"][0]["text"] == alone["short"]

def test_a_disconnect_mid_batch_frees_its_slot_and_leaves_the_others_untouched(tiny_llama):
    model = str(tiny_llama)
    body = {"model": model, "max_tokens": 30, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=30, temperature=0).text for p in ("stays", "comes later")}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model, queue=0), _loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()
        rt.meter = threading.Semaphore(0)              # each token after the first waits for a permit
        leaving = _raw_request(srv.url, COMPL, {**body, "prompt": "goes away", "stream": True})
        assert rt.entered.acquire(timeout=30)
        staying = _post_in_thread(srv.url, COMPL, {**body, "prompt": "stays"}, out, "stays")
        assert rt.entered.acquire(timeout=30)
        assert_error(httpx.post(srv.url + COMPL, json={**body, "prompt": "no room"}), 503, "queue_full")
        rt.gate.set()
        rt.meter.release(6)                             # both sequences advance, batched
        buf = b""
        while buf.count(b"data: ") < 2:
            data = leaving.recv(65536)
            assert data, f"the stream ended early: {buf!r}"
            buf += data
        leaving.close()
        rt.meter.release(1000)
        wait_until(lambda: len(sch.running_jobs) <= 1, what="the disconnect to free its slot")
        later = httpx.post(srv.url + COMPL, json={**body, "prompt": "comes later"}, timeout=60)   # the freed slot
        staying.join(60)
        rt.meter = None
        assert out["stays"].json()["choices"][0]["text"] == alone["stays"]
        assert later.json()["choices"][0]["text"] == alone["comes later"]
        assert _metric(srv.url, 'edgerun_generations_total{outcome="cancelled"}') == 1


def test_a_request_runs_on_the_packed_slot_with_the_prefix_another_slot_holds(tiny_llama):
    """A lone request runs on the lowest free slot (busy sequence ids stay contiguous: a gap costs llama.cpp a
    second pass), and a longer prefix of its prompt cached in another free slot is copied there, not evaluated
    again; the slot it was copied from keeps its cache."""
    model = str(tiny_llama)
    holder, out = {}, {}
    prompts = {"x": "the story so far: one two three four five", "y": "a different conversation entirely"}
    with InProcessServer(ServerConfig(model=model), _loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()                                 # both slots busy at once: y on slot 0, then x on slot 1
        threads = []
        for k in ("y", "x"):
            threads.append(_post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts[k], "max_tokens": 4,
                                                            "temperature": 0}, out, k))
            assert rt.entered.acquire(timeout=30)
        rt.gate.set()
        for t in threads:
            t.join(60)
        caches = [list(s.target.tokens) for s in sch.slots]
        x = rt.tokenize(prompts["x"])
        assert caches[1][:len(x)] == x and caches[0][:len(x)] != x
        group = sch.slots[0].group
        for turn in range(3):                           # the same conversation, one turn further each time
            rows, moved = group.n_rows, sch.n_moved
            r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": prompts["x"] + " six", "max_tokens": 4,
                                                  "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            assert list(sch.slots[0].target.tokens[:len(x)]) == x                  # it ran on slot 0
            assert sch.n_moved - moved == (1 if turn == 0 else 0)   # copied once, then slot 0 holds it
            assert group.n_rows - rows < len(x)          # the cached prefix was not evaluated again
            assert list(sch.slots[1].target.tokens) == caches[1]                  # slot 1 untouched


def test_a_request_cancels_a_move_that_waits_for_a_step(tiny_llama):
    """A slot freed by a finished job may wait, holding the dispatch lock, for a move that closes the gap
    in the busy sequence ids (Scheduler._compact). A move is applied at the next step, and when none comes
    (every running sequence's consumer is away) the new request must not wait for it: submit cancels the
    move and the request runs at once. Here the move is made as _compact makes it, with sequence 0 parked
    after its first token."""
    model = str(tiny_llama)
    body = {"model": model, "max_tokens": 8, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=8, temperature=0).text for p in ("first", "second")}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), _loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        group = sch.slots[0].group
        parked = threading.Event()

        class Meter(threading.Semaphore):              # each token after the first waits for a permit
            def acquire(self, *a, **kw):
                parked.set()
                return super().acquire(*a, **kw)
        rt.meter = Meter(0)
        first = _post_in_thread(srv.url, COMPL, {**body, "prompt": "first"}, out, "first")
        assert parked.wait(60), "the first job never reached its second token"
        got: list = []
        with sch._dispatch:                            # as _compact holds it: no slot places a job meanwhile
            mover = threading.Thread(target=lambda: got.append(
                group.move(sch.slots[0].batch_views(), sch.slots[1].batch_views(), timeout_s=120)), daemon=True)
            mover.start()
            wait_until(lambda: bool(group._moves), what="the move to wait for a step")
            second = _post_in_thread(srv.url, COMPL, {**body, "prompt": "second"}, out, "second")
            mover.join(60)
            assert got == [False] and group.n_moves == 0   # cancelled by the request, not timed out
        rt.meter.release(1000)
        first.join(60)
        second.join(60)
        rt.meter = None
        assert out["first"].json()["choices"][0]["text"] == alone["first"]
        assert out["second"].json()["choices"][0]["text"] == alone["second"]


# --- /metrics text ---------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$')


def test_metrics_exposition_format():
    m = Metrics(model='odd "name"\\x')
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 503)
    m.record_generation(GenerationRecord(n_prompt_tokens=5, n_tokens=11, t_decode_s=2.0, n_drafted=8, n_accepted=6,
                                         gamma_mean=4.0, ttft_s=0.3, outcome="length"))
    m.record_generation(GenerationRecord(n_prompt_tokens=0, n_tokens=0, t_decode_s=0.0, n_drafted=0, n_accepted=0,
                                         gamma_mean=None, ttft_s=None, outcome="cancelled"))
    text = m.render(queue_depth=2, queue_limit=8, busy=True, ready=True)
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) edgerun_\w+ .+", line), line
            continue
        assert _SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    assert values["edgerun_acceptance_rate"] == 0.75 and values["edgerun_gamma"] == 4
    assert values["edgerun_tokens_per_second"] == 5.5 and values["edgerun_tokens_generated_total"] == 11
    assert values['edgerun_time_to_first_token_seconds_bucket{le="0.25"}'] == 0
    assert values['edgerun_time_to_first_token_seconds_bucket{le="0.5"}'] == 1
    assert values['edgerun_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert values['edgerun_requests_total{endpoint="/v1/completions",status="503"}'] == 1
    assert values['edgerun_generations_total{outcome="cancelled"}'] == 1
    assert values["edgerun_queue_depth"] == 2 and values["edgerun_busy"] == 1
    assert values['edgerun_ready{model="odd \\"name\\"\\\\x"}'] == 1


# --- issue 20: a web page the board's user opens must not drive a keyless loopback server ------------

@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(http, model, ctype):
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2})
    headers = {} if ctype is None else {"content-type": ctype}
    r = http.post(COMPL, content=body, headers=headers)
    assert_error(r, 415, "unsupported_media_type")


def test_foreign_host_and_origin_are_refused(server, http, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    port = server.url.rsplit(":", 1)[1]
    assert_error(http.post(COMPL, json=body, headers={"host": f"evil.example:{port}"}), 403, "host_not_allowed")
    assert_error(http.get("/health", headers={"host": "rebound.attacker.test"}), 403, "host_not_allowed")
    assert http.post(COMPL, json=body, headers={"host": f"localhost:{port}"}).status_code == 200
    assert_error(http.post(COMPL, json=body, headers={"origin": "http://evil.example"}), 403, "origin_not_allowed")
    assert_error(http.options(COMPL, headers={"origin": "http://evil.example",
                                              "access-control-request-method": "POST"}), 403, "origin_not_allowed")


def test_an_allowed_origin_gets_cors(tiny_llama, tmp_path):
    origin = "http://192.168.1.20:3000"
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key", KEY, "--cors-origin", origin,
                         "--allow-host", "edgerun.local"], env=clean_env(tmp_path))
    try:
        srv.wait_ready()
        pre = httpx.options(srv.url + COMPL, headers={"origin": origin, "access-control-request-method": "POST",
                                                      "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
        assert "authorization" in pre.headers["access-control-allow-headers"]
        r = httpx.post(srv.url + COMPL, json={"model": str(tiny_llama), "prompt": "hi", "max_tokens": 2},
                       headers={**AUTH, "origin": origin, "host": "edgerun.local"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert httpx.get(srv.url + "/v1/models", headers={"origin": origin}).status_code == 401   # still the key
    finally:
        assert srv.terminate() == 0, srv.output


@pytest.mark.parametrize("args, message", [
    (["--host", "0.0.0.0"], "without an API key would let anyone"),
    (["--host", "::"], "without an API key would let anyone"),
    (["--host", "0.0.0.0", "--api-key", "k", "--cors-origin", "evil.example"], "is not an origin"),
])
def test_exposing_the_api_needs_a_key_or_an_explicit_flag(tiny_llama, tmp_path, args, message):
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, *args], env=clean_env(tmp_path), wait_listening=False)
    assert srv.wait_exit() == 2
    assert message in srv.output and "Traceback" not in srv.output, srv.output


def test_insecure_no_auth_says_what_it_opens(tiny_llama, tmp_path):
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--host", "0.0.0.0", "--insecure-no-auth"],
                        env=clean_env(tmp_path))
    try:
        srv.wait_ready()
        assert "WITHOUT an API key" in srv.output
    finally:
        assert srv.terminate() == 0, srv.output


# --- issue 20, defect 1: idle and slow connections --------------------------------------------------

def test_idle_connections_do_not_take_the_service_down(server, http, model):
    """100 connections that send nothing (the defect: 63 made every request, /health too, a plain 503);
    then they are closed by the server once the read deadline passes."""
    from edgerun.serve.run import READ_TIMEOUT_S

    host, port = server.url.rsplit("//", 1)[1].rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(100)]
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")     # headers that never end
    try:
        assert http.get("/health").status_code == 200
        r = http.post(COMPL, json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        for s in (*idle[:3], slow):
            s.settimeout(READ_TIMEOUT_S + 10)
            assert s.recv(1) == b""              # closed by the server, not by us
    finally:
        for s in (*idle, slow):
            s.close()
    assert http.get("/health").status_code == 200


def test_a_half_closed_client_gets_its_answer(server, model):
    """Issue 20: a client that shuts down its sending side after the request (shutdown(SHUT_WR), as some
    scripts and `nc -N` do) used to get nothing back."""
    _half_closed_requests(server.url, model)


def _half_closed_requests(url: str, model: str) -> None:
    """A completion request, streamed and not, from a client that shuts down its sending side after it."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    for stream in (False, True):
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(30)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert (b"data: [DONE]" in data) if stream else (b'"finish_reason"' in data)


@PARALLEL
def test_prompt_cache_restores_a_repeated_prompt_and_changes_nothing(tiny_llama, parallel):
    """A prompt seen before, whose slot cache other requests have overwritten since (every slot taken by a
    held request), is restored from the prompt cache instead of evaluated, and the answer is the same as the
    first time; with --prompt-cache 0 nothing is kept."""
    model = str(tiny_llama)
    long_a = "the water is cold and the river runs under the old stone bridge near the mill every spring morning"
    body = {"model": model, "prompt": long_a, "max_tokens": 8, "temperature": 0}
    for mib in (256, 0):
        holder, out = {}, {}
        with InProcessServer(ServerConfig(model=model, prompt_cache_mib=mib),
                             _loader(tiny_llama, holder, parallel=parallel)) as srv:
            wait_until(lambda: "rt" in holder, what="load")
            rt, sch = holder["rt"], srv.state.scheduler
            first = httpx.post(srv.url + COMPL, json=body, timeout=60).json()["choices"][0]["text"]
            assert rt.entered.acquire(timeout=30)
            rt.gate.clear()
            for t in _hold(srv, rt, model, parallel, out, max_tokens=4, temperature=0):   # every slot overwritten
                rt.gate.set()
                t.join(60)
            a = rt.tokenize(long_a)
            assert all(common_prefix(s.target.tokens, a) < 16 for s in sch.slots)
            again = httpx.post(srv.url + COMPL, json=body, timeout=60).json()["choices"][0]["text"]
            hits = _metric(srv.url, "edgerun_prompt_cache_hits_total")
            restored = _metric(srv.url, "edgerun_prompt_cache_restored_tokens_total")
        assert again == first
        if mib:
            assert hits == 1 and restored >= 16
        else:
            assert hits == 0 and sch.prompt_cache is None


def test_prompt_cache_keeps_the_longest_prefix_within_its_bytes():
    from edgerun.backends.llamacpp import SeqState
    from edgerun.serve.promptcache import PromptCache

    def st(toks, n=100):
        return SeqState(tuple(toks), b"\0" * n)

    c = PromptCache(max_bytes=3 * (100 + 8 * 4))
    c.put(st([1, 2, 3, 4]))
    c.put(st([1, 2]))                         # a prefix of an entry: not kept twice
    assert len(c) == 1
    c.put(st([1, 2, 3, 4, 5, 6]))             # extends the entry: replaces it
    assert len(c) == 1 and c.best([1, 2, 3, 4, 5, 9])[0] == 5
    c.put(st([7, 8, 9, 10]))
    c.put(st([11, 12, 13, 14]))
    assert c.best([7, 8, 0])[0] == 2          # used: now the most recent
    c.put(st([15, 16, 17, 18]))               # over the bound: the least recently used ([1..6]) goes
    assert c.best([1, 2, 3])[0] == 0 and c.best([7, 8])[0] == 2 and c.nbytes <= c.max_bytes
    c.put(st([1], n=10_000))                  # larger than the whole cache: not kept
    assert c.best([1])[0] == 0


def test_prompt_cache_never_takes_more_than_a_quarter_of_the_available_ram(monkeypatch, caplog):
    import collections

    import psutil

    from edgerun.serve import promptcache

    vm = collections.namedtuple("vm", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(400 * 2**20))
    assert promptcache.sized(0) is None
    assert promptcache.sized(64).max_bytes == 64 * 2**20
    with caplog.at_level("WARNING", logger="edgerun.serve.promptcache"):
        assert promptcache.sized(256).max_bytes == 100 * 2**20
    assert "keeping it to 100 MiB" in caplog.text


def test_a_pre_serialised_chunk_is_the_chunk_serialised_byte_for_byte():
    """A streamed token's SSE chunk is built from the stream's chunk serialised once (sse_framer): it must be
    exactly what serialising the whole chunk with the token's text gives, whatever the text holds."""
    from edgerun.serve.protocol import sse_data, sse_framer

    mark = "\ue000mark\ue000"

    def chunk(text):
        return {"id": "chatcmpl-x", "created": 1, "model": "m\"odel", "system_fingerprint": None,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}

    frame = sse_framer(chunk(mark), mark)
    for text in ["hi", " wörld ✓", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f", "\ud83d",
                 "\U0001f600", "", mark[1:]]:
        assert frame(text) == sse_data(chunk(text)), text
    with pytest.raises(ValueError, match="exactly one"):
        sse_framer({"a": mark, "b": mark}, mark)
    with pytest.raises(ValueError, match="exactly one"):
        sse_framer({"a": "x"}, mark)


def test_the_server_speaks_httptools_and_falls_back_to_h11(tiny_llama, tmp_path, monkeypatch):
    """uvicorn's httptools protocol serves by default (less event-loop time per streamed token); with
    EDGERUN_HTTP=h11 the pure-Python one does, with the same connection guards: a half-closed client still
    gets its answer, streamed or not, and a request that is not HTTP gets a 400."""
    from edgerun.serve import run

    pytest.importorskip("httptools")
    assert issubclass(run.http_protocol(), run.HttpToolsProtocol)
    monkeypatch.setenv("EDGERUN_HTTP", "h11")
    assert issubclass(run.http_protocol(), run.H11Protocol)
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key", KEY],
                        env=clean_env(tmp_path, EDGERUN_HTTP="h11"))
    try:
        srv.wait_ready()
        _half_closed_requests(srv.url, str(tiny_llama))
        host, port = srv.url.rsplit("//", 1)[1].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        s.settimeout(30)
        assert s.recv(65536).startswith(b"HTTP/1.1 400")
        s.close()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        assert srv.terminate() == 0, srv.output
