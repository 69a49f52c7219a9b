"""What Ollama's clients and an operator see around the /api/* routes, on the real `edgerun serve` with
SmolLM2: `HEAD /` answers like `GET /` (Ollama's clients and health checkers probe it), and /metrics counts
requests through the Ollama routes under their own endpoint label, apart from the OpenAI /v1 routes."""

from __future__ import annotations

import httpx
import ollama
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from edgerun.serve.metrics import Metrics
from server_fixtures import ollama_server

MODEL = "smollm2-135m-instruct"
KEY = "ollama-extra-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "num_predict": 4}
# headers of the page that a HEAD must carry as GET does (Date may tick between the two)
PAGE_HEADERS = ("content-type", "content-length", "cache-control", "content-security-policy",
                "x-content-type-options")



@pytest.fixture(scope="module")
def server():
    srv = ollama_server(MODEL, "--draft", "none", "--threads", "2", "--ctx", "512",
                       "--api-key", KEY)
    yield srv
    assert srv.terminate() == 0, srv.output


def _requests_total(url: str) -> dict[tuple[str, str], float]:
    """edgerun_requests_total by (endpoint, status)."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("edgerun_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in labels[len("edgerun_requests_total{"):-1].split(","))
            out[(fields["endpoint"].strip('"'), fields["status"].strip('"'))] = float(value)
    return out


@pytest.mark.real_model
@pytest.mark.parametrize("port", ["main", "ollama"])
def test_head_root_answers_like_get_without_a_body(server, port):
    url = server.url if port == "main" else server.ollama_url
    got = httpx.get(url + "/", timeout=30)
    head = httpx.head(url + "/", timeout=30)
    assert got.status_code == 200 and got.content.startswith(b"<!")
    assert head.status_code == 200, head.text
    assert head.content == b""
    for name in PAGE_HEADERS:
        assert head.headers.get(name) == got.headers.get(name), name


@pytest.mark.real_model
def test_metrics_count_ollama_routes_apart_from_v1(server):
    client = ollama.Client(host=server.url, headers=AUTH, timeout=120)
    before = _requests_total(server.url)
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=False, options=GREEDY)
    assert r.done
    parts = list(client.generate(model=MODEL, prompt="Count: one, two,", stream=True, options=GREEDY))
    assert parts[-1].done
    assert client.list().models
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "Hi"}], stream=False)
    assert info.value.status_code == 404
    assert httpx.post(server.url + "/api/embed", headers=AUTH, json={"model": MODEL, "input": "x"},
                      timeout=30).status_code == 501
    assert httpx.post(server.url + "/api/blobs/sha256:00", headers=AUTH, timeout=30).status_code == 501
    assert httpx.get(server.url + "/api/tags", timeout=30).status_code == 401          # no key: the gate's answer
    v1 = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert v1.status_code == 200, v1.text
    after = _requests_total(server.url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after.keys() | before.keys()}
    delta = {k: v for k, v in delta.items() if v and k[0] != "/metrics"}
    assert delta == {("/api/chat", "200"): 1, ("/api/generate", "200"): 1, ("/api/tags", "200"): 1,
                     ("/api/chat", "404"): 1, ("/api/embed", "501"): 1, ("/api/blobs", "501"): 1,
                     ("/api/tags", "401"): 1, ("/v1/chat/completions", "200"): 1}


def test_endpoint_labels_stay_a_bounded_set():
    m = Metrics()
    assert m.endpoint_of("/v1/completions") == "/v1/completions"
    assert m.endpoint_of("/api/chat") == "other"                   # until the Ollama routes name theirs
    m.name_endpoints(["/api/chat"], prefixes=["/api/blobs"])
    assert m.endpoint_of("/api/chat") == "/api/chat"
    assert m.endpoint_of("/api/blobs/sha256:" + "ab" * 32) == "/api/blobs"
    assert m.endpoint_of("/api/blobsX") == "other"
    assert m.endpoint_of("/api/anything-else") == "other"
    m.count_request(m.endpoint_of("/api/chat"), 200)
    assert 'edgerun_requests_total{endpoint="/api/chat",status="200"} 1' in \
        m.render(queue_depth=0, queue_limit=1, busy=False, ready=True)


@pytest.mark.real_model
def test_model_facts_found_by_name_when_the_runtime_names_no_file():
    """tags/show/ps describe the model from its cached file when the loaded backend has no file path."""
    from types import SimpleNamespace

    from edgerun.resolve import resolve_model
    from edgerun.serve.ollama.facts import Facts

    r = CliRunner().invoke(main, ["pull", MODEL])
    assert r.exit_code == 0, r.output
    state = SimpleNamespace(model_id=MODEL, scheduler=SimpleNamespace(runtime=SimpleNamespace(target=None)))
    f = Facts(state)
    assert f.path == resolve_model(MODEL, pull=False) and f.size == f.path.stat().st_size
    assert f.details()["family"] == "llama" and f.details()["quantization_level"]
