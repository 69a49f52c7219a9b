"""Ollama's error shape on /api/* paths, and the 501 of the Ollama endpoints edgerun does not serve."""

from __future__ import annotations

import json

from ..protocol import APIError

UNSUPPORTED = ("/api/create", "/api/push", "/api/copy", "/api/delete", "/api/embed", "/api/embeddings")


def unsupported(path: str):
    """A route that answers 501 for an Ollama endpoint edgerun does not serve."""
    async def refuse():
        raise APIError(501, f"{path} is not supported by edgerun (it serves one model: "
                            "see docs/clients.md)", code="not_implemented")
    return refuse


class OllamaErrors:
    """ASGI middleware: on /api/* paths an error answered in the app's OpenAI shape ({"error": {"message":
    ...}}) is re-shaped as Ollama's {"error": "..."}, and a 422 (a body of the wrong shape) becomes Ollama's 400.
    Wraps the API-key gate, so its 401 and 403 are re-shaped too. Other paths pass untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/api/"):
            await self.app(scope, receive, send)
            return
        held: dict = {}
        chunks: list[bytes] = []

        async def reshaping_send(message) -> None:
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and ctype.startswith(b"application/json"):
                    held["start"] = message              # buffered: the body is rewritten once whole
                    return
                await send(message)
                return
            if message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await _send_reshaped(send, held.pop("start"), b"".join(chunks))
                return
            await send(message)

        await self.app(scope, receive, reshaping_send)


async def _send_reshaped(send, start: dict, body: bytes) -> None:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            body = json.dumps({"error": err.get("message", "")}).encode("utf-8")
    except (ValueError, AttributeError):
        pass
    status = 400 if start["status"] == 422 else start["status"]
    headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
