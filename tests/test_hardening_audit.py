"""Issue 50 audited row by row against the real CLI and server: the cases its first tests missed.

JSON nested thousands deep that arrives as *text* (a schema given as a string, a tool call's `arguments`,
a `--json-schema` or `--tools` file, a config.json) used to reach Python's json module unbounded: a
RecursionError, so a 500 from the server and a traceback from the CLI. A config.json whose values are of
the wrong kind (a float that is a string, a context length past GGUF's uint32) was a traceback. A full
disk that numpy reports as "Not enough free space to write N bytes" (a large tensor, megabytes still
free) was a traceback. And the body nesting limit answered `invalid_json` for valid JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgerun.errors import InvalidArgument, StorageError
from server_harness import TINY_ARGS, ServerProcess, clean_env

CHAT = "/v1/chat/completions"
FIX = Path(__file__).parent / "fixtures" / "int4"


def deep_text(key: str, n: int) -> str:
    if key == "items":
        return '{"items": ' * n + '{"type": "integer"}' + "}" * n
    if key == "anyOf":
        return '{"anyOf": [' * n + '{"type": "integer"}' + ', {"type": "string"}]}' * n
    return "[" * n + "]" * n


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS], env=clean_env(tmp_path_factory.mktemp("home")))
    srv.wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.output


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def alive(server, model) -> None:
    r = post(server, CHAT, {"model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]


# --- JSON text nested thousands deep --------------------------------------------------------------------

@pytest.mark.parametrize("key", ["items", "anyOf"])
@pytest.mark.parametrize("where", ["json_schema", "response_format"])
def test_a_schema_given_as_deep_text_is_a_400(server, tiny_llama, key, where):
    text = deep_text(key, 3000)
    body = {"model": str(tiny_llama), "prompt": "x", "max_tokens": 2}
    if where == "json_schema":
        body["json_schema"] = text
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": text}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and "more than 512 levels deep" in err["message"], err
    assert server.proc.poll() is None, server.output
    alive(server, tiny_llama)


@pytest.mark.parametrize("stream", [False, True])
def test_deep_tool_call_arguments_in_the_history_are_a_400(server, tiny_llama, stream):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_text("list", 5000)}}
    body = {"model": str(tiny_llama), "max_tokens": 2, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "and?"}]}
    r = post(server, CHAT, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and "arguments nests arrays and objects more than 512" in err["message"], err
    alive(server, tiny_llama)


@pytest.mark.parametrize("key", ["items", "anyOf"])
def test_a_body_nested_3000_deep_is_400_invalid_value(server, tiny_llama, key):
    """D1's expectation: the 3000-deep `items` and `anyOf` chains are 400 invalid_value (the body is valid
    JSON, over the nesting limit; `invalid_json` is for a body that is not JSON)."""
    schema = {"name": "x", "schema": {"x": 1}}
    raw = json.dumps({"model": str(tiny_llama), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "response_format": {"type": "json_schema", "json_schema": schema}})
    raw = raw.replace('{"x": 1}', deep_text(key, 3000))
    r = httpx.post(server.url + CHAT, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text[:300]
    assert "more than 512 levels deep" in r.json()["error"]["message"]


def test_a_model_answer_nested_too_deep_is_text_not_a_call():
    from edgerun.constrain.tools import parse_tools, parse_tool_calls

    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    answer = '<tool_call>{"name": "f", "arguments": ' + deep_text("list", 3000) + "}</tool_call>"
    content, calls = parse_tool_calls(answer, tools)
    assert calls == [] and content is not None


@pytest.mark.parametrize("key", ["items", "anyOf"])
def test_cli_json_schema_file_nested_3000_deep_is_one_line(tiny_llama, tmp_path, key):
    f = tmp_path / "deep.json"
    f.write_text(deep_text(key, 3000))
    r = subprocess.run([sys.executable, "-m", "edgerun", "generate", "x", "--model", str(tiny_llama), *TINY_ARGS,
                        "-n", "2", "--json-schema", str(f)], capture_output=True, text=True,
                       env=clean_env(tmp_path), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert r.stderr.strip().splitlines() == ["error: the JSON schema nests arrays and objects more than 512 levels "
                                             "deep; that is the limit"], r.stderr[-500:]


def test_cli_tools_file_nested_3000_deep_is_one_line(tiny_llama, tmp_path):
    f = tmp_path / "tools.json"
    f.write_text(deep_text("list", 3000))
    r = subprocess.run([sys.executable, "-m", "edgerun", "chat", "--model", str(tiny_llama), *TINY_ARGS,
                        "--tools", str(f)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       env=clean_env(tmp_path), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert "error: --tools nests arrays and objects more than 512 levels deep" in r.stderr
    assert "Traceback" not in r.stderr


def test_jsontext_bounds():
    from edgerun.util import jsontext

    assert jsontext.loads("[" * 512 + "]" * 512, "x") is not None
    for n in (513, 5000, 100_000):
        with pytest.raises(InvalidArgument, match="more than 512 levels deep"):
            jsontext.loads("[" * n + "]" * n, "x")
    with pytest.raises(json.JSONDecodeError):
        jsontext.loads("[", "x")


# --- config.json values of the wrong kind ---------------------------------------------------------------

def _convert(tmp_path: Path, write) -> subprocess.CompletedProcess:
    d = tmp_path / "ckpt"
    shutil.copytree(FIX / "awq-gemm-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    data = write(cfg)
    (d / "config.json").write_bytes(data if isinstance(data, bytes) else json.dumps(cfg).encode())
    out = tmp_path / "o.gguf"
    r = subprocess.run([sys.executable, "-m", "edgerun", "convert", str(d), str(out)], capture_output=True,
                       text=True, env=clean_env(tmp_path / "home"), timeout=60)
    assert out.exists() == (r.returncode == 0), r.stderr[-400:]
    return r


@pytest.mark.parametrize("write,message", [
    (lambda c: c.update(max_position_embeddings=10**15), "at most 4294967295 fits a GGUF file"),
    (lambda c: c.update(rms_norm_eps="x"), "rms_norm_eps must be a positive finite number"),
    (lambda c: c.update(rms_norm_eps=None), "rms_norm_eps must be a positive finite number"),
    (lambda c: c.update(rope_theta=-1), "rope_theta must be a positive finite number"),
    (lambda c: c.update(rope_theta=10**400), "rope_theta must be a positive finite number"),
    (lambda c: c.update(tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    (lambda c: c.update(architectures=5), "architectures is 5; expected a list of class names"),
    (lambda c: c["quantization_config"].update(modules_to_not_convert=5), "modules_to_not_convert is 5"),
    (lambda c: b"[1, 2]", "a JSON list; expected a JSON object"),
    (lambda c: b"[" * 5000 + b"]" * 5000, "more than 512 levels deep"),
    (lambda c: b"\xff\xfe{}", "not UTF-8 text"),
], ids=["n_ctx", "eps-str", "eps-null", "theta-neg", "theta-huge", "tied", "archs", "skip", "list", "deep", "utf8"])
def test_a_malformed_config_is_one_line(tmp_path, write, message):
    r = _convert(tmp_path, write)
    assert r.returncode == 2, (r.returncode, r.stderr[-400:])
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_config_with_rope_theta_null_takes_the_default(tmp_path):
    r = _convert(tmp_path, lambda c: c.update(rope_theta=None))
    assert r.returncode == 0, r.stderr[-400:]


# --- a full disk that numpy reports without an errno ------------------------------------------------------

@pytest.fixture
def disk_4m(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_tensor_larger_than_the_space_left_is_a_storage_error(disk_4m):
    """A 30 MB tensor after 1.7 MB of header on a 4 MiB disk: numpy cannot reserve the 30 MB and says "Not
    enough free space" with 2.3 MiB still free (what `edgerun quantize smollm2-135m-instruct` met)."""
    from edgerun.util.atomic import atomic_path

    with pytest.raises(StorageError, match=r"no space left on the disk holding .* MiB free"):
        with atomic_path(disk_4m / "out.gguf") as tmp:
            with open(tmp, "wb") as f:
                f.write(b"h" * 1_786_208)
                np.zeros(30_000_000, dtype=np.uint8).tofile(f)
    assert list(disk_4m.iterdir()) == []


def test_numpys_no_space_message_counts_as_a_full_disk(tmp_path):
    """The same classification where no small disk can be mounted: the OSError numpy raises (no errno),
    with plenty of space free where the file goes."""
    from edgerun.util.atomic import storage_errors

    with pytest.raises(StorageError, match="no space left"):
        with storage_errors(tmp_path / "out.gguf", space_only=True):
            raise OSError("Not enough free space to write 30081024 bytes after offset 1786208")
    with pytest.raises(OSError, match="something else"):          # other errno-less errors stay the writer's
        with storage_errors(tmp_path / "out.gguf", space_only=True):
            raise OSError("something else")


# --- the Quickstart installs every documented feature ----------------------------------------------------

def test_every_documented_install_builds_llama_cpp_with_rpc():
    """`edgerun worker`, `cluster status` and `--rpc` need llama.cpp's RPC backend: each fresh install (a new
    venv, then `pip install -e`, which builds llama-cpp-python) a newcomer is told to run carries
    -DGGML_RPC=on, and CI runs the README's test command verbatim. (Adding an extra to an existing venv
    does not rebuild llama.cpp.)"""
    root = Path(__file__).parent.parent
    installs = [(name, line) for name in ("README.md", "CONTRIBUTING.md")
                for line in (root / name).read_text().splitlines() if "-m venv" in line and "pip install -e" in line]
    assert len(installs) >= 3, installs
    for name, line in installs:
        assert 'CMAKE_ARGS="-DGGML_RPC=on' in line.split("pip install -e")[0], (name, line)
    ci_line = (root / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pip install -e '.[test]'" in ci_line and ci_line in (root / "README.md").read_text()


# --- a hub repository's config.json is network input too -----------------------------------------------------

@pytest.mark.parametrize("text,says", [("[" * 5000 + "]" * 5000, "more than 512 levels deep"),
                                       ("[1, 2]", "config.json is a JSON list; expected a JSON object")])
def test_a_hub_config_nested_deep_or_not_an_object_is_one_line(tmp_path, monkeypatch, text, says):
    pytest.importorskip("huggingface_hub")
    from click.testing import CliRunner

    from edgerun.cli import main
    from hubstandin import Server, StandIn
    from test_hub import _use_standin

    d = tmp_path / "repo"
    shutil.copytree(FIX / "awq-gemm-llama", d, ignore=shutil.ignore_patterns("dequant.npz"))
    (d / "config.json").write_text(text)
    hub_ = StandIn()
    hub_.add("tiny/bad-config", d)
    with Server(hub_) as url:
        _use_standin(monkeypatch, url, tmp_path)
        r = CliRunner().invoke(main, ["pull", "hf:tiny/bad-config"])
    assert r.exit_code == 2, (r.output, r.exception)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: hf:tiny/bad-config: config.json is ") and says in last, last


# --- a tool's parameters are a schema from the network too ------------------------------------------------

@pytest.mark.parametrize("params,says", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}, "repeats up to 1000000"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 2**31}}}, "maxLength is"),
    ({"type": "object", "properties": {"a": json.loads(deep_text("items", 150))}}, "levels deep"),
], ids=["repeat", "maxLength", "depth"])
def test_a_tools_parameters_get_the_schema_limits(server, tiny_llama, params, says):
    """D2's repetition bomb and the other schema limits hold for tools' parameters (they used to reach the
    sandbox: a million-fold repetition in a tool compiled there and was answered 200)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    r = post(server, CHAT, {"model": str(tiny_llama), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["message"].startswith("tools[0].function.parameters: ") \
        and says in err["message"], err


# --- a client admitted into a flooded queue is served next ------------------------------------------------

def test_a_client_admitted_into_a_flooded_queue_is_served_before_the_flood(tiny_llama):
    """The flooding client of tests/test_hardening.py (one generation held, the queue full of its requests):
    another client's request takes the newest flooder's place, and it is also the next to start, not the
    last (the issue's legitimate client was admitted and then waited behind the whole flood)."""
    from edgerun.request import Request
    from server_harness import wait_until
    from test_hardening import _ask_as_self, _flooded

    with _flooded(tiny_llama) as (srv, rt, sch, flood):
        out: dict = {}
        t = _ask_as_self(srv, str(tiny_llama), out)
        rt.gate.set()
        t.join(60)
        assert out["r"].status_code == 200, out["r"].text
        wait_until(lambda: len(rt.started) >= 4 and not sch._running and not sch._waiting, what="flood done")
        prompt = {tuple(rt.prepare(Request(prompt=p, max_tokens=1)).prompt_tokens): p for p in ("p0", "p1", "p2", "y")}
        order = [prompt.get(tuple(s), "?") for s in rt.started]
        assert order == ["p0", "y", "p1", "p2"], order


# --- real tool definitions: pydantic-style $defs --------------------------------------------------------------

ITEM_TOOL = {"type": "function", "function": {"name": "add_items", "parameters": {
    "$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string", "enum": ["a", "b"]},
                                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["name", "qty"], "additionalProperties": False}},
    "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                               "minItems": 1, "maxItems": 1}},
    "required": ["items"]}}}
OTHER_TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "definitions": {"Item": {"type": "string", "enum": ["x", "y"]}},
    "type": "object", "properties": {"it": {"$ref": "#/definitions/Item"}}, "required": ["it"]}}}


def test_tools_whose_parameters_use_defs_compile_and_generate(tiny_llama):
    """Generous enough for real tools: pydantic writes a tool's parameters with `$defs` and `$ref`s to them
    (two tools may both name a definition Item). They used to be refused: nested under `arguments` in the
    call grammar, "#/$defs/Item" pointed nowhere."""
    from edgerun.runtime import load

    rt = load(str(tiny_llama), draft=None, profile="generic-x86_64-cpu", n_ctx=2048, n_threads=1)
    try:
        for choice in ("required", {"type": "function", "function": {"name": "add_items"}}):
            c = rt.chat([{"role": "user", "content": "add"}], tools=[ITEM_TOOL, OTHER_TOOL], tool_choice=choice,
                        parallel_tool_calls=False, max_tokens=300, temperature=0)
            assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1, (c.finish_reason, c.text)
            assert choice == "required" or c.tool_calls[0]["function"]["name"] == "add_items"
            for call in c.tool_calls:
                args = json.loads(call["function"]["arguments"])
                if call["function"]["name"] == "add_items":
                    assert args["items"][0]["name"] in ("a", "b") and 1 <= args["items"][0]["qty"] <= 9, args
                else:
                    assert args["it"] in ("x", "y"), args
    finally:
        rt.close()
