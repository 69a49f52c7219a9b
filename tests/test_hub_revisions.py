"""Hub names over time and through the network a board has: a pinned revision, a repository that moves to a
new commit (the name keeps its commit offline; a re-pull links unchanged files instead of downloading them and
drops commits no name uses), a pull through an HTTP proxy, and nothing left in huggingface_hub's own cache.
The real huggingface_hub client against the test stand-in (tests/hubstandin.py), as in test_hub.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.request import Request, build_opener, HTTPRedirectHandler

import pytest

pytest.importorskip("huggingface_hub")

import edgerun  # noqa: E402
from edgerun.registry import hub  # noqa: E402
from hubstandin import Repo  # noqa: E402
from test_hub import _closed_port, home, ok, refused, repos, runner, standin  # noqa: E402,F401  (fixtures and helpers)


def _new_commit(standin, repo_id: str, tmp_path: Path, change) -> Repo:
    """The repository moves on: a copy of its folder, changed by `change(folder)`, is now its only commit."""
    folder = tmp_path / f"{repo_id.replace('/', '_')}-next"
    shutil.copytree(standin.repos[repo_id].folder, folder)
    change(folder)
    old = standin.repos[repo_id]
    new = standin.add(repo_id, folder, gated_token=old.gated_token)
    assert new.commit != old.commit
    return new


def test_a_pinned_revision(standin, runner):
    commit = standin.repos["tiny/tiny-GGUF"].commit
    path = Path(ok(runner, "pull", f"hf:tiny/tiny-GGUF@{commit}:Q8_0").stdout.strip())
    assert path.parent.name == commit and path.name == "tiny-Q8_0.gguf"
    pick = hub.cached(f"hf:tiny/tiny-GGUF@{commit}:q8_0")                      # the tag in any case
    assert pick is not None and (pick.requested_revision, pick.revision) == (commit, commit)
    assert hub.cached("hf:tiny/tiny-GGUF:Q8_0") is None                         # another name: not pulled
    rows = {x["name"]: x for x in json.loads(ok(runner, "list", "--json").stdout)}
    assert rows[f"hf:tiny/tiny-GGUF@{commit}:Q8_0"]["requested_revision"] == commit
    branch = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF@main:Q8_0").stdout.strip())
    assert branch == path                                                       # same commit, same file
    assert len(standin.downloads()) == 1


def test_a_new_commit_keeps_the_old_offline_then_relinks_unchanged_files(standin, runner, monkeypatch, tmp_path):
    first = standin.repos["tiny/tiny-GGUF"].commit
    q8 = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF").stdout.strip())
    f32 = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF:F32").stdout.strip())
    assert q8.parent.name == first and standin.downloads() == [("tiny/tiny-GGUF/tiny-Q8_0.gguf", None),
                                                               ("tiny/tiny-GGUF/tiny-F32.gguf", None)]

    def edit(folder: Path) -> None:                                            # a README edit, a new F32 file
        (folder / "README.md").write_text("a tiny model, now documented\n")
        (folder / "tiny-F32.gguf").write_bytes((folder / "tiny-F32.gguf").read_bytes() + bytes(32))

    second = _new_commit(standin, "tiny/tiny-GGUF", tmp_path, edit).commit

    # the names keep meaning the commit they were pulled at, with no network, until pulled again
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    out = ok(runner, "generate", "The", "--model", "hf:tiny/tiny-GGUF", "--no-pull", "--draft", "none",
             "-n", "3", "-t", "0", "--threads", "1", "--json")
    assert json.loads(out.stdout)["n_tokens"] == 3
    assert hub.cached("hf:tiny/tiny-GGUF").revision == first
    monkeypatch.setenv("HF_ENDPOINT", standin.url)

    n = len(standin.downloads())
    q8_new = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF").stdout.strip())
    assert q8_new.parent.name == second and q8_new.name == "tiny-Q8_0.gguf"
    assert len(standin.downloads()) == n                                        # unchanged: linked, not fetched
    assert q8_new.stat().st_ino == q8.stat().st_ino                             # one copy on disk
    assert hub.verify(hub.cached("hf:tiny/tiny-GGUF")) == []
    assert f32.is_file()                                                        # :F32 still names the first commit
    assert hub.cached("hf:tiny/tiny-GGUF:F32").revision == first

    f32_new = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF:F32").stdout.strip())
    assert standin.downloads()[n:] == [("tiny/tiny-GGUF/tiny-F32.gguf", None)]  # changed: downloaded
    assert f32_new.parent.name == second
    assert not (home() / "hub/tiny/tiny-GGUF" / first).exists()                # no name uses it: dropped
    assert sorted(p.name for p in (home() / "hub/tiny/tiny-GGUF").iterdir() if not p.name.startswith(".")) == \
        sorted(["picks", second])


def test_a_pinned_name_keeps_its_commit_when_another_name_moves_on(standin, runner, tmp_path):
    first = standin.repos["tiny/tiny-GGUF"].commit
    ok(runner, "pull", f"hf:tiny/tiny-GGUF@{first}:Q8_0")
    _new_commit(standin, "tiny/tiny-GGUF", tmp_path, lambda d: (d / "README.md").write_text("v2\n"))
    ok(runner, "pull", "hf:tiny/tiny-GGUF:Q8_0")
    assert hub.cached(f"hf:tiny/tiny-GGUF@{first}:Q8_0") is not None          # still there, still complete
    assert (home() / "hub/tiny/tiny-GGUF" / first / "tiny-Q8_0.gguf").is_file()


def test_an_earlier_copy_changed_on_disk_is_downloaded_not_linked(standin, runner, tmp_path):
    old = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF").stdout.strip())
    data = bytearray(old.read_bytes())                                          # a bit rots, same size
    data[len(data) // 2] ^= 0x04
    old.write_bytes(bytes(data))
    _new_commit(standin, "tiny/tiny-GGUF", tmp_path, lambda d: (d / "README.md").write_text("v2\n"))
    new = Path(ok(runner, "pull", "hf:tiny/tiny-GGUF").stdout.strip())
    assert [p for p, _ in standin.downloads()] == ["tiny/tiny-GGUF/tiny-Q8_0.gguf"] * 2
    assert new.read_bytes() == (standin.repos["tiny/tiny-GGUF"].folder / "tiny-Q8_0.gguf").read_bytes()


class _Proxy:
    """A forwarding HTTP proxy on 127.0.0.1 that counts what went through it (plain http, absolute URLs)."""

    def __init__(self):
        self.seen: list[str] = []
        proxy = self

        class NoRedirect(HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None                     # a redirect is the client's to follow, through the proxy again

        opener = build_opener(NoRedirect)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                proxy.seen.append(f"{self.command} {self.path}")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-connection", "host")}
                req = Request(self.path, headers=headers, method=self.command)
                try:
                    resp = opener.open(req, timeout=30)
                except Exception as e:          # urllib raises for 3xx/4xx: they are answers to pass on
                    resp = e
                body = resp.read() if self.command != "HEAD" else b""
                self.send_response(resp.status if hasattr(resp, "status") else resp.code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if self.command != "HEAD"
                                                       else resp.headers.get("Content-Length", 0)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_pull_goes_through_the_proxy_the_environment_names(standin, monkeypatch):
    for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    # in a new process each time, as a user runs it: huggingface_hub reads the proxy settings once per process
    env = {**os.environ, "PYTHONPATH": str(Path(edgerun.__file__).parents[1]),
           "HTTP_PROXY": f"http://127.0.0.1:{_closed_port()}"}                 # a proxy that is down
    r = subprocess.run([sys.executable, "-m", "edgerun", "pull", "hf:tiny/tiny-GGUF"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot reach the hub" in r.stderr and "proxy" in r.stderr, r.stderr
    assert standin.log == []
    proxy = _Proxy()
    try:
        env["HTTP_PROXY"] = proxy.url
        r = subprocess.run([sys.executable, "-m", "edgerun", "pull", "hf:tiny/big-GGUF"], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.read_bytes() == (standin.repos["tiny/big-GGUF"].folder / "big-F32.gguf").read_bytes()
    assert any("/api/models/tiny/big-GGUF" in s for s in proxy.seen)            # the API call
    assert any("/cdn/tiny/big-GGUF/big-F32.gguf" in s for s in proxy.seen)      # and the download, redirected


def test_nothing_lands_in_huggingface_hubs_cache(standin, runner):
    ok(runner, "pull", "hf:tiny/tiny-GGUF")
    ok(runner, "pull", "hf:tiny/awq-llama")
    hf_home = Path(os.environ["HF_HOME"])
    files = [p for p in hf_home.rglob("*") if p.is_file()] if hf_home.exists() else []
    assert files == []


def test_a_re_pull_that_only_links_needs_no_free_space(standin, runner, tmp_path, monkeypatch):
    ok(runner, "pull", "hf:tiny/tiny-GGUF")
    _new_commit(standin, "tiny/tiny-GGUF", tmp_path, lambda d: (d / "README.md").write_text("v2\n"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))   # a full board
    ok(runner, "pull", "hf:tiny/tiny-GGUF")                                     # the weights are linked
    refused(runner, "pull", "hf:tiny/tiny-GGUF:F32", says=("not enough free disk space", "(1 file)"))


def test_a_model_llama_cpp_cannot_run_is_not_left_looking_pulled(standin, runner):
    refused(runner, "pull", "hf:tiny/alien-GGUF", says=("llama.cpp cannot load", "architecture 'zzzzz'",
                                                         "the downloaded files were removed"))
    assert hub.cached("hf:tiny/alien-GGUF") is None
    assert "hf:tiny/alien-GGUF" not in {x["name"] for x in json.loads(ok(runner, "list", "--json").stdout)}
    assert not list((home() / "hub/tiny/alien-GGUF").rglob("*.gguf"))          # no unusable weights kept


@pytest.mark.parametrize("fixture", ["gptq-llama", "ct-asym-qwen2"])
def test_gptq_and_compressed_tensors_checkpoints_generate_as_their_folders_do(standin, runner, fixture, tmp_path):
    """The AWQ one is test_hub.py's; these two take the same way in, and answer as `--model DIR` does."""
    folder = tmp_path / fixture
    shutil.copytree(Path(__file__).parent / "fixtures" / "int4" / fixture, folder,
                    ignore=shutil.ignore_patterns("dequant.npz"))
    standin.add(f"tiny/{fixture}", folder)
    ok(runner, "pull", f"hf:tiny/{fixture}")
    args = ["-n", "8", "-t", "0", "--threads", "1", "--draft", "none", "--json"]
    hub_out = json.loads(ok(runner, "generate", "The", "--model", f"hf:tiny/{fixture}", "--no-pull", *args).stdout)
    dir_out = json.loads(ok(runner, "generate", "The", "--model", str(folder), *args).stdout)
    assert hub_out["n_tokens"] == 8 and hub_out["text"] == dir_out["text"]
    assert {p.rsplit("/", 1)[-1] for p, _ in standin.downloads()} >= {"config.json", "model.safetensors"}


def test_without_the_client_a_pull_says_to_install_it_and_cached_models_still_run(standin, runner, monkeypatch):
    ok(runner, "pull", "hf:tiny/tiny-GGUF")
    for mod in [m for m in sys.modules if m == "huggingface_hub" or m.startswith("huggingface_hub.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)                  # `import huggingface_hub` fails
    refused(runner, "pull", "hf:tiny/tiny-GGUF:F32", says=("pip install 'edgerun[hub]'",))
    out = ok(runner, "generate", "The", "--model", "hf:tiny/tiny-GGUF", "--no-pull", "--draft", "none",
             "-n", "3", "-t", "0", "--threads", "1", "--json")                 # a board given the cache by hand
    assert json.loads(out.stdout)["n_tokens"] == 3
    assert "hf:tiny/tiny-GGUF" in ok(runner, "list").stdout
