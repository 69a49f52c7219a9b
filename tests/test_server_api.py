"""`edgerun serve` over real HTTP as users run it (a subprocess on a loopback port, a tiny GGUF, with one
and with four generation slots): the OpenAI routes' shapes, streaming, stop strings, the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_fixtures import MSGS, assert_error, stream_events, streamed_text
from server_fixtures import http, model, oai, server  # noqa: F401  (fixtures: each module starts its servers)


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
