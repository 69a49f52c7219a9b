"""deploy/: the systemd unit (as shipped, as `edgerun service print` renders it, and through
`systemd-analyze verify`), the example env file, install.sh --dry-run, and the sd_notify protocol on
real datagram sockets."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgerun.serve import systemd as service
from edgerun.cli import main, serve
from edgerun.device.detect import detect
from edgerun.device.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
LLAMA_PIN = re.search(r'"llama-cpp-python==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def with_rpc(cmake_args: str) -> str:
    """install.sh builds llama.cpp's RPC backend on every board, after the profile's own flags."""
    return f"{cmake_args} -DGGML_RPC=on" if cmake_args else "-DGGML_RPC=on"


# --- the unit ---------------------------------------------------------------------------------------

def test_shipped_unit_is_what_service_print_renders_for_opt():
    assert (DEPLOY / "edgerun.service").read_text() == service.installed_unit_text()


@pytest.mark.parametrize("line", [
    "Type=notify", "NotifyAccess=main", "WatchdogSec=60", "EnvironmentFile=/etc/edgerun/edgerun.env",
    "DynamicUser=yes", "CacheDirectory=edgerun", "StateDirectory=edgerun", "Environment=EDGERUN_HOME=%C/edgerun",
    "Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
    "ExecStart=/opt/edgerun/venv/bin/edgerun serve", "WantedBy=multi-user.target",
])
def test_unit_has_the_service_contract(line):
    assert line in (DEPLOY / "edgerun.service").read_text().splitlines()


def test_service_print_fills_in_this_installation():
    r = CliRunner().invoke(main, ["service", "print"])
    assert r.exit_code == 0, r.output
    assert r.output == service.render_unit()
    exec_start = next(l for l in r.output.splitlines() if l.startswith("ExecStart="))
    program = shlex.split(exec_start.removeprefix("ExecStart="))[0]
    assert os.path.isabs(program) and os.access(program, os.X_OK)
    assert Path(program).parent == Path(sys.executable).parent

    r = CliRunner().invoke(main, ["service", "print", "--env-file", "edgerun.env"])
    assert r.exit_code == 2 and r.stderr.startswith("error: env_file must be an absolute path")


def _verify(unit: Path) -> list[str]:
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120)
    complaints = [l for l in (r.stdout + r.stderr).splitlines() if unit.name in l or str(unit) in l]
    return complaints + ([f"exit status {r.returncode}"] if r.returncode else [])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package 'systemd'; deploy/ci-deps.sh installs it)")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    unit = tmp_path / "edgerun.service"
    unit.write_text(service.render_unit())          # ExecStart must exist: this installation's edgerun
    assert _verify(unit) == []
    # the same check catches a misspelt hardening directive (so the test can fail)
    (tmp_path / "typo").mkdir()
    bad = tmp_path / "typo" / "edgerun.service"
    bad.write_text(service.render_unit().replace("ProtectSystem=strict", "ProtectSytem=strict"))
    assert any("ProtectSytem" in c for c in _verify(bad))


# --- the example environment file -------------------------------------------------------------------

def _env_names(text: str) -> list[str]:
    return re.findall(r"^#?(EDGERUN_[A-Z_]+)=", text, re.M)


def test_env_file_is_rendered_from_the_one_settings_table():
    from edgerun.serve.settings import render_env_file

    assert (DEPLOY / "edgerun.env").read_text() == render_env_file()


def test_every_server_config_field_is_a_serve_setting():
    import dataclasses

    from edgerun.serve.settings import SETTINGS, ServerConfig

    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"load_opts"}
    assert {s.field or s.name for s in SETTINGS} == fields


def test_env_file_documents_every_serve_option_and_only_those():
    options = {p.envvar for p in serve.params if p.envvar}
    names = set(_env_names((DEPLOY / "edgerun.env").read_text()))
    assert options - names == set(), "serve options missing from deploy/edgerun.env"
    assert names - options == {"EDGERUN_HOME"}, "deploy/edgerun.env names variables that nothing reads"


def test_env_file_values_parse_as_serve_options(monkeypatch):
    for line in (DEPLOY / "edgerun.env").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            monkeypatch.setenv(name, value)
    ctx = serve.make_context("serve", [])
    p = ctx.params
    assert (p["host"], p["port"], p["queue"], p["api_key"]) == ("127.0.0.1", 8080, 8, None)
    assert p["timeout_s"] == 300 and p["max_body_kb"] == 1024 and p["model"] == "smollm2-135m-instruct"


# --- install.sh ---------------------------------------------------------------------------------------

def _install(tmp_path: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    cmd = ["bash", str(DEPLOY / "install.sh"), "--dry-run", "--python", python, "--prefix", str(tmp_path / "opt"),
           "--etc-dir", str(tmp_path / "etc"), "--unit-dir", str(tmp_path / "units"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for d in ("opt", "etc", "units"):
        assert not (tmp_path / d).exists(), f"--dry-run created {d}"
    return r


def _command(out: str, needle: str) -> list[str]:
    """The dry-run command line containing `needle`, split as the shell would."""
    line = next((l for l in out.splitlines() if l.startswith("+ ") and needle in l), None)
    assert line is not None, f"no step with {needle!r} in:\n{out}"
    return shlex.split(line[2:])


@pytest.mark.parametrize("name", ["rpi5-8gb", "rpi4-8gb", "jetson-orin-nano-8gb", "apple-m2", "generic-x86_64-cpu"])
def test_install_dry_run_builds_with_the_profile_flags(tmp_path, name):
    out = _install(tmp_path, "--profile", name).stdout
    prof = load_profile(name)
    venv = tmp_path / "opt" / "venv"
    build = _command(out, "--no-binary")
    assert f"CMAKE_ARGS={with_rpc(prof.build.cmake_args)}" in build and f"llama-cpp-python=={LLAMA_PIN}" in build
    for k, v in prof.build.env.items():
        assert f"{k}={v}" in build
    assert build[build.index("-m") - 1] == f"{venv}/bin/python"
    lines = out.splitlines()
    order = [next(i for i, l in enumerate(lines) if l.startswith("+ ") and needle in l)
             for needle in ("-m venv", "--no-deps", "--no-binary", r"\[serve\]", "edgerun.env", "edgerun.service",
                            "daemon-reload", "enable", "restart")]
    assert order == sorted(order), "install steps out of order"
    assert f"    | EDGERUN_PROFILE={name}" in out.splitlines()
    assert f"    | ExecStart={venv}/bin/edgerun serve" in out.splitlines()
    assert f"    | EnvironmentFile={tmp_path}/etc/edgerun.env" in out.splitlines()
    if name.startswith("jetson"):
        assert "SupplementaryGroups=" in out or "no 'video' group" in out


def test_install_dry_run_detects_this_board(tmp_path):
    expected, _ = detect()
    out = _install(tmp_path).stdout
    assert f"==> board: {expected.name} (" in out
    assert f"CMAKE_ARGS={with_rpc(expected.build.cmake_args)}" in _command(out, "--no-binary")


@pytest.mark.parametrize("files, board", [
    ({"proc/device-tree/model": "Raspberry Pi 5 Model B Rev 1.0\0"}, "rpi5-8gb"),
    ({"proc/device-tree/model": "Raspberry Pi 4 Model B Rev 1.4\0"}, "rpi4-8gb"),
    ({"etc/nv_tegra_release": "# R36 (release), REVISION: 3.0\n"}, "jetson-orin-nano-8gb"),
])
def test_install_detects_from_board_files_without_python_packages(tmp_path, files, board):
    root = tmp_path / "root"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out = _install(tmp_path, "--root", str(root), python="/bin/false").stdout   # no usable Python: fallback
    assert f"==> board: {board} (" in out
    build = _command(out, "--no-binary")
    assert f"CMAKE_ARGS={with_rpc(load_profile(board).build.cmake_args)}" in build
    assert f"llama-cpp-python=={LLAMA_PIN}" in build


def test_install_with_a_prebuilt_llama_wheel_skips_the_build(tmp_path):
    wheel = f"/wheels/llama_cpp_python-{LLAMA_PIN}-py3-none-linux_aarch64.whl"
    out = _install(tmp_path, "--profile", "rpi5-8gb", "--llama-wheel", wheel).stdout
    assert "--no-binary" not in out
    assert _command(out, "llama_cpp_python-")[-1] == wheel
    assert "built elsewhere; it must have been built with the CMAKE_ARGS above" in out
    r = subprocess.run(["bash", str(DEPLOY / "install.sh"), "--dry-run", "--profile", "rpi5-8gb",
                        "--llama-wheel", "/wheels/llama_cpp_python-0.0.1-py3-none-any.whl"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"is not a llama_cpp_python-{LLAMA_PIN}-*.whl" in r.stderr


def test_install_offline_enables_without_a_running_systemd(tmp_path):
    out = _install(tmp_path, "--profile", "rpi4-8gb", "--offline").stdout
    assert _command(out, "systemctl") == ["systemctl", "--root=/", "enable", "edgerun.service"]
    steps = [ln for ln in out.splitlines() if ln.startswith("+ systemctl")]
    assert steps == ["+ systemctl --root=/ enable edgerun.service"] and "starts at the next boot" in out


def test_install_root_reaches_edgerun_detection(tmp_path):
    # --root is exported as EDGERUN_DEVICE_ROOT: the Python detection (not only the shell fallback) reads there
    root = tmp_path / "board"
    shutil.copytree(Path(__file__).parent / "fixtures" / "boards" / "rpi4-8gb", root)
    (root / "proc/meminfo").unlink()                 # a warning only a read of this root can produce
    out = _install(tmp_path, "--root", str(root)).stdout
    board = "rpi4-8gb" if os.uname().machine == "aarch64" else "generic-x86_64-cpu"
    line = next(ln for ln in out.splitlines() if ln.startswith("==> board: "))
    assert line.startswith(f"==> board: {board} (") and "/proc/meminfo missing" in line, line


# --- a model over several boards: the worker, the head's tunnels ---------------------------------------

HARDENING = [ln for ln in (DEPLOY / "edgerun.service").read_text().splitlines()
             if ln.split("=")[0] in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                                     "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                                     "ProtectControlGroups", "ProtectClock", "ProtectHostname",
                                     "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
                                     "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures",
                                     "CapabilityBoundingSet", "UMask", "DynamicUser")]


@pytest.mark.parametrize("unit", ["edgerun-worker.service", "edgerun-tunnel@.service"])
def test_cluster_units_have_the_service_hardening(unit):
    lines = (DEPLOY / unit).read_text().splitlines()
    assert len(HARDENING) == 19 and [h for h in HARDENING if h not in lines] == []
    assert "Restart=on-failure" in lines or "Restart=always" in lines


def test_worker_unit_runs_the_loopback_worker():
    lines = (DEPLOY / "edgerun-worker.service").read_text().splitlines()
    assert "ExecStart=/opt/edgerun/venv/bin/edgerun worker" in lines
    assert "EnvironmentFile=-/etc/edgerun/worker.env" in lines
    env = (DEPLOY / "worker.env").read_text()
    assert "\nEDGERUN_WORKER_HOST" not in env and "#EDGERUN_WORKER_ALLOW_NETWORK=1" in env   # loopback unless asked
    ctx = main.commands["worker"].make_context("worker", [])
    assert ctx.params["host"] == "127.0.0.1" and ctx.params["port"] == 50052


def test_tunnel_unit_forwards_loopback_to_loopback_with_its_own_key():
    text = (DEPLOY / "edgerun-tunnel@.service").read_text()
    assert "-L 127.0.0.1:${LOCAL_PORT}:127.0.0.1:${REMOTE_PORT} ${SSH_USER}@%i" in text
    for opt in ("ExitOnForwardFailure=yes", "StrictHostKeyChecking=yes", "BatchMode=yes", "IdentitiesOnly=yes",
                "ServerAliveInterval=5"):
        assert f"-o {opt}" in text
    assert "LoadCredential=key:/etc/edgerun/tunnel/id_ed25519" in text and "-i %d/key" in text
    assert "LoadCredential=known_hosts:/etc/edgerun/tunnel/known_hosts" in text
    assert "-o UserKnownHostsFile=%d/known_hosts" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package 'systemd'; deploy/ci-deps.sh installs it)")
def test_cluster_units_pass_systemd_analyze_verify(tmp_path):
    program = shlex.split(service.default_exec_start())[0]          # this installation's edgerun
    worker = tmp_path / "edgerun-worker.service"
    worker.write_text((DEPLOY / "edgerun-worker.service").read_text().replace("/opt/edgerun/venv/bin/edgerun", program))
    assert _verify(worker) == []
    if shutil.which("ssh") == "/usr/bin/ssh":
        tunnel = tmp_path / "edgerun-tunnel@board2.service"
        tunnel.write_text((DEPLOY / "edgerun-tunnel@.service").read_text())
        assert _verify(tunnel) == []


def test_install_worker_dry_run(tmp_path):
    out = _install(tmp_path, "--profile", "rpi5-8gb", "--worker", "--authorize-key", "/tmp/head.pub",
                   "--remote-port", "50060").stdout
    build = _command(out, "--no-binary")
    assert f"CMAKE_ARGS={with_rpc(load_profile('rpi5-8gb').build.cmake_args)}" in build
    venv = tmp_path / "opt" / "venv"
    assert f"    | ExecStart={venv}/bin/edgerun worker" in out.splitlines()
    assert "    | EDGERUN_WORKER_PORT=50060" in out.splitlines()
    assert 'restrict,port-forwarding,permitopen="127.0.0.1:50060",command="/usr/sbin/nologin"' in out
    assert _command(out, "useradd")[-1] == "edgerun-tunnel"
    assert _command(out, "enable") == ["systemctl", "enable", "edgerun-worker.service"]
    assert "/edgerun.service" not in out and "[serve]" not in out        # not the server


def test_install_tunnel_dry_run(tmp_path):
    out = _install(tmp_path, "--tunnel", "board2.lan", "--local-port", "50053").stdout
    assert _command(out, "ssh-keygen")[-1] == f"{tmp_path}/etc/tunnel/id_ed25519"
    for line in ("SSH_USER=edgerun-tunnel", "SSH_PORT=22", "LOCAL_PORT=50053", "REMOTE_PORT=50052"):
        assert f"    | {line}" in out.splitlines()
    assert f"+ write {tmp_path}/etc/tunnel/board2.lan.env (mode 0600):" in out
    assert f"+ write {tmp_path}/units/edgerun.service.d/20-cluster.conf (mode 0644):" in out
    assert "    | StartLimitIntervalSec=0" in out.splitlines()             # the head retries until workers are back
    assert _command(out, "enable") == ["systemctl", "enable", "edgerun-tunnel@board2.lan.service"]
    assert "-m venv" not in out                                  # a tunnel needs ssh only
    r = subprocess.run(["bash", str(DEPLOY / "install.sh"), "--dry-run", "--tunnel", "-oProxyCommand=x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a host name" in r.stderr


def test_install_rejects_unknown_options():
    r = subprocess.run(["bash", str(DEPLOY / "install.sh"), "--dry-run", "--frobnicate"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown option --frobnicate" in r.stderr


def test_build_flags_command():
    r = CliRunner().invoke(main, ["service", "build-flags", "--profile", "rpi5-8gb"])
    assert r.exit_code == 0, r.output
    flags = json.loads(r.output)
    assert flags["profile"] == "rpi5-8gb" and flags["cmake_args"] == load_profile("rpi5-8gb").build.cmake_args
    r = CliRunner().invoke(main, ["service", "build-flags", "--profile", "no-such-board"])
    assert r.exit_code == 2 and "unknown device profile" in r.stderr


# --- sd_notify ----------------------------------------------------------------------------------------

def test_notify_reaches_path_and_abstract_sockets(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        path = str(tmp_path / "notify.sock")
        s.bind(path)
        assert service.notify("READY=1", "STATUS=serving", env={"NOTIFY_SOCKET": path})
        assert s.recv(4096) == b"READY=1\nSTATUS=serving"
    name = f"edgerun-unit-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert service.notify("WATCHDOG=1", env={"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize("value", ["", "relative/path", "/nonexistent/dir/notify.sock"])
def test_notify_without_a_usable_socket_sends_nothing(value):
    assert service.notify("READY=1", env={"NOTIFY_SOCKET": value} if value else {}) is False


def test_watchdog_interval_is_half_of_watchdog_usec():
    wi = service.watchdog_interval
    assert wi({}) is None
    assert wi({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert wi({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert wi({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None       # meant for another process
    assert wi({"WATCHDOG_USEC": "soon"}) is None and wi({"WATCHDOG_USEC": "0"}) is None


@pytest.mark.parametrize("argv, needle", [
    (["--shutdown-grace", "inf"], "shutdown grace must be a finite"),
    (["--timeout", "inf"], "timeout must be a finite"),
    (["--api-key="], "api_key must not be empty"),
    (["--api-key", "   "], "api_key must not be empty or white space"),
])
def test_serve_settings_that_used_to_crash_or_open_the_api_are_refused(argv, needle):
    """Issue 20: `--shutdown-grace inf` was a traceback; an empty --api-key= silently meant no auth."""
    r = CliRunner().invoke(main, ["serve", "--no-pull", "--port", "0", *argv])
    assert r.exit_code == 2 and r.output.startswith("error: ") and needle in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("argv", [["--stream-interval", "-1"], ["--stream-interval", "nan"],
                                  ["--stream-interval", "5000"], ["--stream-interval", "soon"]])
def test_a_bad_stream_interval_is_refused_at_the_command_line(argv):
    r = CliRunner().invoke(main, ["serve", "--no-pull", "--port", "0", *argv])
    assert r.exit_code == 2 and "--stream-interval" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("value", [-1, float("nan"), 1001, "20", True])
def test_a_bad_stream_interval_is_refused_by_the_config(value):
    from edgerun.errors import InvalidArgument
    from edgerun.serve.settings import ServerConfig

    with pytest.raises(InvalidArgument, match="stream interval"):
        ServerConfig(stream_interval_ms=value)
