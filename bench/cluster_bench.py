"""Control-plane benchmark: requests/s through the daemon with the status table on, and the latency the
daemon adds over calling the workers directly (same requests, same workers, side by side).

    python bench/cluster_bench.py [--requests 3000] [--latency-requests 300] [--concurrency 64] [--time-scale 1000]

Starts a daemon and one prefill + one decode sim worker on loopback (as `tetrictl up` does), then:
1. latency, one request at a time: N requests straight to the workers over gRPC (a prefill Generate call,
   then a decode Attach call, on Serve streams: exactly the daemon's calls), and N through the daemon's
   HTTP API; the p50/p99
   difference is the control plane's added latency;
2. throughput: `--requests` short requests from `--concurrency` concurrent clients through the daemon.
Short requests: 16 prompt tokens, 4 output tokens. Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from tetri.proto import pb
from tetri.proto.peers import Peers
from tetri.proto.serve import ServeStream, ServeStreams
from tetrictl.procs import start_local_cluster

console = Console(width=120)
PROMPT = list(range(1, 17))
MAX_TOKENS = 4


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def direct(prefill_addr: str, n: int, token: str | None) -> list[float]:
    """The daemon's calls, made straight to the workers on Serve streams (with the cluster token, as the
    daemon makes them: `tetri.proto.serve`)."""

    async def answers(stream: ServeStream, **op: pb.GenerateRequest | pb.AttachRequest) -> list[pb.TokenChunk]:
        call, queue = stream.open(**op)
        got: list[pb.TokenChunk] = []
        while not got or not (got[-1].finished or got[-1].HasField("handoff")):
            item = await queue.get()
            assert isinstance(item, pb.TokenChunk), item
            got.append(item)
        stream.leave(call, finished=True)
        return got

    lat = []
    peers = Peers(token)
    streams = ServeStreams(peers)
    try:
        for i in range(n):
            t0 = time.perf_counter()
            req = pb.GenerateRequest(request_id=f"direct-{i}", prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS)
            first = await answers(streams.to(prefill_addr), generate=req)
            handoff = first[-1].handoff
            rest = await answers(streams.to(handoff.decode_address), attach=pb.AttachRequest(request_id=f"direct-{i}"))
            assert sum(len(c.token_ids) for c in first + rest) == MAX_TOKENS
            lat.append(time.perf_counter() - t0)
    finally:
        await streams.close()
        await peers.close()
    return lat


async def through_daemon(url: str, n: int, concurrency: int) -> tuple[list[float], float]:
    """`concurrency` keep-alive HTTP/1.1 connections, each sending requests back to back. A minimal
    client on raw asyncio streams: httpx costs more CPU per request than the daemon itself, and the
    load generator shares the machine's 2 cores with the cluster."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tetri-sim", "prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    lat: list[float] = []
    left = [n]

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while left[0] > 0:
                left[0] -= 1
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                payload = await reader.readexactly(length)
                assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == MAX_TOKENS, payload
                lat.append(time.perf_counter() - t0)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return lat, time.perf_counter() - t0


def table(title: str, cols: list[str], rows: list[list[object]]) -> None:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r])
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=1000.0)
    ap.add_argument("--profile", default="llama3-8b-h100")
    a = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="tetri-bench-"))
    cluster = start_local_cluster(["prefill", "decode"], state_dir=state, profile=a.profile, time_scale=a.time_scale)
    ready = {"url": cluster.url}
    workers = {w["role"]: w for w in cluster.workers}
    try:
        time.sleep(0.5)  # one broadcast so the prefill instance knows the decode instance
        asyncio.run(through_daemon(ready["url"], 100, 8))  # warm-up
        d = asyncio.run(
            direct(workers["prefill"]["address"], a.latency_requests, cluster.env.get("TETRI_WORKER_TOKEN"))
        )
        t, _ = asyncio.run(through_daemon(ready["url"], a.latency_requests, 1))
        d2 = asyncio.run(
            direct(workers["prefill"]["address"], a.latency_requests, cluster.env.get("TETRI_WORKER_TOKEN"))
        )
        d += d2
        ms = 1000.0
        table(
            f"Latency, one request at a time ({len(d)} direct / {len(t)} via daemon; {MAX_TOKENS} output tokens)",
            ["path", "p50 ms", "p90 ms", "p99 ms", "mean ms"],
            [
                [
                    "workers directly (gRPC)",
                    pct(d, 0.5) * ms,
                    pct(d, 0.9) * ms,
                    pct(d, 0.99) * ms,
                    statistics.mean(d) * ms,
                ],
                [
                    "through the daemon (HTTP + status table)",
                    pct(t, 0.5) * ms,
                    pct(t, 0.9) * ms,
                    pct(t, 0.99) * ms,
                    statistics.mean(t) * ms,
                ],
                [
                    "added by the control plane",
                    (pct(t, 0.5) - pct(d, 0.5)) * ms,
                    (pct(t, 0.9) - pct(d, 0.9)) * ms,
                    (pct(t, 0.99) - pct(d, 0.99)) * ms,
                    (statistics.mean(t) - statistics.mean(d)) * ms,
                ],
            ],
        )
        lat, wall = asyncio.run(through_daemon(ready["url"], a.requests, a.concurrency))
        table(
            f"Throughput through the daemon ({a.requests} requests, {a.concurrency} concurrent clients, "
            f"load generator on the same 2 cores)",
            ["requests/s", "p50 ms", "p99 ms"],
            [[a.requests / wall, pct(lat, 0.5) * ms, pct(lat, 0.99) * ms]],
        )
        with httpx.Client(base_url=ready["url"]) as h:
            time.sleep(0.3)
            counts = h.get("/api/v1/cluster").json()["requests_by_status"]
        console.print(f"status table: {counts}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
