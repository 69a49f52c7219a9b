"""Running the server: the listening socket, uvicorn with edgerun's signal handling, shutdown.
"""

from __future__ import annotations

import logging
import signal
import socket
from typing import Any, Callable

import uvicorn

from ..errors import EdgerunError, ModelNotFound
from .app import _State, create_app
from .settings import ServerConfig, is_loopback


log = logging.getLogger(__name__)


# --- running it ----------------------------------------------------------------------------------

def precheck(config: ServerConfig) -> None:
    """Fail before binding the socket when a model name can never resolve (typo, missing file).

    A registry model that is not cached yet passes: it is pulled after the socket is bound."""
    from ..registry.manifest import get_manifest
    from ..registry.cache import resolve_model

    for spec in (config.model, config.draft):
        if spec in (None, "auto", "none", "lookup"):
            continue
        try:
            resolve_model(spec, pull=False)
        except ModelNotFound as first:
            try:
                get_manifest(spec)
            except ModelNotFound:
                raise first from None


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
    holder: dict = {}
    app = create_app(config, load=load, request_exit=lambda: setattr(holder["server"], "should_exit", True))
    state: _State = app.state.edgerun
    uv_config = uvicorn.Config(app, host=config.host, port=port, log_config=None, log_level=log_level,
                               access_log=False, lifespan="on", proxy_headers=False, server_header=False,
                               timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5,
                               limit_concurrency=max(64, 4 * (config.queue + 1)))
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
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    err = state.scheduler.load_error
    if err is not None:
        if isinstance(err, EdgerunError):
            raise err
        raise EdgerunError(f"the model failed to load: {err}") from err


