"""`StreamSend.write_now` under a real uvicorn (httptools) server: a body chunk goes straight to the connection
while the client reads; when the client stops reading and the socket pauses, chunks go through uvicorn's
`send`, which waits; either way the client gets every chunk, in order, framed as chunked encoding."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from daemon.api.sse import EventStream, StreamSend

CHUNKS = 400
SIZE = 16_384  # 400 × 16 KiB: far past the socket buffers and uvicorn's high-water mark


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chunk(i: int) -> bytes:
    return (b"%06d" % i) * (SIZE // 6) + b"\n"


async def _serve_and_read(read_delay_s: float) -> tuple[bytes, dict[str, int]]:
    """The chunks as the client reads them (it waits `read_delay_s` before reading), and how many went
    straight to the connection and how many through `send`."""
    ways = {"direct": 0, "send": 0}

    async def body(out: StreamSend) -> bytes:
        await out({"type": "http.response.body", "body": b"", "more_body": True})  # starts the response
        for i in range(CHUNKS):
            data = _chunk(i)
            if out.write_now(data):
                ways["direct"] += 1
            else:
                ways["send"] += 1
                await out({"type": "http.response.body", "body": data, "more_body": True})
        return b"end\n"

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await EventStream(body)(scope, receive, send)

    port = _free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http="httptools", log_level="warning", loop="asyncio", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(read_delay_s)  # a slow client: the server's writes back up meanwhile
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        got = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            got += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
        writer.close()
        return bytes(got), ways
    finally:
        server.should_exit = True
        await task


def test_chunks_go_straight_to_the_connection_while_the_client_reads() -> None:
    got, ways = asyncio.run(_serve_and_read(0.0))
    assert got == b"".join(_chunk(i) for i in range(CHUNKS)) + b"end\n"
    assert ways["direct"] > 0


def test_a_client_that_stops_reading_gets_every_chunk_in_order_through_send() -> None:
    got, ways = asyncio.run(_serve_and_read(0.5))
    assert got == b"".join(_chunk(i) for i in range(CHUNKS)) + b"end\n"
    assert ways["send"] > 0  # the socket paused: those chunks waited in uvicorn's send
