"""The gate every request passes first (plain ASGI, so streaming and disconnects stay untouched): the Host
and Origin checks against DNS rebinding and cross-site pages, the API key (constant-time), CORS, and the
per-endpoint request counts."""

from __future__ import annotations

import hmac
import logging

from fastapi.responses import JSONResponse, Response

from .protocol import APIError
from .state import _State

log = logging.getLogger(__name__)


class _Gate:
    """ASGI middleware: refuses requests without the API key (401) and counts answers by endpoint."""

    def __init__(self, app, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = self.state.metrics.endpoint_of(path)
        metrics = self.state.metrics

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                metrics.count_request(endpoint, message["status"])
            await send(message)

        config = self.state.config
        headers = {k: v for k, v in scope.get("headers", ())}
        refused = _browser_refusal(config, headers)
        if refused is not None:
            await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, counting_send)
            return
        origin = headers.get(b"origin", b"").decode("latin-1")
        if origin:                                   # an allowed browser origin: CORS headers on the answer
            inner = counting_send

            async def counting_send(message) -> None:            # noqa: F811 - wraps the counter
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
                await inner(message)

            if scope.get("method") == "OPTIONS":               # a preflight: answered here, before the key
                await Response(status_code=204)(scope, receive, counting_send)
                return
        keys = config.api_keys()
        if keys and path not in self.state.open_paths:
            number = _key_number(scope, keys)
            if number is None:
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await JSONResponse(err.body(), status_code=401, headers=err.headers)(scope, receive, counting_send)
                return
            scope["edgerun.key"] = number            # which key (1, 2, ...): the request's history bucket
        await self.app(scope, receive, counting_send)


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def _browser_refusal(config, headers: dict) -> APIError | None:
    """Requests a web page (not the board's user) could have made: a Host that is not this server's
    loopback name (DNS rebinding) or an Origin that is not allowed (cross-site requests)."""
    from .settings import is_loopback, is_loopback_address

    if is_loopback(config.host):
        host = headers.get(b"host", b"").decode("latin-1").strip().lower()
        name = host[: host.rindex("]") + 1] if host.startswith("[") else host.split(":", 1)[0]
        allowed = _LOOPBACK_NAMES | {h.lower() for h in config.allowed_hosts} | {config.host}
        if host and name not in allowed and not is_loopback_address(name):
            return APIError(403, f"Host {name!r:.60} is not this server's name (a web page using DNS rebinding?); "
                                 "allow it with --allow-host / EDGERUN_ALLOW_HOST", code="host_not_allowed")
    origin = headers.get(b"origin", b"").decode("latin-1").strip()
    # the server's own page (ui.py) is same-origin: its Host passed the check above, or the API key guards it
    own = origin.lower() == "http://" + headers.get(b"host", b"").decode("latin-1").strip().lower() and \
        (is_loopback(config.host) or config.api_key is not None)
    if origin and not own and origin not in config.cors_origins and "*" not in config.cors_origins:
        return APIError(403, f"requests from the web page at {origin!r:.80} are not allowed; allow its origin with "
                             "--cors-origin / EDGERUN_CORS_ORIGIN", code="origin_not_allowed")
    return None


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"access-control-max-age", b"600")]


def _key_number(scope, keys: tuple[str, ...]) -> int | None:
    """1 + the index of the key the request's bearer token equals, or None (each key compared in full)."""
    header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        token = b""
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(token.strip(), key.encode("utf-8")) and found is None:
            found = i + 1
    return found
