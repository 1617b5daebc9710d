"""The transports' own CPU floor, without Tetri's logic: what the daemon's HTTP edge and its gRPC calls to
workers cost at the least, per request and per token, on this machine.

    python bench/transport_floor.py [--requests 600] [--concurrency 16] [--step-ms 0] [--only-http]

HTTP: a server process answering POST /v1/completions with one SSE event per token (a fixed OpenAI-shaped
chunk), measured at the server, four ways:
  * fastapi-streaming — a FastAPI endpoint with a pydantic body and Starlette's StreamingResponse;
  * fastapi-eventstream — the same endpoint answering with the daemon's `EventStream` (daemon/api/sse.py);
  * raw-asgi — a bare ASGI app under uvicorn (the floor under any framework);
  * raw-socket — no HTTP server library: an asyncio Protocol on uvloop parsing the request itself and
    writing the chunked response (the floor under any Python HTTP server: one socket write per event).
`--step-ms S` sends each stream's events S ms apart, every stream on one step timer, as tokens arriving
one engine step apart are relayed; by default they go back to back, and the kernel coalesces them.
gRPC: a worker-like server sending `--tokens` TokenChunks per request, and this process as the client:
  * call-per-request — a unary-stream call per request, a message per token (Tetri before the Serve stream);
  * multiplexed — every request a call on one bidirectional stream, a ServeUp to start it (those queued
    meanwhile in one ServeUps message), the ready chunks of all calls coalesced per ServeDown message
    (Tetri's Serve stream, docs/cluster.md).

CPU seconds (utime + stime from /proc) per batch; a = per request and b = per token are solved from a
batch of 8-token and a batch of 128-token requests. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
SHORT, LONG = 8, 128

HTTP_SERVER = r"""
import asyncio, json, sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, TypeAdapter
from daemon.api.sse import EventStream

kind, port = sys.argv[1], int(sys.argv[2])

class Body(BaseModel):
    model: str
    prompt: list[int]
    max_tokens: int = 16
    stream: bool = False

def chunk(i: int) -> bytes:
    doc = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": "ab", "finish_reason": None, "token_ids": [i]}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"

step_s = float(sys.argv[3]) / 1000
tick = None  # with --step-ms: a future every stream's next event waits for, done once a step


async def ticker():
    global tick
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(step_s)
        done, tick = tick, loop.create_future()
        done.set_result(None)


async def events(n: int):
    global tick
    for i in range(n):
        if step_s:
            if tick is None:
                tick = asyncio.get_running_loop().create_future()
                asyncio.ensure_future(ticker())
            await asyncio.shield(tick)
        yield chunk(i)
    yield b"data: [DONE]\n\n"

if kind == "raw-socket":
    # no server framework: an asyncio Protocol reading the request (headers, a Content-Length body) and
    # writing a chunked SSE response itself; with --step-ms one timer a step writes every open stream's
    # next event (one socket write per stream per step, as a relay does) — the floor under any Python
    # HTTP server
    streams = {}  # transport -> [tokens left, next token]
    OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    def write_step():
        for tr, st in list(streams.items()):
            c = chunk(st[1])
            st[1] += 1
            st[0] -= 1
            if st[0] <= 0:
                del streams[tr]
                done = b"data: [DONE]\n\n"
                tr.write(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(c), c, len(done), done))
            else:
                tr.write(b"%x\r\n%s\r\n" % (len(c), c))

    async def steps():
        while True:
            write_step()
            await asyncio.sleep(step_s)

    class Http(asyncio.Protocol):
        def connection_made(self, tr):
            self.tr, self.buf = tr, b""

        def data_received(self, data):
            self.buf += data
            while True:
                head, sep, rest = self.buf.partition(b"\r\n\r\n")
                if not sep:
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(rest) < length:
                    return
                self.buf = rest[length:]
                if not head.startswith(b"POST"):
                    self.tr.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                b = Body.model_validate_json(rest[:length])
                self.tr.write(OK)
                streams[self.tr] = [b.max_tokens, 0]

        def connection_lost(self, exc):
            streams.pop(self.tr, None)

    async def serve():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Http, "127.0.0.1", port)
        if step_s:
            asyncio.ensure_future(steps())
        else:  # back to back: write until no stream is open, then wait for one
            async def spin():
                while True:
                    write_step()
                    await asyncio.sleep(0 if streams else 0.001)
            asyncio.ensure_future(spin())
        await server.serve_forever()

    import uvloop
    uvloop.run(serve())
    sys.exit(0)

if kind == "raw-asgi":
    body_of = TypeAdapter(Body)

    async def app(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b""})
            return
        raw = b""
        while True:
            m = await receive()
            raw += m.get("body", b"")
            if not m.get("more_body"):
                break
        b = body_of.validate_json(raw)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for c in events(b.max_tokens):
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
else:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: Body):
        if kind == "fastapi-streaming":
            return StreamingResponse(events(body.max_tokens), media_type="text/event-stream")
        async def write(send) -> bytes:
            async for c in events(body.max_tokens):
                await send({"type": "http.response.body", "body": c, "more_body": True})
            return b""

        return EventStream(write)

import uvicorn
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""

GRPC_SERVER = r"""
import asyncio, sys
import grpc
from tetri.proto import pb, rpc

class Worker(rpc.WorkerServicer):
    async def Serve(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()

        async def run(up):
            n = up.generate.max_tokens
            for i in range(n):
                await asyncio.sleep(0)  # one engine step
                rid = up.generate.request_id
                out.put_nowait(pb.TokenChunk(request_id=rid, call=up.call, token_ids=[i], finished=i == n - 1))

        async def read():
            async for msg in request_iterator:
                for up in msg.ups:
                    asyncio.create_task(run(up))

        reader = asyncio.create_task(read())
        while True:
            batch = [await out.get()]
            await asyncio.sleep(0)
            while not out.empty():
                batch.append(out.get_nowait())
            yield pb.ServeDown(chunks=batch)

async def generate(request, context):  # a unary-stream call per request (the old Worker.Generate)
    n = request.max_tokens
    for i in range(n):
        await asyncio.sleep(0)
        yield pb.TokenChunk(request_id=request.request_id, token_ids=[i], finished=i == n - 1)

async def main():
    server = grpc.aio.server()
    rpc.add_WorkerServicer_to_server(Worker(), server)
    handler = grpc.unary_stream_rpc_method_handler(
        generate,
        request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.TokenChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Old", {"Generate": handler}),))
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:13]) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(code: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env)


@contextmanager
def http_server(kind: str, step_ms: float) -> Iterator[tuple[str, int]]:
    """One of HTTP_SERVER's servers, started and answering: (its URL, its pid); stopped after."""
    port = free_port()
    proc = start(HTTP_SERVER, kind, str(port), str(step_ms))
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait()


def fit(short: float, long: float) -> tuple[float, float]:
    """a + b × SHORT = short, a + b × LONG = long (CPU seconds per request)."""
    b = (long - short) / (LONG - SHORT)
    return short - b * SHORT, b


async def http_batch(url: str, n: int, tokens: int, concurrency: int) -> None:
    conc = concurrency
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        body = {"model": "m", "prompt": list(range(64)), "max_tokens": tokens, "stream": True}
        left = [n]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

        await asyncio.gather(*(worker() for _ in range(conc)))


async def grpc_batch(address: str, multiplexed: bool, n: int, tokens: int, concurrency: int) -> None:
    conc = concurrency
    import grpc

    from tetri.proto import pb, rpc

    async with grpc.aio.insecure_channel(address) as channel:
        left, seq = [n], [0]
        if multiplexed:
            up: asyncio.Queue[pb.ServeUp] = asyncio.Queue()
            queues: dict[int, asyncio.Queue[pb.TokenChunk]] = {}

            async def ups() -> AsyncIterator[pb.ServeUps]:
                while True:  # what queued while the last message was written goes out together
                    batch = [await up.get()]
                    while not up.empty():
                        batch.append(up.get_nowait())
                    yield pb.ServeUps(ups=batch)

            call = rpc.WorkerStub(channel).Serve(ups())

            async def read() -> None:
                async for down in call:
                    for c in down.chunks:
                        queues[c.call].put_nowait(c)

            reader = asyncio.create_task(read())

        old = channel.unary_stream(
            "/bench.Old/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.TokenChunk.FromString,
        )

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                seq[0] += 1
                req = pb.GenerateRequest(request_id=f"r{seq[0]}", prompt_token_ids=list(range(64)), max_tokens=tokens)
                if not multiplexed:
                    async for _ in old(req):
                        pass
                    continue
                q = queues[seq[0]] = asyncio.Queue()
                up.put_nowait(pb.ServeUp(call=seq[0], generate=req))
                while not (await q.get()).finished:
                    pass

        await asyncio.gather(*(worker() for _ in range(conc)))
        if multiplexed:
            reader.cancel()
            call.cancel()


Batch = Callable[[int], Coroutine[Any, Any, None]]


def measure(run: Batch, server_pid: int, n: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(server a, b), (client a, b) in µs."""
    per: dict[str, list[float]] = {"server": [], "client": []}
    for tokens in (SHORT, LONG):
        s0, c0 = cpu_seconds(server_pid), time.process_time()
        asyncio.run(run(tokens))
        per["server"].append((cpu_seconds(server_pid) - s0) / n)
        per["client"].append((time.process_time() - c0) / n)
    s, c = fit(*per["server"]), fit(*per["client"])
    return (s[0] * 1e6, s[1] * 1e6), (c[0] * 1e6, c[1] * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600, help="requests per batch")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="HTTP servers send a stream's events this far apart, all streams on one step timer, as a "
        "relay does when tokens arrive one engine step apart (0: back to back, as fast as the client reads)",
    )
    ap.add_argument("--only-http", action="store_true", help="skip the gRPC rows")
    args = ap.parse_args()
    n, conc = args.requests, args.concurrency
    t = Table(
        title=f"Transport floor: {n} requests × {SHORT} and × {LONG} tokens, {conc} at a time, "
        + (f"events {args.step_ms:g} ms apart" if args.step_ms else "events back to back"),
        title_justify="left",
    )
    for col in ("transport", "variant", "server µs / req", "server µs / token", "client µs / req", "client µs / token"):
        t.add_column(col, justify="left" if col in ("transport", "variant") else "right")
    for kind in ("fastapi-streaming", "fastapi-eventstream", "raw-asgi", "raw-socket"):
        with http_server(kind, args.step_ms) as (url, pid):
            asyncio.run(http_batch(url, 50, SHORT, conc))  # warm-up
            http_run: Batch = partial(http_batch, url, n, concurrency=conc)
            (sa, sb), _ = measure(http_run, pid, n)
            t.add_row("HTTP + SSE", kind, f"{sa:,.0f}", f"{sb:.1f}", "", "")
    if args.only_http:
        Console(width=140).print(t)
        return
    t.add_section()
    port = free_port()
    proc = start(GRPC_SERVER, str(port))
    try:
        time.sleep(2.0)
        address = f"127.0.0.1:{port}"
        for multiplexed, label in ((False, "call-per-request"), (True, "multiplexed (Serve)")):
            asyncio.run(grpc_batch(address, multiplexed, 50, SHORT, conc))  # warm-up
            grpc_run: Batch = partial(grpc_batch, address, multiplexed, n, concurrency=conc)
            (sa, sb), (ca, cb) = measure(grpc_run, proc.pid, n)
            t.add_row("gRPC", label, f"{sa:,.0f}", f"{sb:.1f}", f"{ca:,.0f}", f"{cb:.1f}")
    finally:
        proc.terminate()
        proc.wait()
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
