"""Tetri's control-plane CPU cost per request and per output token, without an engine.

    python bench/control_plane_cost.py [--requests 300] [--short 8] [--long 128] [--concurrency 48]
        [--prompt 64] [--modes colocated,disaggregated] [--event-loops uvloop]
        [--profile llama3-8b-h100] [--time-scale 1] [--fronts 0] [--pin-fronts] [--stream-intervals 1]

For each mode a daemon and sim workers start on loopback (`tetrictl.procs.start_local_cluster`):
colocated = one colocated worker, disaggregated = one prefill + one decode worker. By default the sim
engine runs Llama-3-8B on an H100 in real time (`--time-scale 1`), so its tokens arrive one engine step
apart, as a GPU's do: every step's tokens cross the control plane as their own messages and SSE events.
What is measured is the control plane: HTTP + SSE in the daemon, gRPC between daemon and workers (and
between the prefill and decode workers), the status-table writes, the workers' scheduling and token
streaming. (`--time-scale 1e6` makes the simulated compute take no wall time: the sim then delivers
several tokens per chunk, which a GPU does not; the table shows tokens per SSE chunk.)

Two batches of `--requests` streamed requests each (prompt `--prompt` token ids, `--short` and `--long`
output tokens), `--concurrency` at a time, from one httpx client in this process. The CPU seconds of the
daemon and of each worker (utime + stime from /proc/<pid>/stat, all threads, plus reaped children) are
read before and after each batch; the idle rate (load reports, broadcasts; measured for `--idle-s` before
the batches) times each batch's wall time is subtracted, and cost = a × requests + b × tokens is solved
from the two batches: a = CPU per request, b = CPU per output token. The client's own CPU is not counted
(it shares the two cores, so it slows the wall clock, not the CPU seconds measured).

`--event-loops asyncio,uvloop` runs every mode on each loop (TETRI_EVENT_LOOP, tetri/eventloop.py), one
after the other in this run, so the two can be compared side by side. `--routings cache-aware,least-load`
(the default) runs each with each routing policy: the prefix-cache index's cost is cache-aware's less
least-load's (the sim engines report their caches either way; only cache-aware routing reads the index
for a request). The `route µs` column is the daemon's own mean time choosing a request's entry instance
(`tetri_route_seconds`: the index walk included), read from its /metrics (with `--fronts`: not shown).
Every request sends the same prompt, so every block of it is in the index: the walk goes its whole length
(`--prompt 2048` shows how the cost grows with it).

Targets: the control plane (every process that is not a worker: the daemon) at most 300 µs per request
and 10 µs per token; the workers' per-token cost not growing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from tetri import eventloop
from tetrictl.client import SseStream
from tetrictl.procs import LocalCluster, start_local_cluster

TICK = os.sysconf("SC_CLK_TCK")
CONTROL_PLANE = ("daemon", "front", "controller", "supervisor")  # every process that is not a worker


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime (+ reaped children's) of processes, all threads, in seconds."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime (fields 14–17)
    return total / TICK


@dataclass
class Batch:
    requests: int
    tokens: int
    chunks: int
    wall: float
    cpu: dict[str, float]  # process name -> CPU seconds, idle rate already subtracted


def route_seconds(url: str) -> tuple[float, float]:
    """The daemon's tetri_route_seconds sum and count (its /metrics)."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tetri_route_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("tetri_route_seconds_count"):
            count = float(line.split()[-1])
    return total, count


async def send(url: str, n: int, prompt: int, max_tokens: int, concurrency: int) -> tuple[int, int]:
    """`n` streamed completions, `concurrency` at a time; (output tokens, SSE token chunks) in all."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1, prompt + 1)), "max_tokens": max_tokens, "stream": True}
        body["return_token_ids"] = True  # tokens counted from the ids (text is rendered as usual)
        left, tokens, chunks = [n], [0], [0]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for msg in SseStream(resp):
                        if "error" in msg:
                            raise RuntimeError(msg["error"])
                        n = sum(len(c.get("token_ids") or []) for c in msg.get("choices", []))
                        tokens[0] += n
                        chunks[0] += n > 0

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens[0], chunks[0]


Pids = dict[str, list[int]]  # process kind -> its processes


def measure(url: str, pids: Pids, idle: dict[str, float], n: int, prompt: int, out: int, conc: int) -> Batch:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    tokens, chunks = asyncio.run(send(url, n, prompt, out, conc))
    wall = time.perf_counter() - t0
    cpu = {k: cpu_seconds(p) - before[k] - idle[k] * wall for k, p in pids.items()}
    return Batch(n, tokens, chunks, wall, cpu)


def fit(short: Batch, long: Batch, names: list[str]) -> tuple[float, float]:
    """Solve cpu = a × requests + b × tokens over the two batches (for the summed CPU of `names`)."""
    m = np.array([[short.requests, short.tokens], [long.requests, long.tokens]], dtype=float)
    c = np.array([sum(short.cpu[k] for k in names), sum(long.cpu[k] for k in names)])
    a, b = np.linalg.solve(m, c)
    return float(a), float(b)


def control_plane_pids(cluster: LocalCluster) -> dict[str, list[int]]:
    """The control plane's processes by kind: the daemon; or the controller, the fronts and their
    supervisor (`--fronts N`)."""
    ready = cluster.ready
    if "fronts" not in ready:
        return {"daemon": [cluster.procs[0].pid]}
    return {
        "front": [int(f["pid"]) for f in ready["fronts"]],
        "controller": [int(ready["controller"]["pid"])],
        "supervisor": [cluster.procs[0].pid],
    }


def pin(pids: list[int], cores: list[int]) -> None:
    """Each process on one core of `cores`, in turn (all its threads)."""
    for k, pid in enumerate(pids):
        core = cores[k % len(cores)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core})


def run_mode(
    mode: str, loop: str, fronts: int, interval: int, routing: str, args: argparse.Namespace
) -> tuple[dict[str, list[int]], dict[str, float], Batch, Batch, float | None]:
    roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
    state = Path(tempfile.mkdtemp(prefix=f"tetri-cpcost-{mode}-"))
    os.environ[eventloop.ENV] = loop  # the daemon and workers inherit it
    cluster = start_local_cluster(
        roles,
        state_dir=state,
        profile=args.profile,
        time_scale=args.time_scale,
        mode=mode,
        fronts=fronts,
        stream_interval=interval,
    )
    try:
        pids = control_plane_pids(cluster) | {w["role"]: [int(w["pid"])] for w in cluster.workers}
        if fronts and args.pin_fronts:
            pin(pids["front"], list(range(os.cpu_count() or 1)))
        httpx.put(f"{cluster.url}/api/v1/policies", json={"routing": routing}, timeout=10).raise_for_status()
        time.sleep(0.5)  # one load broadcast: the prefill worker knows the decode worker
        asyncio.run(send(cluster.url, args.warmup, args.prompt, args.long, args.concurrency))
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        time.sleep(args.idle_s)
        idle = {k: (cpu_seconds(p) - before[k]) / args.idle_s for k, p in pids.items()}
        routed = route_seconds(cluster.url) if not fronts else None
        short = measure(cluster.url, pids, idle, args.requests, args.prompt, args.short, args.concurrency)
        long = measure(cluster.url, pids, idle, args.requests, args.prompt, args.long, args.concurrency)
        route = None
        if routed is not None:
            after = route_seconds(cluster.url)
            route = (after[0] - routed[0]) / max(1.0, after[1] - routed[1])
        return pids, idle, short, long, route
    finally:
        cluster.stop(drain_s=10)


def _setup(loop: str, fronts: int, interval: int) -> str:
    parts = [loop] + ([f"{fronts} front{'s' * (fronts != 1)}"] if fronts else [])
    return ", ".join(parts + ([f"interval {interval}"] if interval > 1 else []))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per batch")
    ap.add_argument("--short", type=int, default=8, help="output tokens of the first batch")
    ap.add_argument("--long", type=int, default=128, help="output tokens of the second batch")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--event-loops", default="uvloop", help="comma-separated: uvloop, asyncio (each mode on each)")
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument(
        "--fronts",
        default="0",
        help="comma-separated: 0 runs one daemon process, N a controller and N fronts (each mode with each)",
    )
    ap.add_argument("--pin-fronts", action="store_true", help="pin each front to its own core (round robin)")
    ap.add_argument(
        "--routings",
        default="cache-aware,least-load",
        help="comma-separated routing policies (each mode with each): cache-aware reads the prefix-cache index",
    )
    ap.add_argument(
        "--stream-intervals",
        default="1",
        help="comma-separated: the daemon's --stream-interval, an SSE event per N tokens (each mode with each)",
    )
    return ap


def _rows(
    t: Table,
    args: argparse.Namespace,
    run: tuple[str, str, int, int, str],
    pids: dict[str, list[int]],
    idle: dict[str, float],
    short: Batch,
    long: Batch,
    route: float | None,
) -> float | None:
    """One run's rows (each process, the control plane, the workers, the total); the control plane's CPU
    per request."""
    mode, loop, nf, interval, routing = run
    plane_a = None
    plane = [k for k in pids if k in CONTROL_PLANE]
    workers = [k for k in pids if k not in CONTROL_PLANE]
    groups = [[k] for k in pids] + [plane, workers, list(pids)]
    labels = [*pids, "control plane", "workers", "total"]
    first = True
    for names, label in zip(groups, labels, strict=True):
        if len(names) == 1 and label in ("workers", "control plane"):
            continue  # one process: already on its own row
        a, b = fit(short, long, names)
        total = label == "total"
        ok = a <= 300e-6 and b <= 10e-6
        name = f"{label} ×{len(pids[label])}" if label in pids and len(pids[label]) > 1 else label
        row = [
            mode if first else "",
            f"{_setup(loop, nf, interval)}, {routing}" if first else "",
            f"[b]{name}[/b]" if total else name,
            f"{a * 1e6:,.0f}",
            f"{b * 1e6:,.1f}",
            f"{(a + b * args.short) * 1e3:.2f}",
            f"{(a + b * args.long) * 1e3:.2f}",
            f"{sum(idle[k] for k in names) * 100:.1f}",
            f"{short.requests / short.wall:,.0f}" if total else "",
            f"{long.requests / long.wall:,.0f}" if total else "",
            f"{short.tokens / max(1, short.chunks):.2f} / {long.tokens / max(1, long.chunks):.2f}" if total else "",
            f"{route * 1e6:.1f}" if total and route is not None else "",
        ]
        if names == plane:
            plane_a = a
            row[2] += " [green](meets target)[/green]" if ok else " [red](misses target)[/red]"
        t.add_row(*row)
        first = False
    return plane_a


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    t = Table(
        title=f"Control-plane CPU, sim engine at time scale {args.time_scale:g}: {args.requests} requests × "
        f"{args.short} and × {args.long} output tokens, prompt {args.prompt}, concurrency {args.concurrency}",
        title_justify="left",
    )
    cols = [
        "mode",
        "setup",
        "process",
        "µs / request",
        "µs / token",
        f"ms / {args.short}-tok req",
        f"ms / {args.long}-tok req",
    ]
    cols += ["idle CPU %", "req/s short", "req/s long", "tokens / SSE chunk", "route µs"]
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i < 3 else "right")
    loops = [x.strip() for x in args.event_loops.split(",") if x.strip()]
    bad = [x for x in loops if x not in eventloop.CHOICES]
    if bad or not loops:
        ap.error(f"--event-loops: {', '.join(bad) or 'none given'}: expected {', '.join(eventloop.CHOICES)}")
    fronts = [int(x) for x in args.fronts.split(",") if x.strip()]
    intervals = [int(x) for x in args.stream_intervals.split(",") if x.strip()]
    if not intervals or min(intervals) < 1:
        ap.error("--stream-intervals: each at least 1")
    routings = [x.strip() for x in args.routings.split(",") if x.strip()]
    runs = [
        (m, lp, f, i, r)
        for m in args.modes.split(",")
        if m
        for lp in loops
        for f in fronts
        for i in intervals
        for r in routings
    ]
    per_request: dict[tuple[str, str, int, int, str], float] = {}
    for mode, loop, nf, interval, routing in runs:
        pids, idle, short, long, route = run_mode(mode, loop, nf, interval, routing, args)
        a = _rows(t, args, (mode, loop, nf, interval, routing), pids, idle, short, long, route)
        if a is not None:
            per_request[(mode, loop, nf, interval, routing)] = a
        t.add_section()
    Console(width=170).print(t)
    print("target: the control plane (every process that is not a worker) ≤ 300 µs per request and ≤ 10 µs per token")
    for (mode, loop, nf, interval, routing), a in per_request.items():
        base = per_request.get((mode, loop, nf, interval, "least-load"))
        if routing != "least-load" and base:
            setup = f"{mode}, {_setup(loop, nf, interval)}"
            print(f"{setup}: {routing} / least-load, control-plane CPU per request = {a / base:.2f}")


if __name__ == "__main__":
    main()
