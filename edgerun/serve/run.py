"""Running the server: the listening socket, uvicorn with edgerun's signal handling, shutdown.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections import Counter
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:                                   # uvicorn's C-parser protocol (httptools, from uvloop's authors), when installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:                    # pragma: no cover - the serve extra installs it
    HttpToolsProtocol = None

from ..cluster.rpc import parse_endpoints
from ..cluster.status import require_all, status
from ..device import gpu
from ..device.detect import resolve as resolve_profile
from ..errors import ClusterError, EdgerunError, ModelNotFound
from ..registry.manifest import get_manifest
from ..resolve import resolve_model
from .loading import LoadAhead, default_loader
from .settings import ServerConfig, is_loopback


log = logging.getLogger(__name__)


# --- running it ----------------------------------------------------------------------------------

def precheck(config: ServerConfig) -> None:
    """Fail before binding the socket when a model name can never resolve (typo, missing file).

    A registry model that is not cached yet passes: it is pulled after the socket is bound."""
    if config.require_gpu:             # a llama.cpp without a GPU fails before the socket is bound
        gpu.enforce(gpu.check(resolve_profile(config.profile)[0], require=True), True)
    if config.rpc:                     # the workers answer and speak our protocol (asked in a child process)
        require_all(status(parse_endpoints(config.rpc)))
    for spec in (config.model, config.draft):
        if spec in (None, "auto", "none", "lookup", "suffix"):
            continue
        try:
            resolve_model(spec, pull=False)
        except ModelNotFound as first:
            if spec.startswith("hf:"):     # a hub name not pulled yet: pulled after the socket is bound
                continue
            try:
                get_manifest(spec)
            except ModelNotFound:
                raise first from None


# Connections: how long a client may take to send a request's headers and body (slow or idle sockets are
# closed after it), how many connections one non-loopback address may hold, and uvicorn's connection cap
# (idle sockets count against it; above it every request, /health too, gets a plain 503).
READ_TIMEOUT_S = 10.0
PER_PEER_CONNECTIONS = 64
MAX_CONNECTIONS = 512


class _Guard:
    """Mixed into uvicorn's HTTP/1.1 protocols (h11 and httptools): a deadline for reading each request
    (headers and body) and a cap on the connections of one non-loopback peer. uvicorn itself closes sockets idle between requests only
    (keep-alive timeout); one that never sends a request, or trickles it, would stay open for ever."""

    _per_peer: Counter = Counter()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = None
        self._peer = self.client[0] if self.client else None
        _Guard._per_peer[self._peer] += 1
        if self._peer and not is_loopback(self._peer) and _Guard._per_peer[self._peer] > PER_PEER_CONNECTIONS:
            log.warning("closing a connection from %s: it holds more than %d", self._peer, PER_PEER_CONNECTIONS)
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(READ_TIMEOUT_S, self._read_deadline)

    def _read_deadline(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        reading = cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)
        if reading and not self.transport.is_closing():
            self.transport.close()          # no whole request within the deadline: idle, slow headers or body

    def eof_received(self) -> bool:
        """A client that half-closes its side after the request (shutdown(SHUT_WR)) still gets the answer:
        keep the transport open for writing while a request is being answered; close an idle one."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.more_body:                 # the body was cut short: nothing to answer
                return False
            cycle.keep_alive = False            # the answer is the last thing on this connection
            return True
        return False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()                         # the next request on this connection gets its own deadline

    def connection_lost(self, exc) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        _Guard._per_peer[self._peer] -= 1
        if _Guard._per_peer[self._peer] <= 0:
            del _Guard._per_peer[self._peer]
        super().connection_lost(exc)


class _GuardedH11(_Guard, H11Protocol):
    """uvicorn's pure-Python HTTP/1.1 protocol (h11), guarded."""


if HttpToolsProtocol is not None:
    class _GuardedHttpTools(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol, guarded: the same answers as h11's with less event-loop time per
        streamed token (its response framing is a few byte joins where h11 runs a state machine per chunk;
        docs/batching.md has the figures)."""


def http_protocol() -> type:
    """The guarded protocol uvicorn serves with: httptools where installed (the serve extra), else h11.
    EDGERUN_HTTP=h11 picks h11 (a fallback, and the baseline of the comparison in docs/batching.md)."""
    if HttpToolsProtocol is not None and os.environ.get("EDGERUN_HTTP", "auto") != "h11":
        return _GuardedHttpTools
    return _GuardedH11


class _UvicornServer(uvicorn.Server):
    """uvicorn's server with a signal handler that drains edgerun's queue and exits 0.

    uvicorn's own handler re-raises SIGTERM after a graceful shutdown, which would end the
    process by the signal (exit status 143) instead of the clean exit 0 systemd expects."""

    on_signal: Callable[[], None] = staticmethod(lambda: None)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True          # a second Ctrl+C: stop waiting for connections
        else:
            self.should_exit = True
        self.on_signal()


class BindError(EdgerunError):
    """The HTTP socket could not be bound (address in use, not a local address, port < 1024 without rights)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port). Bound before the models load."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"cannot resolve the host {host!r}: {e.strerror}; expected an IP address or a "
                        f"resolvable name such as 127.0.0.1") from None
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {e.strerror}; is another server using the port? "
                        f"(choose another with --port)") from None
    return sock


def serve(config: ServerConfig, *, load: Callable[[], Any] | None = None, log_level: str = "info") -> None:
    """Run the server until SIGTERM/SIGINT, then return (exit 0). Raises the load error (an EdgerunError)
    if the model fails to load, BindError if the socket cannot be bound."""
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    sockets = [sock]
    if config.ollama_port is not None:           # a second port for Ollama's clients (same app)
        try:
            sockets.append(bind_socket(config.host, config.ollama_port))
        except BindError:
            sock.close()
            raise
    if load is None:                             # the models load while the web stack below imports
        load = LoadAhead(default_loader(config))
    from .app import create_app

    holder: dict = {}
    app = create_app(config, load=load, request_exit=lambda: setattr(holder["server"], "should_exit", True))
    state = app.state.edgerun
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    state.bound = (probe_host, port)
    uv_config = uvicorn.Config(app, host=config.host, port=port, log_config=None, log_level=log_level,
                               access_log=False, lifespan="on", proxy_headers=False, server_header=False,
                               timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5,
                               limit_concurrency=MAX_CONNECTIONS, http=http_protocol())
    server = _UvicornServer(uv_config)
    holder["server"] = server

    def on_signal() -> None:
        loop = state.loop
        if loop is not None:
            loop.call_soon_threadsafe(state.begin_drain)

    server.on_signal = on_signal
    if not is_loopback(host) and config.api_key is None:
        log.warning("listening on %s WITHOUT an API key (--insecure-no-auth): anyone who can reach this port "
                    "can use the model", host)
    log.info("listening on http://%s:%d (model %s loads in the background)",
             f"[{host}]" if ":" in host else host, port, config.model)
    if config.ollama_port is not None:
        log.info("listening for Ollama's clients on http://%s:%d too", f"[{host}]" if ":" in host else host,
                 config.ollama_port)
    try:
        server.run(sockets=sockets)
    finally:
        for s in sockets:
            s.close()
    if state.lost_worker is not None:
        raise ClusterError(state.lost_worker)
    err = state.scheduler.load_error
    if err is not None:
        if isinstance(err, EdgerunError):
            raise err
        raise EdgerunError(f"the model failed to load: {err}") from err


