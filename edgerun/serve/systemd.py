"""Running under systemd: the sd_notify datagram protocol, the watchdog interval, and the unit file.

The notify protocol is small enough to speak directly (no dependency): one AF_UNIX datagram of
newline-separated KEY=VALUE lines sent to the socket named by $NOTIFY_SOCKET; a leading '@' names
a socket in the abstract namespace. Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
import shlex
import socket
import sys
from pathlib import Path
from typing import Mapping

from ..device.detect import resolve
from ..errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_ENV_FILE = "/etc/edgerun/edgerun.env"
DEFAULT_PREFIX = "/opt/edgerun"
DEFAULT_WATCHDOG_SEC = 60


def _notify_address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET", "")
    if not addr:
        return None
    if addr.startswith("@"):
        return "\0" + addr[1:]          # abstract namespace
    if addr.startswith("/"):
        return addr
    log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket name; not notifying", addr)
    return None


def notify(*lines: str, env: Mapping[str, str] | None = None) -> bool:
    """Send 'KEY=VALUE' lines to systemd. Returns False when not run by systemd (nothing sent)."""
    addr = _notify_address(os.environ if env is None else env)
    if addr is None:
        return False
    payload = "\n".join(lines).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(payload)
    except OSError as exc:
        log.warning("sd_notify %r failed: %s", lines, exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is armed."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None                      # the watchdog is meant for another process
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; watchdog pings disabled", usec)
        return None
    if value <= 0:
        return None
    return value / 2e6


# --- the unit file -------------------------------------------------------------------------------

_UNIT = """\
# edgerun: OpenAI-compatible LLM server for this board.
# Rendered by `edgerun service print`; configure it in {env_file} (see deploy/edgerun.env).
[Unit]
Description=edgerun LLM server (OpenAI-compatible HTTP API)
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=10min
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
# Models and probe results live in the cache directory; the env file may override EDGERUN_HOME.
Environment=EDGERUN_HOME=%C/edgerun
Environment=PYTHONUNBUFFERED=1
EnvironmentFile={env_file}
DynamicUser=yes
CacheDirectory=edgerun
StateDirectory=edgerun
WorkingDirectory=%S/edgerun
# READY=1 is sent once the models are loaded; a first start may pull them from the package registry.
TimeoutStartSec=30min
TimeoutStopSec=60s
WatchdogSec={watchdog_sec}
Restart=on-failure
RestartSec=5s
# Hardening. No PrivateDevices: GPU boards (Jetson) need their device nodes.
{gpu}NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SystemCallArchitectures=native
CapabilityBoundingSet=
UMask=0077

[Install]
WantedBy=multi-user.target
"""


# The device nodes CUDA opens on a Jetson (L4T r35 = JetPack 5 and r36 = JetPack 6; the nvgpu driver's
# /dev/nvhost-*-gpu names and their /dev/nvgpu/igpu0/ twins, nvmap, host1x's fence node, the DRM render
# node), as NVIDIA's container runtime passes them to an L4T container. udev gives them to root:video
# 0660 (the render node to root:render). systemd skips a node that does not exist on a release.
JETSON_DEVICE_NODES = (
    "/dev/nvmap", "/dev/nvhost-ctrl", "/dev/nvhost-ctrl-gpu", "/dev/nvhost-gpu", "/dev/nvhost-as-gpu",
    "/dev/nvhost-tsg-gpu", "/dev/nvhost-dbg-gpu", "/dev/nvhost-prof-gpu", "/dev/nvhost-prof-ctx-gpu",
    "/dev/nvhost-prof-dev-gpu", "/dev/nvhost-ctxsw-gpu", "/dev/nvhost-power-gpu", "/dev/nvhost-sched-gpu",
    "/dev/nvhost-nvsched-gpu", "/dev/nvhost-nvsched_ctrl_fifo-gpu",
    "/dev/nvgpu/igpu0/ctrl", "/dev/nvgpu/igpu0/as", "/dev/nvgpu/igpu0/channel", "/dev/nvgpu/igpu0/tsg",
    "/dev/nvgpu/igpu0/dbg", "/dev/nvgpu/igpu0/prof", "/dev/nvgpu/igpu0/prof-ctx", "/dev/nvgpu/igpu0/prof-dev",
    "/dev/nvgpu/igpu0/ctxsw", "/dev/nvgpu/igpu0/power", "/dev/nvgpu/igpu0/sched", "/dev/nvgpu/igpu0/nvsched",
    "/dev/nvgpu/igpu0/nvsched_ctrl_fifo", "/dev/host1x-fence", "/dev/dri/renderD128",
)
GPU_GROUPS = ("video", "render")


def gpu_section(profile) -> str:
    """The unit lines that let DynamicUser's user reach a CUDA board's GPU ('' for other profiles)."""
    if profile is None or profile.priors.compute != "cuda":
        return ""
    lines = [f"# GPU ({profile.name}): DynamicUser's user joins the groups that own the GPU device nodes, and",
             "# the device cgroup allows only them (plus /dev/null, zero, full, random, urandom). Without",
             "# them CUDA finds no device and llama.cpp runs the model on the CPU (edgerun warns, and",
             "# EDGERUN_REQUIRE_GPU=1 makes it an error). install.sh creates a missing group.",
             f"SupplementaryGroups={' '.join(GPU_GROUPS)}"]
    lines += [f"DeviceAllow={node} rw" for node in JETSON_DEVICE_NODES]
    return "\n".join(lines) + "\n"


def default_exec_start(python: str | None = None) -> str:
    """`edgerun serve` for the installation that runs this code (the console script next to python)."""
    python = python or sys.executable
    script = Path(python).parent / "edgerun"
    if script.is_file() and os.access(script, os.X_OK):
        return f"{shlex.quote(str(script))} serve"
    return f"{shlex.quote(str(python))} -m edgerun serve"


def render_unit(exec_start: str | None = None, *, env_file: str = DEFAULT_ENV_FILE,
                watchdog_sec: int = DEFAULT_WATCHDOG_SEC, profile=None) -> str:
    """The systemd unit text. exec_start defaults to this installation's `edgerun serve`. profile: a
    DeviceProfile; a CUDA board's (Jetson) adds the GPU's groups and device nodes (gpu_section)."""
    if not isinstance(watchdog_sec, int) or watchdog_sec < 2:
        raise InvalidArgument(f"watchdog_sec must be an integer >= 2 seconds, got {watchdog_sec!r}")
    if not env_file.startswith("/"):
        raise InvalidArgument(f"env_file must be an absolute path (systemd requires it), got {env_file!r}")
    exec_start = exec_start or default_exec_start()
    if not exec_start.startswith("/"):
        raise InvalidArgument(f"ExecStart must begin with an absolute path, got {exec_start!r}")
    return _UNIT.format(exec_start=exec_start, env_file=env_file, watchdog_sec=watchdog_sec,
                        gpu=gpu_section(profile))


def build_flags(profile: str = "auto") -> dict:
    """How deploy/install.sh builds llama-cpp-python here: the device profile's CMAKE_ARGS and env."""
    prof, why = resolve(profile)
    pin = None
    try:
        for req in metadata.requires("edgerun") or ():
            name, sep, version = req.partition("==")
            if sep and name.strip().lower().replace("_", "-") == "llama-cpp-python":
                pin = version.split(";")[0].strip()
    except metadata.PackageNotFoundError:
        log.debug("edgerun is not installed as a distribution; no llama-cpp-python pin to report")
    return {"profile": prof.name, "reason": why, "cmake_args": prof.build.cmake_args,
            "env": dict(prof.build.env), "llama_cpp_python": pin}


def installed_unit_text() -> str:
    """The unit as shipped in deploy/edgerun.service: an install under DEFAULT_PREFIX."""
    return render_unit(f"{DEFAULT_PREFIX}/venv/bin/edgerun serve")
