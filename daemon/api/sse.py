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

`StreamSend.write_now` goes one step further where the server is uvicorn's httptools one: a body chunk
of a started chunked response goes straight to the connection's transport (the chunk's framing and one
`transport.write`, what uvicorn's `send` ends in), without the message dict, the coroutine and uvicorn's
checks around it — unless the socket is paused for a slow client, when the chunk goes through `send`
(which waits for it). Any other server, or a uvicorn whose connection lacks what this reads, gets `send`
for every chunk. (bench/relay_cost.py, docs/cluster.md.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send


class StreamSend:
    """An event stream's `send`: the server's, the response started (200, its headers) with the first
    message; and `write_now`, a body chunk written at once where the server allows it."""

    __slots__ = ("_cycle", "_headers", "_send", "started")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self.started = False
        cycle = getattr(send, "__self__", None)  # uvicorn's send is its connection cycle's bound method
        ok = type(cycle).__module__ == "uvicorn.protocols.http.httptools_impl" and all(
            hasattr(cycle, a) for a in ("transport", "flow", "chunked_encoding", "disconnected", "response_complete")
        )
        self._cycle: Any = cycle if ok else None

    def __call__(self, message: Message) -> Awaitable[None]:
        if self.started:
            return self._send(message)
        self.started = True
        return self._start_then(message)

    async def _start_then(self, message: Message) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})
        await self._send(message)

    def write_now(self, data: bytes) -> bool:
        """Write a body chunk (more to come) straight to the connection: True when done (or dropped: the
        client is gone, as uvicorn's `send` drops it); False when it must go through `send` instead (not
        uvicorn's httptools server, the response not started, the socket paused for a slow client)."""
        c = self._cycle
        if c is None or c.chunked_encoding is not True or c.response_complete or c.flow.write_paused:
            return False
        if not c.disconnected:
            c.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True


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

    def __init__(self, body: Callable[[StreamSend], Awaitable[bytes | Response]]) -> None:
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
        out = StreamSend(send, self.raw_headers)
        try:
            last = await self.body_writer(out)
            if isinstance(last, Response):
                assert not out.started, "a stream that has begun cannot answer otherwise"
                await last(scope, receive, send)
            else:
                await out({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:  # cancelled for another reason than the client leaving
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
