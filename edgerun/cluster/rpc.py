"""The ctypes door to ggml's RPC backend, worker endpoints, the protocol handshake and lost-worker detection.

ggml-rpc is part of llama-cpp-python's shared libraries when it is built with -DGGML_RPC=on
(`llama_supports_rpc()` says whether it is). It has no authentication: workers bind to loopback and
the head reaches them through an SSH forward (deploy/edgerun-tunnel@.service) or a VPN.

ggml-rpc aborts the process on any connection failure (GGML_ABORT), so everything here that may meet
a dead worker either runs in a child process (status.py) or speaks only the handshake from Python
(`hello`): ggml has no call that returns a worker's protocol version without aborting on a mismatch.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import psutil

from .. import llama_lib
from ..errors import ClusterError, InvalidArgument
from .split import parse_tensor_split

log = logging.getLogger(__name__)

PROTOCOL = (7, 0, 0)          # RPC_PROTO_*_VERSION of ggml-rpc.h in llama-cpp-python 0.3.36
DEFAULT_PORT = 50052
REBUILD = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall --no-deps '
           'llama-cpp-python==0.3.36')
_HELLO, _CAPS = 14, 24        # RPC_CMD_HELLO (fixed in every protocol version), RPC_CONN_CAPS_SIZE
DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return _is_loopback(self.host)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parse_endpoints(value: str | Iterable[str] | None) -> tuple[Endpoint, ...]:
    """'HOST:PORT,HOST:PORT' (or a list of them) -> endpoints; InvalidArgument naming the bad one."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[Endpoint] = []
    for raw in items:
        item = str(raw).strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidArgument(f"--rpc: {item!r:.60} is not HOST:PORT (a worker such as 127.0.0.1:{DEFAULT_PORT})")
        if ":" in host or host.startswith("["):
            raise InvalidArgument(f"--rpc: {item!r:.60}: ggml-rpc cannot reach IPv6 addresses; use an IPv4 "
                                  f"address or a name (an SSH forward on 127.0.0.1 is the usual way)")
        ep = Endpoint(host, int(port))
        if ep in out:
            raise InvalidArgument(f"--rpc names the worker {ep} twice")
        out.append(ep)
    if len(out) > 16:
        raise InvalidArgument(f"--rpc names {len(out)} workers; ggml-rpc takes at most 16 (GGML_RPC_MAX_SERVERS)")
    return tuple(out)


def cluster_options(rpc, tensor_split) -> tuple[tuple[Endpoint, ...], tuple[float, ...]]:
    """--rpc and --tensor-split (EDGERUN_RPC, EDGERUN_TENSOR_SPLIT; edgerun.load's rpc=, tensor_split=)
    checked together: the workers and their shares, or InvalidArgument. edgerun.load calls it before anything
    loads, and ServerConfig so that `edgerun serve` fails before it binds its socket."""
    eps = parse_endpoints(rpc)
    shares = parse_tensor_split(tensor_split) if tensor_split else ()
    if shares and not eps:
        raise InvalidArgument("--tensor-split needs --rpc (the workers to split the model over)")
    return eps, shares


# --- the libraries ----------------------------------------------------------------------------------------

def supports_rpc() -> bool:
    return bool(llama_lib.lib().llama_supports_rpc())


def require_rpc(what: str = "--rpc") -> None:
    """ClusterError (one line, how to rebuild) unless this llama-cpp-python build has ggml's RPC backend."""
    if not supports_rpc():
        raise ClusterError(f"{what} needs llama.cpp's RPC backend, which this llama-cpp-python build lacks; "
                           f"rebuild it: {REBUILD}")


class _Ggml:
    """ctypes handles of libggml (device registry), libggml-base (abort hook) and libggml-rpc."""

    def __init__(self) -> None:
        self.base = ctypes.CDLL(_loaded("libggml-base"))
        self.ggml = ctypes.CDLL(_loaded("libggml"))
        self.rpc = ctypes.CDLL(_loaded("libggml-rpc"))
        P, S, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        sz = ctypes.POINTER(ctypes.c_size_t)
        for lib, name, args, res in (
                (self.rpc, "ggml_backend_rpc_add_server", [C], P),
                (self.rpc, "ggml_backend_rpc_init", [C, ctypes.c_uint32], P),
                (self.rpc, "ggml_backend_rpc_get_device_memory", [C, ctypes.c_uint32, sz, sz], None),
                (self.rpc, "ggml_backend_rpc_start_server", [C, C, S, S, ctypes.POINTER(P)], None),
                (self.ggml, "ggml_backend_reg_dev_count", [P], S),
                (self.ggml, "ggml_backend_reg_dev_get", [P, S], P),
                (self.ggml, "ggml_backend_dev_count", [], S),
                (self.ggml, "ggml_backend_dev_get", [S], P),
                (self.ggml, "ggml_backend_dev_by_name", [C], P),
                (self.ggml, "ggml_backend_dev_name", [P], C),
                (self.ggml, "ggml_backend_dev_description", [P], C),
                (self.ggml, "ggml_backend_dev_type", [P], ctypes.c_int),
                (self.ggml, "ggml_backend_dev_memory", [P, sz, sz], None),
                (self.base, "ggml_backend_free", [P], None),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.abort_cb_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
        self.base.ggml_set_abort_callback.argtypes = [self.abort_cb_type]
        self.base.ggml_set_abort_callback.restype = ctypes.c_void_p


def _loaded(name: str) -> str:
    """The file of `name` that libllama's process already has loaded (from /proc/self/maps), else the
    soname file next to libllama. Wheels hold copies, not symlinks, of libggml.so / .so.0 / .so.0.x: a
    dlopen of another copy would load a second ggml with its own state (abort hook, registry)."""
    import llama_cpp.llama_cpp as bindings         # lazily, as llama_lib: libllama loads only when used

    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                base = os.path.basename(path)
                if base == f"{name}.so" or base.startswith(f"{name}.so."):
                    return path
    except OSError:
        pass
    d = Path(bindings._lib._name).parent       # where llama-cpp-python loaded libllama from
    return str(d / f"{name}.so.0") if (d / f"{name}.so.0").exists() else str(d / f"{name}.so")


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        require_rpc()
        _ggml = _Ggml()
    return _ggml


def dev_info(dev) -> dict:
    g = ggml()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    g.ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return {"name": g.ggml.ggml_backend_dev_name(dev).decode(), "description":
            g.ggml.ggml_backend_dev_description(dev).decode(),
            "type": DEVICE_TYPES.get(g.ggml.ggml_backend_dev_type(dev), "?"), "free": free.value, "total": total.value}


def local_devices() -> list[dict]:
    """This machine's ggml devices (CPU, GPUs): what `edgerun worker --device` may name."""
    g = ggml()
    return [dev_info(g.ggml.ggml_backend_dev_get(i)) for i in range(g.ggml.ggml_backend_dev_count())]


def remote_devices(ep: Endpoint) -> list:
    """The worker's devices as ggml device handles (connects; ABORTS the process if the worker is gone)."""
    g = ggml()
    reg = g.rpc.ggml_backend_rpc_add_server(str(ep).encode())
    if not reg:
        raise ClusterError(f"RPC worker {ep} offers no devices")
    return [g.ggml.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml.ggml_backend_reg_dev_count(reg))]


# --- the handshake, in Python --------------------------------------------------------------------------

def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def hello(ep: Endpoint, timeout: float = 3.0) -> tuple[int, int, int]:
    """The worker's protocol version from ggml-rpc's HELLO exchange (then the connection is closed).

    ClusterError naming the worker when nothing listens, it does not answer in time (busy with another
    head: a worker serves one client at a time), or it closes the connection (another protocol)."""
    try:
        s = socket.create_connection((ep.host, ep.port), timeout=timeout)
    except socket.timeout:
        raise ClusterError(f"RPC worker {ep} is unreachable (no answer to connect within {timeout:g} s)") from None
    except OSError as e:
        why = "nothing listens there" if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e))
        raise ClusterError(f"RPC worker {ep} is unreachable ({why}); is `edgerun worker` (or its SSH "
                           f"tunnel) running?") from None
    with s:
        try:
            s.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            (n,) = struct.unpack("<Q", _recv_exact(s, 8))
            if n < 3 or n > 4096:
                raise ClusterError(f"RPC worker {ep} answered the handshake with {n} bytes: not a ggml-rpc "
                                   f"worker of protocol {fmt_version(PROTOCOL)}")
            body = _recv_exact(s, n)
        except socket.timeout:
            raise ClusterError(f"RPC worker {ep} accepted the connection but did not answer the handshake "
                               f"within {timeout:g} s: it is busy serving another head (one at a time) or it "
                               f"is not a ggml-rpc worker") from None
        except (EOFError, ConnectionResetError):
            raise ClusterError(f"RPC worker {ep} closed the connection at the handshake: it speaks another "
                               f"ggml-rpc protocol than {fmt_version(PROTOCOL)} (update llama-cpp-python on "
                               f"both sides to the same version) or it is not a ggml-rpc worker") from None
    return body[0], body[1], body[2]


def fmt_version(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def compatible(v: Sequence[int]) -> bool:
    """ggml-rpc's own rule (negotiate_hello): same major version, minor not newer than ours."""
    return v[0] == PROTOCOL[0] and v[1] <= PROTOCOL[1]


def check_version(ep: Endpoint, v: Sequence[int]) -> None:
    if not compatible(v):
        raise ClusterError(f"RPC worker {ep} speaks ggml-rpc protocol {fmt_version(v)} but this build speaks "
                           f"{fmt_version(PROTOCOL)}; install the same llama-cpp-python version on the head "
                           f"and the workers")


# --- a lost worker ----------------------------------------------------------------------------------------

def _addresses(host: str) -> set[str]:
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return {host}


def lost_workers(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """The workers this process no longer holds an established connection to (the worker closed it: its
    process died, or its SSH tunnel did). Read from the kernel's socket table, without touching ggml."""
    live = set()
    for c in psutil.Process().net_connections(kind="tcp4"):
        if c.raddr and c.status == psutil.CONN_ESTABLISHED:
            live.add((c.raddr.ip, c.raddr.port))
    return [ep for ep in endpoints if not any((ip, ep.port) in live for ip in _addresses(ep.host))]


def describe_loss(endpoints: Sequence[Endpoint], msg: str = "") -> str:
    """One line for ggml's abort in a process whose model is split over `endpoints`: the lost worker(s) if
    the socket table shows one, else ggml's own message (an abort that is not about a worker)."""
    lost = lost_workers(endpoints)
    if lost:
        names = ", ".join(str(ep) for ep in lost)
        return (f"lost the RPC worker{'s' if len(lost) > 1 else ''} {names} (its connection closed: the "
                f"worker or its tunnel stopped); llama.cpp cannot continue a model split without it")
    what = msg.split(": ", 1)[-1].strip() or "no message"
    return (f"llama.cpp stopped ({what}) while the model is split over " + ", ".join(str(ep) for ep in endpoints)
            + "; no worker connection had closed")


_abort_cb = None    # keep the ctypes callback alive


def on_abort(handler: Callable[[str], None]) -> None:
    """Call handler(ggml's message) instead of ggml's abort (the process still ends right after:
    handler should report and os._exit; if it returns, the process exits with status 2 here)."""
    global _abort_cb
    g = ggml()

    def cb(msg: bytes) -> None:
        try:
            handler(msg.decode("utf-8", "replace") if msg else "")
        finally:
            os._exit(2)

    _abort_cb = g.abort_cb_type(cb)
    g.base.ggml_set_abort_callback(_abort_cb)


def exit_on_lost_worker(endpoints: Sequence[Endpoint], code: int = 2) -> None:
    """Install the abort hook of a command line head: one `error:` line naming the lost worker, exit `code`."""
    def handler(msg: str) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        text = describe_loss(endpoints, msg)
        log.debug("ggml aborted: %s", msg)
        os.write(2, f"\nerror: {text}\n".encode())
        os._exit(code)

    on_abort(handler)


def wait_listening(ep: Endpoint, timeout: float = 10.0) -> bool:
    """Whether something accepts connections on ep within timeout (tests, bench: a worker has started)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection((ep.host, ep.port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False
