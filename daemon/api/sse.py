"""A Server-Sent Events response that costs one task per stream.

Starlette's `StreamingResponse` runs each stream in an anyio task group beside a disconnect listener:
about a third of a millisecond of CPU per request on this project's machines (bench/control_plane_cost.py,
docs/vllm.md). `EventStream` runs the stream's body in the request's own task, handing it a `write` for
each piece, and watches for the client leaving with one plain asyncio task, which cancels the body where it
waits (the gateway then leaves the request's worker call), as with Starlette's. The body returns its last
piece, which goes out with the end of the response (one write instead of two).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Write = Callable[[bytes], Awaitable[None]]


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, body: Callable[[Write], Awaitable[bytes]]) -> None:
        self.body_writer = body
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

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            last = await self.body_writer(write)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:  # cancelled for another reason than the client leaving
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
