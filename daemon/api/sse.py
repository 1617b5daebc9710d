"""A Server-Sent Events response that costs one task per stream.

Starlette's `StreamingResponse` runs each stream in an anyio task group beside a disconnect listener:
about a third of a millisecond of CPU per request on this project's machines (bench/control_plane_cost.py,
docs/vllm.md). `EventStream` sends the iterator's chunks itself and watches for the client leaving with one
plain asyncio task, which cancels the stream: the iterator is closed where it waits (the gateway then
cancels the request on its worker), as with Starlette's. A `Final` chunk goes out with the end of the
response (one write instead of two).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class Final(bytes):
    """A stream's last piece: sent with the end of the response in one write."""


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            last = False
            async for chunk in self.chunks:
                last = isinstance(chunk, Final)
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:  # cancelled for another reason than the client leaving
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.chunks.aclose()
