"""The control plane at 16, 64 and 256 instances on this machine: the daemon's CPU idle and per request,
its time per load report and per routing decision.

    python bench/scale_bench.py [--sizes 16,64,256] [--per-process 32] [--idle-s 10] [--rate 100]
        [--load-s 10] [--time-scale 100] [--pin] [--json]

For each size a daemon and sim workers start on loopback; the workers host `--per-process` instances
each (`workers.main --instances`, one event loop, each instance its own gRPC port, registration and
100 ms load reports), a quarter of them prefill and the rest decode. Once all registered:

- idle: the daemon's CPU (utime + stime from /proc/<pid>/stat) over `--idle-s`, in cores;
- load: `--rate` requests per second (8 output tokens) for `--load-s`, from one client in this process;
  control overhead per request = (the daemon's CPU over the load phase − the idle rate × its wall time)
  / requests served;
- the daemon's own histograms (/metrics), over the load phase: `tetri_report_seconds` (one load report
  and the broadcast it is answered with), `tetri_broadcast_delay_seconds` (from a decode instance's new
  load to the first broadcast showing it) and `tetri_route_seconds` (choosing a request's entry
  instance), mean and p99; `tetri_loop_lag_seconds` (how late its event loop wakes a 50 ms timer: what a
  relayed token waits behind the reports), p99 idle, mean and p99 under load.

The sim engines run `--time-scale` times faster than the wall, so what is measured is the control
plane. Everything shares this machine's 2 cores: the workers' processes compete with the daemon, so
wall-time figures (report, routing, loop lag) include waiting for a core; the CPU figures do not. With
`--pin` the daemon runs alone on the first core (the workers and the client on the others), as it would
on a control-plane host of its own: its wall-time figures are then its own.
Targets (issue 16): at 256 instances the daemon idles under 0.5 core, and its overhead per request is
within 1.5x of that at 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tetrictl.output import table
from tetrictl.procs import spawn, stop_all, wait_ready
from tetrictl.tui.model import quantile


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Hist = tuple[list[float], list[int], float]  # bucket bounds, per-bucket counts (last: above all), sum


def scrape(url: str) -> dict[str, Hist]:
    """The daemon's histograms, from /metrics."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if fam.type == "histogram":
            cumulative = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")]
            total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
            previous = [0.0] + [n for _, n in cumulative[:-1]]
            counts = [int(n - prev) for (_, n), prev in zip(cumulative, previous, strict=True)]
            out[fam.name] = ([le for le, _ in cumulative if le != float("inf")], counts, total)
    return out


def window(before: Hist, after: Hist) -> tuple[int, float, float]:
    """(count, mean, p99) of what a histogram saw between two scrapes (p99 as the dashboard and
    Prometheus take it)."""
    counts = [b - a for a, b in zip(before[1], after[1], strict=True)]
    n, total = sum(counts), after[2] - before[2]
    p99 = quantile(0.99, after[0], counts)
    return n, (total / n if n else float("nan")), float("nan") if p99 is None else p99


async def drive(url: str, rate: float, seconds: float) -> int:
    """Requests at a steady rate; how many were served."""
    served = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:

        async def one(k: int) -> None:
            nonlocal served
            body = {"model": "tetri-sim", "prompt": [5 + k % 50, 6, 7], "max_tokens": 8}
            r = await h.post("/v1/completions", json=body)
            served += r.status_code == 200

        tasks, start, k = [], time.monotonic(), 0
        while time.monotonic() - start < seconds:
            tasks.append(asyncio.create_task(one(k)))
            k += 1
            await asyncio.sleep(max(0.0, start + k / rate - time.monotonic()))
        await asyncio.gather(*tasks)
    return served


def run_size(n: int, args: argparse.Namespace) -> dict[str, float]:
    state = Path(tempfile.mkdtemp(prefix="tetri-scale-"))
    daemon = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(state), "--time-scale",
                                   str(args.time_scale)])  # fmt: skip
    procs: list[subprocess.Popen[str]] = [daemon]
    cores = sorted(os.sched_getaffinity(0))
    if args.pin:  # the daemon on a core of its own, as on a control-plane host; the rest on the others
        os.sched_setaffinity(daemon.pid, cores[:1])
        os.sched_setaffinity(0, cores[1:])  # this process, and the workers it starts from now on
    try:
        ready = wait_ready(daemon, "daemon")
        url = ready["url"]
        prefill = max(1, n // 4)
        groups = []
        for role, count in (("prefill", prefill), ("decode", n - prefill)):
            while count > 0:
                k = min(args.per_process, count)
                groups.append((role, k))
                count -= k
        for i, (role, k) in enumerate(groups):  # stdout to a file: k ready lines (a pipe's reader buffers them)
            out = (state / f"worker{i}.out").open("w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "workers.main", "--role", role, "--daemon", ready["grpc"], "--instances", str(k),
                 "--profile", "tiny", "--time-scale", str(args.time_scale)],
                stdout=out, text=True, process_group=0,
            ))  # fmt: skip
            out.close()
        deadline = time.monotonic() + 180
        for i, (_, k) in enumerate(groups):
            while (state / f"worker{i}.out").read_text().count('"event": "ready"') < k:
                assert time.monotonic() < deadline and procs[i + 1].poll() is None, f"worker process {i} not ready"
                time.sleep(0.2)
        deadline = time.monotonic() + 60
        while sum(v["active"] for v in httpx.get(f"{url}/api/v1/cluster").json()["instances"].values()) < n:
            assert time.monotonic() < deadline, "not every instance became active"
            time.sleep(0.2)
        time.sleep(2)  # settle: every link reporting
        h0 = scrape(url)
        c0, t0 = cpu_seconds(daemon.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle = (cpu_seconds(daemon.pid) - c0) / (time.monotonic() - t0)
        h1 = scrape(url)
        c1, t1 = cpu_seconds(daemon.pid), time.monotonic()
        served = asyncio.run(drive(url, args.rate, args.load_s))
        busy, wall = cpu_seconds(daemon.pid) - c1, time.monotonic() - t1
        h2 = scrape(url)
        report = window(h1["tetri_report_seconds"], h2["tetri_report_seconds"])
        route = window(h1["tetri_route_seconds"], h2["tetri_route_seconds"])
        delay = window(h1["tetri_broadcast_delay_seconds"], h2["tetri_broadcast_delay_seconds"])
        lag_idle = window(h0["tetri_loop_lag_seconds"], h1["tetri_loop_lag_seconds"])
        lag_load = window(h1["tetri_loop_lag_seconds"], h2["tetri_loop_lag_seconds"])
        return {
            "instances": n,
            "processes": len(groups),
            "idle_cores": idle,
            "reports_per_s": report[0] / wall,
            "report_mean_us": report[1] * 1e6,
            "report_p99_us": report[2] * 1e6,
            "broadcast_delay_mean_ms": delay[1] * 1e3,
            "broadcast_delay_p99_ms": delay[2] * 1e3,
            "route_mean_us": route[1] * 1e6,
            "route_p99_us": route[2] * 1e6,
            "lag_idle_p99_ms": lag_idle[2] * 1e3,
            "lag_load_mean_ms": lag_load[1] * 1e3,
            "lag_load_p99_ms": lag_load[2] * 1e3,
            "served": served,
            "overhead_ms_per_request": (busy - idle * wall) / max(served, 1) * 1e3,
        }
    finally:
        stop_all(procs)
        os.sched_setaffinity(0, cores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--per-process", type=int, default=32)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--time-scale", type=float, default=100.0)
    ap.add_argument("--pin", action="store_true", help="the daemon alone on the first core, the rest on the others")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        r = run_size(n, args)
        rows.append(r)
        print(f"{n} instances: {r}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
        return
    base = rows[0]["overhead_ms_per_request"]
    table(
        f"the daemon at each size ({'its own core' if args.pin else 'all cores shared with the workers'}; "
        f"{args.rate:g} req/s)",
        ["instances", "worker procs", "idle CPU (cores)", "reports/s", "report mean µs", "report p99 µs",
         "to broadcast mean/p99 ms", "route mean µs", "route p99 µs", "lag p99 ms idle", "lag mean/p99 ms",
         "served",
         "overhead ms/req", f"vs {rows[0]['instances']}"],
        [[r["instances"], r["processes"], f"{r['idle_cores']:.3f}", f"{r['reports_per_s']:.0f}",
          f"{r['report_mean_us']:.0f}", f"{r['report_p99_us']:.0f}",
          f"{r['broadcast_delay_mean_ms']:.0f}/{r['broadcast_delay_p99_ms']:.0f}", f"{r['route_mean_us']:.1f}",
          f"{r['route_p99_us']:.1f}", f"{r['lag_idle_p99_ms']:.1f}",
          f"{r['lag_load_mean_ms']:.2f} / {r['lag_load_p99_ms']:.1f}", r["served"],
          f"{r['overhead_ms_per_request']:.2f}",
          f"{r['overhead_ms_per_request'] / base:.2f}x"] for r in rows],
    )  # fmt: skip


if __name__ == "__main__":
    main()
