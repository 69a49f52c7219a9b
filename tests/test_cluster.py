"""A model split over RPC workers (edgerun/cluster/): real `edgerun worker` processes on loopback (ggml's own
RPC server inside llama-cpp-python), a real head (`edgerun generate/serve --rpc`), real kill -9.

Tests that need llama.cpp's RPC backend skip, with the reason, on a llama-cpp-python built without it.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from edgerun.cluster import rpc, split
from server_harness import ServerProcess, clean_env
import ssh_tunnel

MODEL_PATH = Path.home() / ".cache" / "edgerun" / "models" / "smollm2-135m-instruct.gguf"
HEAD_ARGS = ("--model", str(MODEL_PATH), "--draft", "none", "--profile", "generic-x86_64-cpu", "--threads", "1",
             "--ctx", "512", "--no-pull")


def _has_rpc() -> bool:
    try:
        return rpc.supports_rpc()
    except Exception:      # noqa: BLE001 - no llama-cpp-python at all: the same skip
        return False


needs_rpc = pytest.mark.skipif(not _has_rpc(), reason="this llama-cpp-python has no RPC backend (rebuild: "
                               + rpc.REBUILD + ")")
needs_model = pytest.mark.skipif(not MODEL_PATH.exists(), reason=f"{MODEL_PATH} is not cached (edgerun pull "
                                 "smollm2-135m-instruct)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`edgerun worker` on a free loopback port."""

    def __init__(self, home: Path, *args: str) -> None:
        self.port = free_port()
        self.ep = rpc.Endpoint("127.0.0.1", self.port)
        self.proc = subprocess.Popen([sys.executable, "-m", "edgerun", "worker", "--port", str(self.port),
                                      "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=clean_env(home, GGML_NO_BACKTRACE="1"))
        if not rpc.wait_listening(self.ep, 30):
            self.proc.kill()
            raise AssertionError("worker did not start:\n" + self.proc.communicate()[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    if not _has_rpc():
        pytest.skip("this llama-cpp-python has no RPC backend")
    home = tmp_path_factory.mktemp("workers")
    ws = [Worker(home, "--cache", "none"), Worker(home, "--cache", "none")]
    yield ws
    for w in ws:
        w.kill()


def run_cli(*args: str, home: Path, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgerun", *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(home, GGML_NO_BACKTRACE="1", **env))


def one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


# --- the worker's address: loopback by default, never every address ------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_worker_refuses_every_address(host):
    r = CliRunner().invoke(main, ["worker", "--host", host, "--allow-network"])
    assert r.exit_code == 2 and r.stderr.startswith("error: refusing --host") and "authentication" in r.stderr


def test_worker_needs_allow_network_for_another_address():
    r = CliRunner().invoke(main, ["worker", "--host", "192.168.1.20"])
    assert r.exit_code == 2 and "--allow-network" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [["worker"], ["generate", "hi", "--rpc", "127.0.0.1:50052"]])
def test_a_build_without_rpc_says_how_to_rebuild(monkeypatch, args):
    monkeypatch.setattr(rpc, "supports_rpc", lambda: False)     # the plain build's answer (this one may have RPC)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "-DGGML_RPC=on" in r.stderr and "pip install" in r.stderr


@pytest.mark.parametrize("value, why", [("-1,1", "not a share >= 0"), ("1,x", "not a number"),
                                        ("0,0", "add up to more than 0"), ("nan,1", "not a share")])
def test_bad_tensor_split_is_refused_before_anything_loads(value, why):
    r = CliRunner().invoke(main, ["generate", "hi", "--rpc", "127.0.0.1:1", "--tensor-split", value])
    assert r.exit_code == 2 and why in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("value", ["127.0.0.1", "127.0.0.1:0", "[::1]:50052", "a:1,a:1"])
def test_bad_rpc_is_refused(value):
    r = CliRunner().invoke(main, ["generate", "hi", "--rpc", value])
    assert r.exit_code == 2 and r.stderr.startswith("error: --rpc") and r.stderr.count("\n") == 1


# --- llama.cpp's placement rule ------------------------------------------------------------------------

def _devs(*free):
    return [split.Device(worker=f"127.0.0.1:{50052 + i}", name=f"RPC{i}", free=f, total=f) for i, f in enumerate(free)]


def test_placement_follows_llama_cpp():
    # 30 layers + output over two devices, even shares: llama.cpp's upper_bound over (il / 31)
    p = split.place(30, _devs(1, 1), (1, 1))
    assert p.n_gpu_layers == 31 and p.layer_device == [0] * 16 + [1] * 15
    # a head share (last value): the first layers stay on the head
    p = split.place(30, _devs(1, 1), (1, 1, 1))
    assert p.layer_device.count(-1) == 10 and p.layer_device[:10] == [-1] * 10 and p.n_gpu_layers == 21
    # no split given: by free memory, as llama.cpp does
    p = split.place(30, _devs(3 * 2**30, 1 * 2**30))
    assert p.layer_device.count(0) == 24 and p.layer_device.count(1) == 7
    with pytest.raises(Exception, match="3 values but the workers offer 1"):
        split.place(30, _devs(1), (1, 1, 1))


@needs_model
def test_a_share_that_does_not_fit_names_the_worker():
    from edgerun.formats.ggufscan import read_info

    info = read_info(MODEL_PATH)
    devs = _devs(8 * 2**30, 50 * 2**20)            # the second worker has 50 MiB free
    p = split.size(split.place(info.arch_int("block_count"), devs, (1, 1)), info, 0, 2)
    with pytest.raises(Exception, match=r"worker 127\.0\.0\.1:50053 \(RPC1\) would hold 15 layer"):
        split.check_devices(p, devs)
    assert sum(p.device_bytes) + p.head_bytes >= MODEL_PATH.stat().st_size * 0.95


# --- status, bad workers ---------------------------------------------------------------------------------

@needs_rpc
def test_cluster_status_lists_both_workers(workers, tmp_path):
    eps = ",".join(str(w.ep) for w in workers)
    r = run_cli("cluster", "status", "--rpc", eps, "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [x["endpoint"] for x in recs] == [str(w.ep) for w in workers]
    for x in recs:
        assert x["protocol"] == rpc.fmt_version(rpc.PROTOCOL) and x["rtt_ms"] > 0
        dev = x["devices"][0]           # the worker's CPU, as the head sees it: a remote device RPCn
        assert dev["name"].startswith("RPC") and 0 < dev["free"] <= dev["total"]
    table = run_cli("cluster", "status", "--rpc", eps, home=tmp_path).stdout
    assert all(str(w.ep) in table for w in workers)


@needs_rpc
def test_a_dead_worker_fails_the_status_but_not_the_caller(workers, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    r = run_cli("cluster", "status", "--rpc", f"{workers[0].ep},{dead}", home=tmp_path)
    assert r.returncode == 2 and str(workers[0].ep) in r.stdout
    assert r.stderr.strip().splitlines() == [f"error: RPC worker {dead} is unreachable (nothing listens there); "
                                             "is `edgerun worker` (or its SSH tunnel) running?"]


@needs_rpc
@pytest.mark.skipif(ssh_tunnel.available() is not None, reason=str(ssh_tunnel.available()))
def test_through_a_restricted_ssh_tunnel(workers, tmp_path):
    """The deployment's transport: the head sees the worker through an SSH forward, and the key can open
    the one permitted port only (a forward to the other worker's port is refused by sshd)."""
    t = ssh_tunnel.Tunnel(tmp_path / "ssh", [workers[0].port, workers[1].port], permit=[workers[0].port])
    try:
        ok, refused = (f"127.0.0.1:{p}" for p in t.local_ports)
        r = run_cli("cluster", "status", "--rpc", ok, "--json", home=tmp_path)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)[0]["protocol"] == rpc.fmt_version(rpc.PROTOCOL)
        line = one_error_line(run_cli("cluster", "status", "--rpc", refused, home=tmp_path))
        assert f"RPC worker {refused} closed the connection at the handshake" in line
    finally:
        t.close()


class FakeOtherProtocol:
    """A TCP peer that answers ggml-rpc's HELLO as a worker of protocol `version` would (major 6 or 8), or,
    with version None, closes the connection at the handshake as a protocol-6 worker does when it receives
    the 7.x request. (A worker of another llama.cpp version cannot be built here; this speaks its first bytes.)"""

    def __init__(self, version) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.ep = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.version = version
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                c.recv(64)
                if self.version is not None:
                    c.sendall(struct.pack("<Q", 28) + bytes(self.version) + bytes(25))


@needs_rpc
@needs_model
@pytest.mark.parametrize("version, expect", [((6, 0, 0), "speaks ggml-rpc protocol 6.0.0 but this build speaks 7.0.0"),
                                             ((8, 1, 0), "speaks ggml-rpc protocol 8.1.0"),
                                             (None, "closed the connection at the handshake")])
def test_a_worker_of_another_protocol_is_refused_before_loading(tmp_path, version, expect):
    fake = FakeOtherProtocol(version)
    r = run_cli("generate", "hi", "-n", "2", *HEAD_ARGS, "--rpc", fake.ep, home=tmp_path)
    line = one_error_line(r)
    assert fake.ep in line and expect in line


@needs_rpc
@needs_model
def test_bad_inputs_with_real_workers(workers, tmp_path):
    eps = ",".join(str(w.ep) for w in workers)
    dead = f"127.0.0.1:{free_port()}"
    line = one_error_line(run_cli("generate", "hi", *HEAD_ARGS, "--rpc", f"{eps},{dead}", home=tmp_path))
    assert dead in line and "unreachable" in line
    line = one_error_line(run_cli("generate", "hi", *HEAD_ARGS, "--rpc", eps, "--tensor-split", "1,1,1,1",
                                  home=tmp_path))
    assert "4 values but the workers offer 2 device(s)" in line
    # the head's own share must fit the head: a profile with a 64 MiB budget
    prof = tmp_path / "tiny.yaml"
    prof.write_text(Path(__file__).parents[1].joinpath("device_profiles", "generic-x86_64-cpu.yaml").read_text()
                    .replace("name: generic-x86_64-cpu", "name: tiny-head"))
    _set_budget(prof, 0.0625)
    args = [a if a != "generic-x86_64-cpu" else str(prof) for a in HEAD_ARGS]
    line = one_error_line(run_cli("generate", "hi", *args, "--rpc", eps, "--tensor-split", "0,0,1", home=tmp_path))
    assert "do not fit on tiny-head" in line


@needs_rpc
def test_serve_checks_the_workers_before_binding(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    line = one_error_line(run_cli("serve", "--port", "0", "--rpc", dead, *HEAD_ARGS, home=tmp_path))
    assert line.startswith(f"error: RPC worker {dead} is unreachable")


def _set_budget(path: Path, gib: float) -> None:
    import yaml

    d = yaml.safe_load(path.read_text())
    d.setdefault("memory", {})["budget_gib"] = gib
    d["memory"].pop("budget_fraction", None)
    path.write_text(yaml.safe_dump(d))


# --- the split model: same tokens as a local run -----------------------------------------------------------

def _generate(home, *args) -> dict:
    r = run_cli("generate", "The three primary colors are", "-n", "32", "-t", "0", "--json", *HEAD_ARGS, *args,
                home=home)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_rpc
@needs_model
def test_split_greedy_output_equals_the_local_run(workers, tmp_path):
    local = _generate(tmp_path)
    both = _generate(tmp_path, "--rpc", ",".join(str(w.ep) for w in workers))
    with_head = _generate(tmp_path, "--rpc", str(workers[0].ep), "--tensor-split", "1,1")
    assert local["n_tokens"] == 32 and len(local["text"].split()) > 5
    assert both["text"] == local["text"]
    assert with_head["text"] == local["text"]


DRAFT_PATH = MODEL_PATH.with_name("smollm2-135m-instruct@spec.gguf")


@needs_rpc
@needs_model
@pytest.mark.skipif(not DRAFT_PATH.exists(), reason=f"{DRAFT_PATH} is not made (edgerun pull smollm2-135m-instruct@spec)")
@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed: the bytes sent cannot be read")
def test_the_drafter_stays_on_the_head(workers, tmp_path):
    """Speculative decoding with a split target: the worker receives the target's layers only (a drafter that
    spread too would double the bytes), and the greedy output is the local plain run's."""
    ep = str(workers[0].ep)
    script = (
        "import json, re, subprocess, edgerun\n"
        f"rt = edgerun.load({str(MODEL_PATH)!r}, draft={str(DRAFT_PATH)!r}, profile='generic-x86_64-cpu', "
        f"n_threads=1, n_ctx=512, pull=False, rpc=[{ep!r}])\n"
        f"out = subprocess.run(['ss', '-tinH', 'state', 'established', 'dst', {ep!r}], capture_output=True, "
        "text=True).stdout\n"
        "sent = sum(int(x) for x in re.findall(r'bytes_sent:(\\d+)', out))\n"
        "c = rt.generate('The three primary colors are', max_tokens=32, temperature=0, gamma=3)\n"
        "print(json.dumps({'sent': sent, 'text': c.text, 'drafted': c.stats.n_drafted}))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=clean_env(tmp_path, GGML_NO_BACKTRACE="1"))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    target = MODEL_PATH.stat().st_size
    assert 0.5 * target < got["sent"] < 1.4 * target, (got["sent"], target)
    assert got["drafted"] > 0
    assert got["text"] == _generate(tmp_path)["text"]


# --- a lost worker ------------------------------------------------------------------------------------------

@needs_rpc
@needs_model
def test_kill_9_of_a_worker_mid_generation_ends_the_head_naming_it(tmp_path):
    ws = [Worker(tmp_path, "--cache", "none"), Worker(tmp_path, "--cache", "none")]
    try:
        cmd = [sys.executable, "-m", "edgerun", "generate", "Count from 1 to 1000: 1, 2, 3, 4,", "-n", "3000",
               "-t", "0", *HEAD_ARGS, "--rpc", ",".join(str(w.ep) for w in ws)]
        head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=clean_env(tmp_path, GGML_NO_BACKTRACE="1"))
        assert head.stdout.read(20)                  # it is generating
        ws[1].kill()
        t0 = time.monotonic()
        out, err = head.communicate(timeout=30)
        waited = time.monotonic() - t0
        assert head.returncode == 2, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: lost the RPC worker {ws[1].ep} "), err
        assert str(ws[0].ep) not in last and "Traceback" not in err
        assert waited < 30
    finally:
        for w in ws:
            w.kill()


@needs_rpc
@needs_model
def test_serve_reports_a_lost_worker_and_exits_nonzero(tmp_path):
    w = Worker(tmp_path, "--cache", "none")
    srv = ServerProcess([*HEAD_ARGS, "--rpc", str(w.ep)], env=clean_env(tmp_path, GGML_NO_BACKTRACE="1"))
    try:
        srv.wait_ready(90)
        w.kill()
        statuses = []
        deadline = time.monotonic() + 20
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
                statuses.append((r.status_code, r.json().get("status")))
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        rc = srv.wait_exit(20)
        assert rc != 0
        assert (503, "worker_lost") in statuses, statuses
        assert f"lost the RPC worker {w.ep}" in srv.output
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        w.kill()
