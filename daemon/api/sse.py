"""A Server-Sent Events response that costs one task per stream.

Starlette's `StreamingResponse` runs each stream in an anyio task group beside a disconnect listener:
about a third of a millisecond of CPU per request on this project's machines (bench/control_plane_cost.py,
docs/vllm.md). `EventStream` runs the stream's body in the request's own task, handing it the server's
`send`, and watches for the client leaving with one plain asyncio task, which cancels the body where it
waits (the gateway then leaves the request's worker call), as with Starlette's. The body returns its last
piece, which goes out with the end of the response (one write instead of two).

`send_now` runs a `send` from wherever the data is ready (the token path writes each engine step's frame
from the Serve stream's reader, with no task switch): an ASGI server's `send` waits only while the client's
socket buffer is full (uvicorn's flow control), so it almost always completes at once; when it does wait,
a task finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send


def send_now(send: Send, message: Message) -> asyncio.Future[None] | None:
    """Run `send(message)` now: None when it is done; when it has to wait, a future of its end (a task
    finishing it). Its failure is raised here, or by the future."""
    coro: Coroutine[Any, Any, None] = send(message)  # type: ignore[assignment]
    try:
        awaiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coro, awaiting))


async def _finish(coro: Coroutine[Any, Any, None], awaiting: Any) -> None:
    """Go on with a coroutine stopped at what it awaits (a future, or a bare yield), as a task would: wait
    until that is done, then resume it (it reads the future's result or exception itself)."""
    while True:
        try:
            if awaiting is None:
                await asyncio.sleep(0)
            else:
                awaiting._asyncio_future_blocking = False  # taken, as a task takes the future it is handed
                await asyncio.wait((awaiting,))
        except asyncio.CancelledError as e:  # this task was cancelled: so is what the coroutine awaits
            if awaiting is not None:
                awaiting.cancel()
            try:
                awaiting = coro.throw(e)
            except StopIteration:
                return
            continue
        try:
            awaiting = coro.send(None)
        except StopIteration:
            return


class EventStream(Response):
    """The response starts (200, its headers) with the body's first write, so that a body which ends
    before writing anything can answer otherwise: it returns a whole `Response` (a request its instance
    rejected before its first token: 429) instead of its last piece."""

    media_type = "text/event-stream"

    def __init__(self, body: Callable[[Send], Awaitable[bytes | Response]]) -> None:
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

        watcher = asyncio.create_task(watch())
        started = False

        async def start_then(message: Message) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send(message)

        def lazy(message: Message) -> Awaitable[None]:
            nonlocal started
            if started:
                return send(message)
            started = True
            return start_then(message)

        try:
            last = await self.body_writer(lazy)
            if isinstance(last, Response):
                assert not started, "a stream that has begun cannot answer otherwise"
                await last(scope, receive, send)
            else:
                await lazy({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:  # cancelled for another reason than the client leaving
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
