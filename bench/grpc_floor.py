"""The floor of the worker's transport: a grpc.aio server doing no work but answer one stream with one
message per engine step, as the worker's Serve stream does (a `ServeDown` carrying each call's new token),
beside the same server process waking at the same steps and sending nothing.

    python bench/grpc_floor.py [--step-ms 3] [--steps 1000] [--calls 1] [--rounds 2]

The server runs in a process of its own (uvloop, as the worker); its CPU (utime + stime, all threads) over
the stream, less its idle rate, is divided by the steps: µs a step, and a token (a step carries `--calls`
tokens, one per call). "wake alone" is the same process sleeping the same steps with no gRPC: the part of
a step any process woken by the engine pays. What gRPC adds is the difference. bench/relay_cost.py runs it
beside the vLLM worker at its measured step spacing (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import transport_floor as floor

from tetri.proto import tetri_pb2 as pb

IDLE_S = 2.0


async def _serve(port: int, step: float, steps: int, calls: int, grpc_on: bool) -> None:
    def down() -> pb.ServeDown:  # each call's one new token, as `workers.service._down` builds it
        return pb.ServeDown(token_calls=range(calls), token_counts=[1] * calls, tokens=range(calls))

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(steps):
            await asyncio.sleep(step)
            yield down()

    if not grpc_on:  # the wake alone: the same steps, nothing sent
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range(steps):
            await asyncio.sleep(step)
        print("done", flush=True)
        sys.stdin.readline()
        return
    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=bytes, response_serializer=pb.ServeDown.SerializeToString
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _read(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream("/floor.Floor/Stream", request_serializer=bytes, response_deserializer=bytes)(b"")
        return sum([1 async for _ in call])


def measure(step: float, steps: int, calls: int, grpc_on: bool) -> float:
    """The server's CPU seconds a step, idle rate off."""
    port = floor.free_port()
    args = [sys.executable, __file__, "--serve", str(port), "--step-ms", str(step * 1e3), "--steps", str(steps)]
    args += ["--calls", str(calls)] + ([] if grpc_on else ["--no-grpc"])
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        c0 = floor.cpu_seconds(proc.pid)
        time.sleep(IDLE_S)
        idle = (floor.cpu_seconds(proc.pid) - c0) / IDLE_S
        c0, t0 = floor.cpu_seconds(proc.pid), time.perf_counter()
        if grpc_on:
            got = asyncio.run(_read(port))
            if got != steps:
                raise RuntimeError(f"{got} messages of {steps}")
        else:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
        wall = time.perf_counter() - t0
        return (floor.cpu_seconds(proc.pid) - c0 - idle * wall) / steps
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=3.0, help="engine step spacing")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=1, help="calls on the stream: tokens a message")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds, averaged")
    ap.add_argument("--json", action="store_true", help="one JSON line: µs a step, gRPC and the wake alone")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-grpc", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve is not None:
        import uvloop

        uvloop.run(_serve(a.serve, a.step_ms / 1e3, a.steps, a.calls, not a.no_grpc))
        return
    runs: dict[str, list[float]] = {"grpc": [], "wake": []}
    for _ in range(a.rounds):
        runs["grpc"].append(measure(a.step_ms / 1e3, a.steps, a.calls, True))
        runs["wake"].append(measure(a.step_ms / 1e3, a.steps, a.calls, False))
    got = {k: sum(v) / len(v) * 1e6 for k, v in runs.items()}
    if a.json:
        print(json.dumps(got))
        return
    print(
        f"grpc.aio stream, one message per step {a.step_ms:g} ms apart, {a.calls} token(s) a message, {a.steps} steps:"
    )
    print(f"  server process: {got['grpc']:.1f} µs a step, {got['grpc'] / a.calls:.1f} µs a token")
    print(f"  the wake alone: {got['wake']:.1f} µs a step; gRPC adds {got['grpc'] - got['wake']:.1f} µs a message")


if __name__ == "__main__":
    main()
