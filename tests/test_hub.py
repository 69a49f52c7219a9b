"""Hub names (hf:ORG/REPO[@REV][:QUANT|/FILE.gguf]) with the real huggingface_hub client against a local stand-in
for the hub (tests/hubstandin.py; the hub itself is unreachable from the development machines)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("huggingface_hub")

import edgerun  # noqa: E402
from edgerun.cli import main  # noqa: E402
from edgerun.errors import InvalidArgument  # noqa: E402
from edgerun.registry import hub  # noqa: E402
from hubstandin import Server, StandIn  # noqa: E402
from tinymodel import tiny_weights, write_hf_checkpoint, write_tiny_model  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "int4"
TOKEN = "hf_test_token_for_the_gated_repo"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """The folders the stand-in serves, one per repository."""
    import gguf

    root = tmp_path_factory.mktemp("hub_repos")
    r = {}
    d = r["tiny/tiny-GGUF"] = root / "tiny-GGUF"
    write_tiny_model(d / "tiny-Q8_0.gguf", wtype="q8_0")
    write_tiny_model(d / "tiny-F32.gguf")
    write_tiny_model(d / "mmproj-tiny-Q8_0.gguf", wtype="q8_0", seed=3)     # a side file, never a pick
    (d / "README.md").write_text("a tiny model\n")
    d = r["tiny/split-GGUF"] = root / "split-GGUF"
    d.mkdir()
    orig = gguf.GGUFWriter
    gguf.GGUFWriter = functools.partial(orig, split_max_tensors=12)
    try:
        write_tiny_model(d / "tiny-Q4_0.gguf", wtype="q4_0", seed=1)
    finally:
        gguf.GGUFWriter = orig
    d = r["tiny/big-GGUF"] = root / "big-GGUF"                 # over the client's 10 MiB write chunk
    write_tiny_model(d / "big-F32.gguf", n_embd=512, n_ff=2048, n_layer=1, seed=2)
    d = r["tiny/awq-llama"] = root / "awq-llama"
    shutil.copytree(FIX / "awq-gemm-llama", d, ignore=shutil.ignore_patterns("dequant.npz"))
    d = r["tiny/awq-gpt2"] = root / "awq-gpt2"                 # an INT4 checkpoint of an architecture not converted
    shutil.copytree(FIX / "awq-gemm-llama", d, ignore=shutil.ignore_patterns("dequant.npz"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    d = r["tiny/float-llama"] = root / "float-llama"
    config, hf = tiny_weights("llama", 2, 64, 4, 2, 128, False, 0, 0, n_ctx=2048)
    write_hf_checkpoint(d, config, hf)
    d = r["tiny/gated-GGUF"] = root / "gated-GGUF"
    write_tiny_model(d / "gated-Q4_K_M.gguf", wtype="q8_0")
    d = r["tiny/alien-GGUF"] = root / "alien-GGUF"
    write_tiny_model(d / "alien-Q8_0.gguf", wtype="q8_0")
    _rename_arch(d / "alien-Q8_0.gguf")
    d = r["tiny/docs-only"] = root / "docs-only"
    d.mkdir()
    (d / "README.md").write_text("weights elsewhere\n")
    (d / "notes.txt").write_text("x\n")
    return r


def _rename_arch(path: Path) -> None:
    """Give a GGUF an architecture name llama.cpp does not know (same length, so the file keeps its layout)."""
    data = path.read_bytes()
    key = b"general.architecture"
    i = data.index(key) + len(key) + 4 + 8          # value type (u32) and string length (u64)
    assert data[i:i + 5] == b"llama"
    path.write_bytes(data[:i] + b"zzzzz" + data[i + 5:])


def _use_standin(monkeypatch, url: str, tmp_path: Path) -> None:
    """Point the hub client at a stand-in server, with a fresh edgerun home and hub cache and no token."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture
def standin(repos, tmp_path, monkeypatch):
    hub_ = StandIn()
    for repo_id, folder in repos.items():
        hub_.add(repo_id, folder, gated_token=TOKEN if "gated" in repo_id else None)
    with Server(hub_) as url:
        _use_standin(monkeypatch, url, tmp_path)
        yield hub_


@pytest.fixture
def runner():
    return CliRunner()


def ok(runner, *args):
    r = runner.invoke(main, list(args))
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def refused(runner, *args, says: tuple[str, ...]):
    r = runner.invoke(main, list(args))
    assert r.exit_code == 2, (r.output, r.exception)
    last = r.stderr.strip().splitlines()[-1]            # progress lines may come before it
    assert last.startswith("error: ") and "Traceback" not in r.output, r.output
    for s in says:
        assert s in last, last
    return last


def home() -> Path:
    return Path(os.environ["EDGERUN_HOME"])


def nothing_complete_looking(repo_id: str) -> None:
    d = home() / "hub" / repo_id
    assert not list(d.glob("picks/*.json"))
    assert not [p for p in d.glob("*/*") if not p.name.startswith(".")      # no file under a commit
                and not p.parent.name.startswith(".") and p.parent.name != "picks"]


# ---- names and the picking rule ---------------------------------------------------------------------------------

def test_names():
    n = hub.parse_name("hf:ggml-org/gemma-3-1b-it-GGUF@abc123:q4_k_m")
    assert (n.repo_id, n.revision, n.quant, n.file) == ("ggml-org/gemma-3-1b-it-GGUF", "abc123", "Q4_K_M", None)
    assert str(n) == "hf:ggml-org/gemma-3-1b-it-GGUF@abc123:Q4_K_M"
    n = hub.parse_name("hf:org/repo.v2/sub/model-Q8_0.gguf")
    assert (n.repo_id, n.revision, n.quant, n.file) == ("org/repo.v2", None, None, "sub/model-Q8_0.gguf")
    assert hub.parse_name("hf:org/repo").key != hub.parse_name("hf:org/repo:Q8_0").key
    for bad in ("hf:repo-without-org", "hf:org/repo:Q4:K", "hf:org/repo/model.bin", "hf:"):
        with pytest.raises(InvalidArgument, match="hf:ORG/REPO"):
            hub.parse_name(bad)


def test_picking_rule_is_llama_cpps():
    files = ["README.md", "mmproj-model-Q4_K_M.gguf", "model-F16.gguf", "model-Q4_K_M-00002-of-00002.gguf",
             "model-Q4_K_M-00001-of-00002.gguf", "model-Q8_0.gguf", "model.imatrix.gguf", "sub/model-IQ4_NL.gguf"]
    assert hub.pick_gguf(files, None) == "model-Q4_K_M-00001-of-00002.gguf"     # Q4_K_M first, first split part
    assert hub.split_parts(files, "model-Q4_K_M-00001-of-00002.gguf") == [
        "model-Q4_K_M-00001-of-00002.gguf", "model-Q4_K_M-00002-of-00002.gguf"]
    assert hub.pick_gguf(files, "q8_0") == "model-Q8_0.gguf"                     # any case
    assert hub.pick_gguf(files, "IQ4_NL") == "sub/model-IQ4_NL.gguf"
    assert hub.pick_gguf(files, "Q5_K_M") is None                                # a tag never falls back
    assert hub.pick_gguf([f for f in files if "Q4_K_M" not in f], None) == "model-Q8_0.gguf"
    assert hub.pick_gguf(["a-F16.gguf", "b-BF16.gguf"], None) == "a-F16.gguf"    # else the first model file
    # the tag is searched anywhere, followed by '.' or '-': llama.cpp's :F16 takes a BF16 file listed first too
    assert hub.pick_gguf(["a-BF16.gguf", "b-F16.gguf"], "F16") == "a-BF16.gguf"
    assert hub.pick_gguf(["a-F16x.gguf", "b-F16.gguf"], "F16") == "b-F16.gguf"
    with pytest.raises(Exception, match="1 of its 2 parts"):
        hub.split_parts(["m-00001-of-00002.gguf"], "m-00001-of-00002.gguf")


# ---- pulling a GGUF: verified, offline thereafter -------------------------------------------------------------

def test_pull_second_pull_no_pull_list_verify(standin, runner, monkeypatch):
    r = ok(runner, "pull", "hf:tiny/tiny-GGUF")
    path = Path(r.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and path.is_file()                      # no Q4_K_M: Q8_0 by the rule
    assert path.read_bytes() == (standin.repos["tiny/tiny-GGUF"].folder / "tiny-Q8_0.gguf").read_bytes()
    assert path.parent.name == standin.repos["tiny/tiny-GGUF"].commit
    assert standin.downloads() == [("tiny/tiny-GGUF/tiny-Q8_0.gguf", None)]
    commit = standin.repos["tiny/tiny-GGUF"].commit
    assert ("GET", f"/tiny/tiny-GGUF/resolve/{commit}/tiny-Q8_0.gguf", None) in standin.log     # then the CDN
    assert "download tiny-Q8_0.gguf" in r.stderr                                 # progress
    assert not (Path(os.environ["HF_HOME"]) / "hub").exists()                    # no second copy in HF's cache
    record = json.loads(next((home() / "hub/tiny/tiny-GGUF/picks").glob("*.json")).read_text())
    assert record["revision"] == standin.repos["tiny/tiny-GGUF"].commit
    import hashlib
    assert record["files"]["tiny-Q8_0.gguf"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    n = len(standin.downloads())
    assert Path(ok(runner, "pull", "hf:tiny/tiny-GGUF").stdout.strip()) == path
    assert len(standin.downloads()) == n                                         # the second pull fetches nothing

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")     # the hub is gone now
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = ok(runner, "generate", "The", "--model", "hf:tiny/tiny-GGUF", "--no-pull", "--draft", "none",
             "-n", "6", "-t", "0", "--threads", "1", "--json")
    assert json.loads(out.stdout)["n_tokens"] == 6
    rows = {x["name"]: x for x in json.loads(ok(runner, "list", "--json").stdout)}
    row = rows["hf:tiny/tiny-GGUF"]
    assert row["revision"] == standin.repos["tiny/tiny-GGUF"].commit and row["path"] == str(path)
    table = ok(runner, "list").stdout
    assert "hf:tiny/tiny-GGUF" in table and "hub gguf" in table
    assert f"tiny-Q8_0.gguf @ {standin.repos['tiny/tiny-GGUF'].commit[:12]}" in table
    ok(runner, "pull", "--verify")                                               # re-hash: fine, no network

    data = bytearray(path.read_bytes())                                          # a bit rots on disk
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))
    refused(runner, "pull", "--verify", says=("cannot reach the hub",))         # it must fetch the file again
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert Path(ok(runner, "pull", "--verify", "hf:tiny/tiny-GGUF").stdout.strip()) == path
    assert len(standin.downloads()) == n + 1 and hub.verify(hub.cached("hf:tiny/tiny-GGUF")) == []


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_no_pull_refuses_with_what_is_cached(standin, runner):
    refused(runner, "generate", "x", "--model", "hf:tiny/tiny-GGUF:F32", "--no-pull",
            says=("not in the cache", "edgerun pull hf:tiny/tiny-GGUF:F32", "nothing from tiny/tiny-GGUF"))
    ok(runner, "pull", "hf:tiny/tiny-GGUF:Q8_0")
    refused(runner, "generate", "x", "--model", "hf:tiny/tiny-GGUF:F32", "--no-pull",
            says=("cached: hf:tiny/tiny-GGUF:Q8_0 (revision",))
    assert standin.downloads()


def test_a_corrupted_byte_is_refused_and_nothing_is_left(standin, runner):
    standin.corrupt.add("tiny/tiny-GGUF/tiny-F32.gguf")
    refused(runner, "pull", "hf:tiny/tiny-GGUF:F32", says=("tiny-F32.gguf as downloaded", "does not match"))
    nothing_complete_looking("tiny/tiny-GGUF")
    assert not list((home() / "hub/tiny/tiny-GGUF/.staging").glob("*"))         # the bad body was deleted
    standin.corrupt.clear()
    path = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF:F32").stdout.strip())
    assert path.name == "tiny-F32.gguf"


def test_huggingface_hub_alone_accepts_the_corrupted_byte(standin, tmp_path):
    """Why edgerun hashes: the client's own download takes a flipped byte (and proves the stand-in's shapes)."""
    from huggingface_hub import hf_hub_download

    standin.corrupt.add("tiny/tiny-GGUF/tiny-F32.gguf")
    got = Path(hf_hub_download("tiny/tiny-GGUF", "tiny-F32.gguf", local_dir=tmp_path / "plain",
                               endpoint=standin.url))
    want = (standin.repos["tiny/tiny-GGUF"].folder / "tiny-F32.gguf").read_bytes()
    assert got.stat().st_size == len(want) and got.read_bytes() != want


def test_resume_after_a_killed_pull(standin, runner):
    repo = standin.repos["tiny/big-GGUF"]
    size = (repo.folder / "big-F32.gguf").stat().st_size
    assert size > 12 << 20
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE                                        # the client writes in these
    if chunk + (1 << 20) >= size:
        pytest.skip(f"this huggingface_hub writes {chunk} bytes at a time: more than the test file holds")
    standin.stall["tiny/big-GGUF/big-F32.gguf"] = chunk + (1 << 20)             # send a chunk and more, then hang
    env = {**os.environ, "PYTHONPATH": str(Path(edgerun.__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "edgerun", "pull", "hf:tiny/big-GGUF"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = home() / "hub/tiny/big-GGUF/.staging"
    try:
        assert standin.stalled.wait(60), "the pull never reached the stall"
        for _ in range(600):
            if parts.is_dir() and [p for p in parts.glob("*.part") if p.stat().st_size >= chunk]:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    nothing_complete_looking("tiny/big-GGUF")
    part = next(parts.glob("*.part"))
    have = part.stat().st_size
    assert 0 < have < size
    standin.release.set()
    path = Path(ok(runner, "pull", "hf:tiny/big-GGUF").stdout.strip())
    last = standin.downloads()[-1]
    assert last[1] == f"bytes={have}-"                                           # resumed, not started over
    assert path.read_bytes() == (repo.folder / "big-F32.gguf").read_bytes()
    assert not part.exists()


def test_split_gguf_is_pulled_whole_and_loads(standin, runner):
    folder = standin.repos["tiny/split-GGUF"].folder
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-Q4_0-00001-of-00002.gguf",
                                                        "tiny-Q4_0-00002-of-00002.gguf"]
    path = Path(ok(runner, "pull", "hf:tiny/split-GGUF:Q4_0").stdout.strip())
    assert path.name == "tiny-Q4_0-00001-of-00002.gguf" and (path.parent / "tiny-Q4_0-00002-of-00002.gguf").is_file()
    out = ok(runner, "generate", "The", "--model", "hf:tiny/split-GGUF:Q4_0", "--no-pull", "--draft", "none",
             "-n", "4", "-t", "0", "--threads", "1", "--json")
    assert json.loads(out.stdout)["n_tokens"] == 4


# ---- an INT4 checkpoint: downloaded, converted once, generating ------------------------------------------------

def test_int4_checkpoint_is_converted_once_and_generates(standin, runner):
    path = Path(ok(runner, "pull", "hf:tiny/awq-llama").stdout.strip())
    assert path.parent == home() / "models" / "converted" and path.name.startswith("awq-llama-")
    m = path.stat().st_mtime_ns
    args = ["generate", "The", "--model", "hf:tiny/awq-llama", "--no-pull", "--draft", "none", "-n", "8", "-t", "0",
            "--threads", "1", "--json"]
    t1 = json.loads(ok(runner, *args).stdout)
    t2 = json.loads(ok(runner, *args).stdout)
    assert t1["n_tokens"] == 8 and t1["text"] == t2["text"]
    assert path.stat().st_mtime_ns == m                                          # converted once
    got = {p.rsplit("/", 1)[-1] for p, _ in standin.downloads()}
    assert "config.json" in got and "model.safetensors" in got and "dequant.npz" not in got


def test_float_only_repo_is_refused_with_the_quantize_command(standin, runner, tmp_path):
    refused(runner, "pull", "hf:tiny/float-llama",
            says=("float weights", "`edgerun quantize hf:tiny/float-llama float-llama-q4.gguf`"))
    assert not list((home() / "hub/tiny/float-llama").glob("picks/*"))
    out = tmp_path / "float-llama-q4.gguf"                                       # and that command works
    ok(runner, "quantize", "hf:tiny/float-llama", str(out), "--method", "rtn", "--json")
    assert out.is_file()


# ---- --draft auto for a hub model ------------------------------------------------------------------------------

def test_draft_auto_finds_a_same_vocabulary_model_else_suffix_lookup(standin, runner):
    from edgerun.resolve import auto_draft

    ok(runner, "pull", "hf:tiny/tiny-GGUF:F32")
    assert auto_draft("hf:tiny/tiny-GGUF:F32") == "suffix"                       # nothing else shares its vocab
    out = ok(runner, "generate", "The", "--model", "hf:tiny/tiny-GGUF:F32", "--no-pull", "-n", "6", "-t", "0",
             "--threads", "1", "--json")
    assert json.loads(out.stdout)["n_tokens"] == 6                               # with the suffix drafter
    ok(runner, "pull", "hf:tiny/tiny-GGUF:Q8_0")                                # smaller, same vocabulary
    assert auto_draft("hf:tiny/tiny-GGUF:F32") == "hf:tiny/tiny-GGUF:Q8_0"
    assert auto_draft("hf:tiny/tiny-GGUF:Q8_0") == "suffix"                     # a drafter is smaller
    rows = {x["name"]: x for x in json.loads(ok(runner, "list", "--json").stdout)}
    assert rows["hf:tiny/tiny-GGUF:F32"]["draft_pairs"] == ["hf:tiny/tiny-GGUF:Q8_0"]
    out = ok(runner, "generate", "The", "--model", "hf:tiny/tiny-GGUF:F32", "--no-pull", "-n", "6", "-t", "0",
             "--threads", "1", "--json")
    assert json.loads(out.stdout)["n_tokens"] == 6


# ---- errors ----------------------------------------------------------------------------------------------------

def test_errors(standin, runner, monkeypatch):
    refused(runner, "pull", "hf:tiny/no-such-repo", says=("no repository tiny/no-such-repo", "HF_TOKEN"))
    refused(runner, "pull", "hf:tiny/tiny-GGUF@0123456789abcdef0123456789abcdef01234567",
            says=("has no revision",))
    refused(runner, "pull", "hf:tiny/gated-GGUF",
            says=("gated", "Access to model tiny/gated-GGUF is restricted", "hf auth login", "HF_TOKEN"))
    assert not list((home() / "hub/tiny/gated-GGUF").rglob("*.part"))          # no empty part left behind
    refused(runner, "pull", "hf:tiny/docs-only", says=("its files: README.md, notes.txt",))
    refused(runner, "pull", "hf:tiny/tiny-GGUF:Q5_K_M",
            says=("no GGUF in tiny/tiny-GGUF has the quant tag Q5_K_M", "tiny-Q8_0.gguf", "quant tags: "))
    refused(runner, "pull", "hf:tiny/tiny-GGUF/nope.gguf", says=("has no file nope.gguf", "tiny-F32.gguf"))
    refused(runner, "pull", "hf:tiny/alien-GGUF", says=("llama.cpp cannot load", "architecture 'zzzzz'"))
    refused(runner, "pull", "hf:tiny/awq-gpt2", says=("unsupported architecture ['GPT2LMHeadModel']",))
    assert not [p for p, _ in standin.downloads() if p.endswith(".safetensors")]   # refused before the weights
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert Path(ok(runner, "pull", "hf:tiny/gated-GGUF").stdout.strip()).name == "gated-Q4_K_M.gguf"
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    refused(runner, "pull", "hf:tiny/gated-GGUF:Q8_0",
            says=("cannot reach the hub", "cached: hf:tiny/gated-GGUF (revision"))


def test_serve_precheck_lets_a_hub_name_not_pulled_yet_through(standin):
    from edgerun.serve.run import precheck
    from edgerun.serve.settings import ServerConfig

    precheck(ServerConfig(model="hf:tiny/tiny-GGUF", draft="none"))              # pulled after the socket binds
    assert standin.downloads() == []
    with pytest.raises(InvalidArgument, match="not a hub name"):
        precheck(ServerConfig(model="hf:no-org-here", draft="none"))


def test_not_enough_disk_space(standin, runner, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1000))
    refused(runner, "pull", "hf:tiny/tiny-GGUF", says=("not enough free disk space", "(1 file)"))
    assert standin.downloads() == []


@pytest.mark.real_model
def test_draft_auto_pairs_a_hub_model_with_the_registry_model_of_its_vocabulary(tmp_path, monkeypatch, runner):
    """A hub GGUF with SmolLM2's vocabulary (the registry's file with bytes appended, so larger) is drafted by
    the registry's smollm2-135m-instruct, found by the fingerprint recorded at pull time."""
    from edgerun import registry
    from edgerun.resolve import auto_draft

    src = registry.cached_path("smollm2-135m-instruct")
    if not registry.is_cached("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct is not cached (edgerun pull smollm2-135m-instruct)")
    folder = tmp_path / "repo"
    folder.mkdir()
    big = folder / "SmolLM2-big-Q4_1.gguf"
    shutil.copyfile(src, big)
    with open(big, "ab") as f:                                                   # llama.cpp ignores trailing bytes
        f.write(bytes(1 << 20))
    hub_ = StandIn()
    hub_.add("test/SmolLM2-big-GGUF", folder)
    with Server(hub_) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        ok(runner, "pull", "hf:test/SmolLM2-big-GGUF")
    assert auto_draft("hf:test/SmolLM2-big-GGUF") == "smollm2-135m-instruct"
    rows = {x["name"]: x for x in json.loads(ok(runner, "list", "--json").stdout)}
    assert rows["hf:test/SmolLM2-big-GGUF"]["draft_pairs"] == ["smollm2-135m-instruct"]
