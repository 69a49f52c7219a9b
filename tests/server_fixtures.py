"""What the test_server_* files share: the subprocess server fixture (one and four slots), constants,
the error-shape check, SSE reading, and helpers that drive an in-process server held at a gate."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from edgerun.runtime import load
from server_harness import TINY_ARGS, GatedRuntime, ServerProcess, clean_env, sse_events


KEY = "sk-edgerun-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 256
MSGS = [{"role": "user", "content": "Hello there"}]
ERROR_KEYS = {"message", "type", "param", "code"}
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
# generation slots (continuous batching): every server test runs with one and with four
PARALLEL = pytest.mark.parametrize("parallel", [1, 4], ids=["parallel1", "parallel4"])


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


def loader(tiny_llama, holder: dict, load_gate: threading.Event | None = None, parallel: int = 1):
    def load_gated():
        if load_gate is not None:
            assert load_gate.wait(60), "load gate never opened"
        rt = GatedRuntime(load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1,
                               parallel=parallel))
        rt.gate.set()
        holder["rt"] = rt
        return rt
    return load_gated


def post_in_thread(url: str, path: str, body: dict, out: dict, key: str) -> threading.Thread:
    def go():
        out[key] = httpx.post(url + path, json=body, timeout=60)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so the test can vanish like a real client) and return the socket."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def metric(url: str, line_prefix: str) -> float:
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def hold_slots(srv, rt, model: str, n: int, out: dict, max_tokens: int = 6, **body) -> list[threading.Thread]:
    """Fill the n generation slots with requests held at the gate ("h0", "h1", ... in `out`); `body` adds
    fields to each request (temperature=0 where a test needs a known first token, not a sampled EOS)."""
    threads = []
    for i in range(n):
        threads.append(post_in_thread(srv.url, COMPL, {"model": model, "prompt": f"held {i}",
                                                        "max_tokens": max_tokens, **body}, out, f"h{i}"))
        assert rt.entered.acquire(timeout=30)                      # running, held at the gate
    return threads


def ollama_server(model: str, *args: str) -> ServerProcess:
    """`edgerun serve --model MODEL ARGS` (the model pulled first) also listening on a free Ollama port;
    ready, with .ollama_url set. The caller terminates it."""
    from click.testing import CliRunner

    from edgerun.cli import main
    from edgerun.registry.cache import cache_dir

    r = CliRunner().invoke(main, ["pull", model])
    assert r.exit_code == 0, r.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerProcess(["--model", model, "--no-pull", *args, "--ollama-port", port], env=clean_env(cache_dir()))
    srv.wait_ready(timeout=120)
    srv.ollama_url = f"http://127.0.0.1:{port}"
    return srv
