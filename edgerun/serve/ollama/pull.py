"""/api/pull: edgerun's registry pull on a thread, its progress as Ollama's status lines (only with
--allow-pull: it writes to disk)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from ...errors import EdgerunError
from ...registry.fetch import pull as fetch
from ...registry.manifest import get_manifest
from ..protocol import APIError
from .shape import NDJSON, line


async def pull(name: str, stream: bool):
    """Pull a registry model: an NDJSON stream of status lines, or the last line once done."""
    try:
        m = get_manifest(name)
    except EdgerunError as e:
        raise APIError(404, f'pull model manifest: model "{name}" not found in the edgerun registry ({e})',
                       code="model_not_found") from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    digest = "sha256:" + m.sha256

    def progress(stage: str, done: int, total: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"status": f"pulling {m.sha256[:12]}" if stage == "download"
                                                     else stage, "digest": digest, "total": total,
                                                     "completed": done})

    def work():
        try:
            fetch(name, progress)
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except BaseException as e:                   # noqa: BLE001 - reported to the client
            loop.call_soon_threadsafe(queue.put_nowait, e)

    async def lines() -> AsyncIterator[dict]:
        yield {"status": "pulling manifest"}
        task = loop.run_in_executor(None, work)
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                yield {"error": f"pull {name}: {item}"}
                await task
                return
            yield item
        await task
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    if stream:
        async def body():
            async for obj in lines():
                yield line(obj)
        return StreamingResponse(body(), media_type=NDJSON)
    last: dict = {}
    async for obj in lines():
        last = obj
    if "error" in last:
        raise APIError(500 if "No space" not in last["error"] else 507, last["error"])
    return last
