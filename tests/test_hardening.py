"""Hostile input, second round (issue 50): grammars built to explode, a Host that only looks like
loopback, absurd checkpoint configs, a full disk, floods from one local client, lone surrogates, deep
nesting, the API key in a file. Every case against the real server (a subprocess: a crash is a failed
test, not a dead pytest) or the real CLI."""

from __future__ import annotations

import contextlib
import json
import json as _json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgerun.errors import InvalidArgument
from edgerun.request import Request
from edgerun.serve.settings import ServerConfig
from server_harness import TINY_ARGS, InProcessServer, ServerProcess, clean_env, wait_until

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
FIX = Path(__file__).parent / "fixtures" / "int4"


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(key: str, n: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {key: s} if key == "items" else {key: [s, {"type": "string"}]}
    return s


def nested_text(key: str, n: int) -> str:
    """nested(key, n) as JSON text (the json module's encoder recurses, and stops near 1000 levels)."""
    if key == "items":
        return '{"items": ' * n + '{"type": "integer"}' + "}" * n
    return '{"anyOf": [' * n + '{"type": "integer"}' + ', {"type": "string"}]}' * n


HOSTILE_SCHEMAS = {                    # refused by the schema limits (edgerun/constrain/limits.py)
    "ref_chain_3000": ref_chain(3000),          # 106 KB: over the size limit
    "ref_chain_200": ref_chain(200),            # 7 KB: over the depth limit, counting $ref hops
    "items_300": nested("items", 300),
    "anyof_200": nested("anyOf", 200),
    "regex_repeat": {"type": "string", "pattern": "^(a{1000}){1000}$"},
}
DEEP_BODIES = {"items_3000": nested_text("items", 3000), "anyof_3000": nested_text("anyOf", 3000),
               "anyof_1000": nested_text("anyOf", 1000)}      # refused by the body's nesting limit first


def schema_request(schema: dict, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **kw}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key", KEY],
                        env=clean_env(tmp_path_factory.mktemp("home")))
    srv.wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.output


class _Client(httpx.Client):
    """httpx with the served model's name put in every JSON body that says "m"."""

    model = ""

    def post(self, url, *, json=None, content=None, **kw):
        if json is not None and json.get("model") == "m":
            json = {**json, "model": self.model}
        if content is not None:
            content = content.replace('"model": "m"', '"model": ' + _json.dumps(self.model))
        return super().post(url, json=json, content=content, **kw)


@pytest.fixture(scope="module")
def http(server, tiny_llama):
    with _Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        client.model = str(tiny_llama)
        yield client


def alive(http) -> None:
    r = http.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


# --- D1 / D2: grammars as an untrusted-input boundary ------------------------------------------------

@pytest.mark.parametrize("name", list(HOSTILE_SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_hostile_schema_is_a_400_and_the_server_lives(server, http, name, stream):
    body = schema_request(HOSTILE_SCHEMAS[name], stream=stream)
    r = http.post(CHAT, json=body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "invalid_value"
    assert any(w in err["message"] for w in ("levels deep", "repeats up to", "limit")), err["message"]
    assert server.proc.poll() is None, server.output
    alive(http)


@pytest.mark.parametrize("name", list(DEEP_BODIES))
def test_a_schema_nested_thousands_deep_is_a_400_and_the_server_lives(server, http, name):
    raw = _json.dumps(schema_request({"x": 1})).replace('{"x": 1}', DEEP_BODIES[name])
    r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert "levels deep" in r.json()["error"]["message"]
    assert server.proc.poll() is None, server.output
    alive(http)


def test_hostile_grammars_and_tools_are_400(server, http):
    msgs = [{"role": "user", "content": "hi"}]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": nested("items", 300)}}}}
    for body in ({"model": "m", "prompt": "x", "max_tokens": 2,
                  "json_schema": {"type": "string", "pattern": "(a{1000}){1000}"}},
                 {"model": "m", "messages": msgs, "tools": [bad_tool], "tool_choice": "required"}):
        path = "/v1/completions" if "prompt" in body else CHAT
        r = http.post(path, json=body)
        assert r.status_code in (400, 422), (r.status_code, r.text[:300])
    assert server.proc.poll() is None
    alive(http)


def test_schemas_at_the_limits_still_work(http):
    """What the limits allow compiles and generates: a 100-deep $ref chain, a 120-deep items chain,
    a pattern repeated 2,000 times in all."""
    for schema in (ref_chain(100), nested("items", 120), {"type": "string", "pattern": "^(a{20}b){100}$"}):
        r = http.post(CHAT, json=schema_request(schema))
        assert r.status_code == 200, r.text[:300]


def test_cli_refuses_a_schema_chain_with_one_line(tiny_llama, tmp_path):
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps(ref_chain(3000)))
    r = subprocess.run([sys.executable, "-m", "edgerun", "generate", "x", "--model", str(tiny_llama), *TINY_ARGS,
                        "-n", "2", "--json-schema", str(chain)], capture_output=True, text=True,
                       env=clean_env(tmp_path), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "the limit for a grammar" in lines[-1] and "Traceback" not in r.stderr


# --- D3: a Host that only looks like loopback ----------------------------------------------------------

@pytest.mark.parametrize("host,status", [("127.0.0.1.nip.io:8080", 403), ("127.0.0.1.attacker.example", 403),
                                         ("127.5.6.7:1", 200), ("[::1]:8080", 200), ("localhost", 200)])
def test_host_is_parsed_as_an_address(server, host, status):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": host})
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] == "host_not_allowed"


# --- request-shape weaknesses ---------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("stop", ["\ud800"]), ("user", "a\udfffb"),
                                         ("messages", [{"role": "user", "content": "hi", "name": "\ud800"}])])
def test_a_lone_surrogate_in_any_string_field_is_400(http, field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    raw = json.dumps(body)              # ensure_ascii: the surrogate travels as \ud800
    r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text


def test_a_valid_surrogate_pair_is_accepted(http):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "\U0001F600"}], "max_tokens": 2})
    assert "\\ud83d\\ude00" in raw
    assert http.post(CHAT, content=raw, headers={"Content-Type": "application/json"}).status_code == 200


def test_deep_nesting_has_its_own_message(http):
    raw = '{"model": "m", "x": ' + "[" * 600 + "]" * 600 + "}"
    r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "nests arrays and objects more than 512 levels" in msg and "recursion" not in msg


def test_ten_thousand_turns_are_refused_before_rendering(http):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(10_001)]
    r = http.post(CHAT, json={"model": "m", "messages": turns, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]
    assert "10001 messages" in r.json()["error"]["message"]


# --- one local client cannot keep the others out --------------------------------------------------------

def _hold_and_queue(srv, rt, n_hold: int, n_queue: int, client: tuple, out: list) -> None:
    """n_hold generations held at the gate, then n_queue waiting, all from `client`."""
    from edgerun.serve.scheduler import Job
    import asyncio

    async def submit(k):
        job = Job(Request(prompt=f"p{k}", max_tokens=2), client=client)
        srv.state.scheduler.submit(job)
        out.append(job)

    for k in range(n_hold + n_queue):
        asyncio.run_coroutine_threadsafe(submit(k), srv.state.loop).result(10)


def _loader(tiny_llama, holder):
    from edgerun.runtime import load
    from server_harness import GatedRuntime

    def go():
        rt = GatedRuntime(load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=128, n_threads=1))
        holder["rt"] = rt
        return rt
    return go


@contextlib.contextmanager
def _flooded(tiny_llama):
    """An in-process server whose slot is held at the gate and whose queue (3) is full, all from client
    ('uid', 1234): yields (server, the held runtime, the scheduler, the flooder's jobs)."""
    holder: dict = {}
    with InProcessServer(ServerConfig(model=str(tiny_llama), queue=3), _loader(tiny_llama, holder)) as srv:
        wait_until(lambda: srv.state.scheduler.ready.is_set(), what="ready")
        wait_until(lambda: srv.state.loop is not None, what="loop")
        rt, sch = holder["rt"], srv.state.scheduler
        flood: list = []
        _hold_and_queue(srv, rt, 1, 3, ("uid", 1234), flood)
        assert rt.entered.acquire(timeout=30)
        wait_until(lambda: sch.depth == 3, what="queue full")
        yield srv, rt, sch, flood


def _ask_as_self(srv, model: str, out: dict) -> threading.Thread:
    """A one-token completion from this process's own Unix user (another client), on a thread: out['r']."""
    def ask():
        out["r"] = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "y", "max_tokens": 1},
                              timeout=60)
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    wait_until(lambda: any(j.client == ("uid", os.getuid()) for j in list(srv.state.scheduler._waiting)),
               what="admitted")
    return t


def test_a_flooding_client_gives_way_to_another_in_a_full_queue(tiny_llama):
    """12 requests of one client fill the slot and the queue; a request of another client (a Unix user on
    loopback) evicts the flooder's newest waiting one instead of getting 503; the flooder alone still
    gets 503 as before."""
    with _flooded(tiny_llama) as (srv, rt, sch, flood):
        from edgerun.serve.scheduler import Job, QueueFull
        import asyncio

        async def flood_more():
            srv.state.scheduler.submit(Job(Request(prompt="more", max_tokens=1), client=("uid", 1234)))
        with pytest.raises(QueueFull):       # the flooder alone: 503 as before
            asyncio.run_coroutine_threadsafe(flood_more(), srv.state.loop).result(10)
        # the test process's own uid is another client: it takes the flooder's newest place
        out: dict = {}
        t = _ask_as_self(srv, str(tiny_llama), out)
        assert sum(j.client == ("uid", 1234) for j in sch._waiting) == 2
        evicted = flood[-1]
        wait_until(lambda: evicted.stop_reason == "evicted", what="eviction")
        rt.gate.set()
        t.join(60)
        assert out["r"].status_code == 200, out["r"].text


def test_the_client_of_a_loopback_connection_is_its_unix_user():
    import socket

    from edgerun.serve.clients import socket_owner

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    try:
        assert socket_owner(*c.getsockname()) == os.getuid()
    finally:
        c.close()
        srv.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another Unix user")
def test_another_users_connection_is_another_client():
    import socket

    from edgerun.serve.clients import socket_owner

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    code = ("import socket,os,sys,time,encodings.idna; os.setuid(65534); c=socket.create_connection(('127.0.0.1', %d)); "
            "print(c.getsockname()[1], flush=True); time.sleep(5)" % srv.getsockname()[1])
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        assert socket_owner("127.0.0.1", port) == 65534
    finally:
        p.kill()
        p.wait()
        srv.close()


def test_max_per_client_caps_one_client(tiny_llama):
    holder: dict = {}
    cfg = ServerConfig(model=str(tiny_llama), queue=4, max_per_client=2)
    with InProcessServer(cfg, _loader(tiny_llama, holder)) as srv:
        wait_until(lambda: srv.state.scheduler.ready.is_set(), what="ready")
        rt = holder["rt"]
        rt.gate.clear()
        out: dict = {}
        threads = []
        for i in range(2):
            def ask(i=i):
                out[i] = httpx.post(srv.url + "/v1/completions", json={"model": str(tiny_llama), "prompt": f"q{i}",
                                                                        "max_tokens": 1}, timeout=60)
            threads.append(threading.Thread(target=ask, daemon=True))
            threads[-1].start()
        wait_until(lambda: len(srv.state.scheduler._waiting) + len(srv.state.scheduler._running) == 2, what="two held")
        r = httpx.post(srv.url + "/v1/completions", json={"model": str(tiny_llama), "prompt": "z", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
        assert int(r.headers["retry-after"]) >= 1
        rt.gate.set()
        for t in threads:
            t.join(60)
        assert all(out[i].status_code == 200 for i in range(2))


def test_forwarded_for_counts_only_from_a_trusted_proxy():
    from edgerun.serve.clients import client_key

    scope = {"client": ("10.0.0.5", 5555), "headers": [(b"x-forwarded-for", b"1.2.3.4, 5.6.7.8")]}
    assert client_key(scope, ServerConfig()) == ("addr", "10.0.0.5")
    assert client_key(scope, ServerConfig(trusted_proxies=("10.0.0.5",))) == ("forwarded", "5.6.7.8")


# --- the API key in a file ----------------------------------------------------------------------------

def test_api_key_file(tiny_llama, tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key-file", keyfile],
                        env=clean_env(tmp_path / "home"))
    try:
        srv.wait_ready()
        assert KEY not in " ".join(srv.proc.args)
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200
    finally:
        assert srv.terminate() == 0, srv.output


def test_api_key_and_key_file_together_are_refused(tiny_llama, tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text("k\n")
    r = subprocess.run([sys.executable, "-m", "edgerun", "serve", "--model", str(tiny_llama), *TINY_ARGS,
                        "--api-key", "a", "--api-key-file", str(keyfile)], capture_output=True, text=True,
                       env=clean_env(tmp_path / "home"), timeout=60)
    assert r.returncode == 2 and "--api-key and --api-key-file are both given" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = subprocess.run([sys.executable, "-m", "edgerun", "serve", "--model", str(tiny_llama), *TINY_ARGS,
                        "--api-key-file", str(empty)], capture_output=True, text=True,
                       env=clean_env(tmp_path / "home"), timeout=60)
    assert r.returncode == 2 and "is empty" in r.stderr, r.stderr


# --- D4 / D5: checkpoint configs with absurd dimensions -------------------------------------------------

def _convert(tmp_path: Path, change) -> subprocess.CompletedProcess:
    d = tmp_path / "ckpt"
    shutil.copytree(FIX / "awq-gemm-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    r = subprocess.run([sys.executable, "-m", "edgerun", "convert", str(d), str(out)], capture_output=True,
                       text=True, env=clean_env(tmp_path / "home"), timeout=60)
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))
    return r


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(num_hidden_layers=1_000_000), "num_hidden_layers is 1000000 but the safetensors files hold"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    (lambda c: c.update(hidden_size=10**9), "model.embed_tokens.weight has shape"),
    (lambda c: c.update(num_key_value_heads=-3), "num_key_value_heads must be a positive integer"),
])
def test_absurd_config_dimensions_are_one_line(tmp_path, change, message):
    r = _convert(tmp_path, change)
    assert r.returncode == 2, (r.returncode, r.stderr[-400:])
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# --- D6: a full disk ----------------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_full_disk_is_one_line_naming_the_free_space(tiny_llama, tiny_disk, tmp_path):
    out = tiny_disk / "out.gguf"
    r = subprocess.run([sys.executable, "-m", "edgerun", "quantize", str(tiny_llama), str(out), "--method", "rtn"],
                       capture_output=True, text=True, env=clean_env(tmp_path / "home"), timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    last = r.stderr.strip().splitlines()[-1]          # after the progress lines
    assert last.startswith("error: no space left on the disk holding") and "KiB free" in last, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1
    assert list(tiny_disk.iterdir()) == []


def test_every_atomic_writer_reports_a_full_disk(tiny_disk):
    from edgerun.errors import StorageError
    from edgerun.util.atomic import atomic_dir, write_bytes

    with pytest.raises(StorageError, match="no space left"):
        write_bytes(tiny_disk / "f.bin", b"x" * 1_000_000)
    with pytest.raises(StorageError, match="no space left"):
        with atomic_dir(tiny_disk / "d") as tmp:
            (tmp / "a").write_bytes(b"x" * 1_000_000)
    assert list(tiny_disk.iterdir()) == []


def test_schema_limits_are_invalid_arguments_before_llguidance():
    from edgerun.constrain.grammar import Grammar

    for schema in (*HOSTILE_SCHEMAS.values(), nested("items", 3000), nested("anyOf", 3000)):
        with pytest.raises(InvalidArgument):
            Grammar.json_schema(schema)
    for text in ("(a{1000}){1000}", "(" * 300 + "a" + ")" * 300):
        with pytest.raises(InvalidArgument, match="repeats up to|nests more than"):
            Grammar.regex(text)
    with pytest.raises(InvalidArgument, match="repeats up to"):
        Grammar.lark('start: ("a" ~ 1000){1000}')
    Grammar.lark('start: "{" item{3} "}"\nitem: /[a-z]{1,20}/')          # brackets in strings are text


# --- the sandboxed first compile ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_runtime(tiny_llama):
    from edgerun.runtime import load

    rt = load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=128, n_threads=1)
    yield rt
    rt.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox forks (Linux)")
def test_a_grammar_that_crashes_llguidance_is_refused_and_the_process_lives(tiny_runtime):
    """5,000 chained Lark rules overflow llguidance's stack when compiled in this process (a segfault);
    compiled first in the sandbox, they are a GrammarError naming the crash."""
    from edgerun.constrain import sandbox
    from edgerun.errors import GrammarError

    chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(5000)) + '\nr5000: "x"'
    with pytest.raises(GrammarError, match="crashes the grammar compiler"):
        tiny_runtime.constraint(grammar=chain)
    with pytest.raises(GrammarError, match="crashes the grammar compiler"):      # remembered: no second fork
        sandbox.vet(_grammar_source(chain), "the Lark grammar", lambda source, what: pytest.fail("ran again"))


def _grammar_source(text: str) -> str:
    from edgerun.constrain.grammar import Grammar
    return Grammar.lark(text).source


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox forks (Linux)")
def test_a_grammar_that_runs_away_is_stopped_by_the_sandbox():
    """A compile that spins inside one native call is stopped by the child's CPU limit (SIGXCPU); the
    budget between calls is grammar.py's (COMPILE_CPU_S, MASK_CPU_S)."""
    from edgerun.constrain import sandbox
    from edgerun.errors import GrammarError

    def spin(source, what):
        t = time.process_time()
        while time.process_time() - t < 30:
            pass

    with pytest.raises(GrammarError, match="takes more than 1 s of CPU"):
        sandbox.vet(f"runaway {time.time_ns()}", "the test grammar", spin)


def test_the_compile_budget_between_native_calls():
    from edgerun.constrain.grammar import COMPILE_CPU_S, Grammar, _within_budget
    from edgerun.errors import GrammarError

    g = Grammar.regex("a+")
    _within_budget(g, COMPILE_CPU_S / 2)
    with pytest.raises(GrammarError, match="ms of CPU to compile"):
        _within_budget(g, COMPILE_CPU_S * 2)


def test_a_hostile_tool_schema_over_http_is_a_400_before_the_queue(server, http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(5000)}, "required": [f"p{i}" for i in range(5000)]}}}
    r = http.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                              "tool_choice": "required", "max_tokens": 2})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and ("65536 are accepted" in msg or "takes more than" in msg), r.text[:300]
    alive(http)
