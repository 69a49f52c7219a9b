"""`edgerun serve` against bad and hostile input over real HTTP: each bad request gets its status and an
OpenAI-style error and the server keeps serving; API keys, bodies that are not JSON, foreign hosts and
origins, exposing the API, idle and half-closed connections, and the HTTP implementations it speaks."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from server_harness import TINY_ARGS, ServerProcess, clean_env
from server_fixtures import AUTH, CHAT, COMPL, CTX, KEY, MSGS, assert_error
from server_fixtures import http, model, oai, server  # noqa: F401  (fixtures: each module starts its servers)


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
