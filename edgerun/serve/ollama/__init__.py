"""Ollama's API beside OpenAI's, on the same port and through the same machinery.

Endpoints (Ollama's docs/api.md): POST /api/chat and /api/generate (NDJSON streams by default, `stream: false`
for one object), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, POST /api/pull (only with
--allow-pull: it writes to disk). Other /api/* endpoints of Ollama (create, push, copy, delete, embed,
embeddings, blobs) answer 501.

A request becomes the same scheduler Job the OpenAI routes build: the same checks (serve/protocol.py:
sampling ranges, stop strings, token limits, the context-size precheck), the same structured output
(`format: "json"` or a JSON schema -> response_format), the same tool calling (`tools`, answered as
`message.tool_calls` with arguments as objects), the same queue, time limit and disconnect handling
(handling.start_job). The API key, Host/Origin and body-size rules are the app's middleware and body reader.

Ollama's clients send `options` freely (num_ctx, num_thread, mirostat, ...): an option this server
cannot honour is ignored, and a value out of range is clamped, never refused. What was ignored or
clamped is named in the `X-Edgerun-Options` response header and logged. Errors are Ollama's
{"error": "..."} (errors.py's middleware reshapes the app's OpenAI-style errors on /api/* paths).

The package, by subject: translate.py (an Ollama request as edgerun's: bodies, names, options, format,
tools, and the one call into protocol.py's checks), shape.py (answers: one object or NDJSON, tool calls),
facts.py (the model as /api/tags, /show and /ps describe it), pull.py (/api/pull), errors.py (the error
shape, the 501s), routes.py (one handler per route, and install()).
"""

from __future__ import annotations

from .routes import OLLAMA_API_VERSION, ROUTES, install

__all__ = ["OLLAMA_API_VERSION", "ROUTES", "install"]
