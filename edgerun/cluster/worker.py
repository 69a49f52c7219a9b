"""`edgerun worker`: this board lends its memory and compute to a head through ggml-rpc.

The worker is ggml's own RPC server (ggml_backend_rpc_start_server): it serves one head at a time
and never returns. It binds loopback by default; the head reaches it through an SSH forward.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from ..backends.llamacpp import default_threads
from ..errors import ClusterError, InvalidArgument
from ..util.home import cache_dir as home
from . import rpc

log = logging.getLogger(__name__)

NETWORK_WARNING = ("ggml-rpc has NO authentication and its parser has had memory-safety bugs: anyone who can "
                   "open a TCP connection to {addr} can read and write this board's memory and must be assumed "
                   "able to run code on it. Bind only an address that strangers cannot reach (a WireGuard "
                   "interface); the safe default is 127.0.0.1 behind an SSH tunnel (deploy/edgerun-tunnel@.service).")


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = rpc.DEFAULT_PORT
    threads: int | None = None
    devices: tuple[str, ...] = ()          # ggml device names (CPU, CUDA0, ...); () = GPUs if any, else CPU
    cache: str | None = "default"         # weight cache dir; 'default' = $EDGERUN_HOME/rpc-cache; None = off
    allow_network: bool = False


def check_host(host: str, allow_network: bool) -> bool:
    """InvalidArgument for an address the worker must not bind; True when it is a non-loopback one
    (allowed with allow_network, and then worth a loud warning)."""
    if host in ("0.0.0.0", "", "*", "::", "[::]"):
        raise InvalidArgument(
            f"refusing --host {host or repr(host)}: a ggml-rpc worker has no authentication, so binding every "
            f"address lets anyone who reaches this board run code on it. Bind 127.0.0.1 and reach it through "
            f"an SSH tunnel (deploy/edgerun-tunnel@.service), or bind one private address with --allow-network")
    if ":" in host:
        raise InvalidArgument(f"--host {host}: ggml-rpc listens on IPv4 only; give an IPv4 address")
    if rpc.Endpoint(host, 1).loopback:
        return False
    if not allow_network:
        raise InvalidArgument(
            f"--host {host} would expose an unauthenticated ggml-rpc worker to the network; "
            f"pass --allow-network if a VPN keeps strangers out, else keep 127.0.0.1 and use an SSH tunnel")
    return True


def cache_dir(value: str | None) -> Path | None:
    if value is None or value == "none":
        return None
    if value == "default":
        return home() / "rpc-cache"
    return Path(value).expanduser()


def pick_devices(names: tuple[str, ...]) -> list:
    """ggml device handles for the names asked for (default: the GPUs, else the CPU)."""
    g = rpc.ggml()
    local = rpc.local_devices()
    if names:
        out = []
        for n in names:
            dev = g.ggml.ggml_backend_dev_by_name(n.encode())
            if not dev:
                known = ", ".join(d["name"] for d in local)
                raise InvalidArgument(f"--device {n!r}: no such ggml device here; this build has: {known}")
            out.append(dev)
        return out
    gpus = [i for i, d in enumerate(local) if d["type"] in ("GPU", "IGPU")]
    idx = gpus or [i for i, d in enumerate(local) if d["type"] == "CPU"][:1]
    return [g.ggml.ggml_backend_dev_get(i) for i in idx]


def _check_port_free(host: str, port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as e:
        hint = ("is another worker using the port? (choose another with --port)" if e.errno == errno.EADDRINUSE
                else "is it an address of this machine?")
        raise ClusterError(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None
    finally:
        s.close()


def prepare(config: WorkerConfig) -> tuple[list, Path | None, int]:
    """Check everything that can be checked before serving: (devices, cache dir, threads)."""
    rpc.require_rpc("edgerun worker")
    check_host(config.host, config.allow_network)
    if not 1 <= config.port <= 65535:
        raise InvalidArgument(f"--port must be in 1..65535, got {config.port}")
    if config.threads is not None and config.threads < 1:
        raise InvalidArgument(f"--threads must be >= 1, got {config.threads}")
    devices = pick_devices(config.devices)
    cache = cache_dir(config.cache)
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ClusterError(f"cannot create the worker's weight cache {cache}: {e.strerror}; give "
                               f"--cache DIR or --cache none") from None
    _check_port_free(config.host, config.port)
    return devices, cache, config.threads or default_threads()


def serve(config: WorkerConfig, announce=None) -> None:
    """Run the worker (blocks; returns only if ggml's server could not start, then raises ClusterError).
    announce(line): told once everything is checked, just before serving."""
    devices, cache, threads = prepare(config)
    arr = (ctypes.c_void_p * len(devices))(*devices)
    line = (f"RPC worker on {config.host}:{config.port}: {threads} thread(s), device(s) "
            + ", ".join(rpc.dev_info(d)["name"] for d in devices) + f", weight cache {cache or 'off'}")
    log.info("%s", line)
    if announce is not None:
        announce(line)
    # ggml's server loop never returns to Python: let Ctrl-C and SIGTERM end the process directly
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.ggml().rpc.ggml_backend_rpc_start_server(f"{config.host}:{config.port}".encode(),
                                                 os.fsencode(cache) if cache else None, threads, len(devices), arr)
    raise ClusterError(f"the ggml-rpc server on {config.host}:{config.port} stopped (see its message above)")
