"""What relaying a token costs, each process beside its floor, in one run: the control plane against a raw
socket server doing no work, and the vLLM worker process against plain vLLM's API-server process.

    python bench/relay_cost.py [--step-ms 15] [--concurrency 48] [--requests 300] [--fronts 2]
        [--vllm-requests 24] [--no-vllm]

CPU per request (a) and per output token (b) of each process, solved from two batches (8- and 128-token
outputs), as bench/transport_floor.py and bench/control_plane_cost.py do (those two hold the code run here).
Rows, in order:
  * floor: bench/transport_floor.py's raw-socket server (an asyncio Protocol on uvloop answering one SSE
    event per token, no HTTP library) and its raw-asgi server (a bare ASGI app under uvicorn), events
    `--step-ms` apart, `--concurrency` streams at a time;
  * Tetri's control plane, a sim colocated worker behind it whose steps are `--step-ms` apart (its time
    scale is set so: the sim's step at that batch, `tetri.costmodel`), the same requests: one daemon
    process (front and controller together); then a controller and one front, each its own row; then a
    controller and `--fronts` fronts (reported: on 2 shared cores it is not a target);
  * the ratios to the raw-socket floor (targets: ≤ 1.25× per token, ≤ 2× per request);
  * without --no-vllm: the vLLM worker process (vLLM's CPU build, a tiny random Llama; engine core excluded)
    beside plain vLLM's API-server process (`python -m vllm.entrypoints.openai.api_server`, the same engine
    options), at 1 stream (sequential requests) and at `--concurrency` streams (all at once), and their ratio
    (target ≤ 0.5×). Per process: its own CPU, without its children (the engine core), less its idle rate
    (measured for 3 s before the batches) over each batch's wall time, as for the control plane. Beside
    them, the same engine driven in a process of its own with no gRPC (bench/vllm_engine_alone.py): what
    reading vLLM's engine core costs before any transport, so the worker's row less this one is its gRPC
    stream and its feed; and gRPC's own floor at the worker's measured step spacing (bench/grpc_floor.py: a
    grpc.aio server answering one stream with a message a step, carrying a token of each call, beside the
    same process waking at those steps with nothing to send).

The measured step spacing is printed beside each row: (the long batch's wall time × concurrency) / tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import control_plane_cost as cpc
import transport_floor as floor
import vllm_serving_bench as vsb

from tetri.costmodel import CostModel, load_profile

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
ALONE = "Tetri's vLLM engine alone, no gRPC (vllm_engine_alone.py)"
GRPC = "floor: grpc.aio stream, a message a step (grpc_floor.py)"
WAKE = "floor: the same process's wake alone, no gRPC"
PROFILE = "llama3-8b-h100"
IDLE_S = 3.0


def floor_rows(kind: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(µs per request, µs per token, measured step ms) of one floor server."""
    with floor.http_server(kind, args.step_ms) as (url, pid):
        asyncio.run(floor.http_batch(url, 50, floor.SHORT, args.concurrency))  # warm-up
        per, walls = [], []
        for tokens in (floor.SHORT, floor.LONG):
            s0, t0 = floor.cpu_seconds(pid), time.perf_counter()
            asyncio.run(floor.http_batch(url, args.requests, tokens, args.concurrency))
            walls.append(time.perf_counter() - t0)
            per.append((floor.cpu_seconds(pid) - s0) / args.requests)
    a, b = floor.fit(*per)
    return a * 1e6, b * 1e6, walls[1] * args.concurrency / (args.requests * floor.LONG) * 1e3


def sim_time_scale(args: argparse.Namespace) -> float:
    """The sim's time scale that puts its decode steps `--step-ms` apart at `--concurrency` streams."""
    model = CostModel(load_profile(PROFILE))
    step = model.decode_step_time(args.concurrency, args.concurrency * (64 + floor.LONG // 2))
    return step / (args.step_ms / 1e3)


def tetri_rows(fronts: int, args: argparse.Namespace) -> tuple[dict[str, tuple[float, float]], float]:
    """Each control-plane process kind's (µs per request, µs per token), summed over its processes, with
    the control plane's whole; and the measured step ms."""
    ns = cpc._parser().parse_args([])
    ns.requests, ns.concurrency, ns.prompt = args.requests, args.concurrency, 64
    ns.short, ns.long, ns.profile, ns.time_scale = floor.SHORT, floor.LONG, PROFILE, sim_time_scale(args)
    pids, _, short, long, _ = cpc.run_mode("colocated", "uvloop", fronts, 1, "cache-aware", ns)
    plane = [k for k in pids if k in cpc.CONTROL_PLANE]
    rows = {k: cpc.fit(short, long, [k]) for k in plane if k != "supervisor" and len(plane) > 1}
    rows["control plane"] = cpc.fit(short, long, plane)  # one daemon: its own row
    out = {k: (a * 1e6, b * 1e6) for k, (a, b) in rows.items()}
    return out, long.wall * args.concurrency / long.tokens * 1e3


def vllm_rows(args: argparse.Namespace) -> dict[tuple[str, int], tuple[float, float]]:
    """(system process, streams) → (µs per request, µs per token) of plain vLLM's API server and Tetri's
    colocated vLLM worker, at 1 stream and at `--concurrency`."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    root = Path(tempfile.mkdtemp(prefix="tetri-relay-cost-"))
    model = root / "tiny-llama"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True,
                   capture_output=True, cwd=ROOT)  # fmt: skip
    out: dict[tuple[str, int], tuple[float, float]] = {}
    n = args.vllm_requests
    spacing: dict[int, float] = {}  # streams → the worker's step spacing (s), its long batch's wall / tokens a stream
    try:
        for system in ("vllm", "colocated"):
            start = vsb.vllm_server(model, root) if system == "vllm" else vsb.tetri(system, model, root)
            print(f"{vsb.LABEL[system]}: starting", file=sys.stderr, flush=True)
            with start as (url, pids):
                asyncio.run(vsb.run_pattern(url, vsb.probe(4, args.seed + 1, 16), None, pids))  # warm-up
                before = {k: vsb.own_cpu(p) for k, p in pids.items()}
                time.sleep(IDLE_S)  # the idle rate (load reports, health checks), taken off each batch
                idle = {k: (vsb.own_cpu(p) - before[k]) / IDLE_S for k, p in pids.items()}
                for streams in (1, args.concurrency):
                    per: list[dict[str, float]] = []
                    for tokens in (floor.SHORT, floor.LONG):
                        reqs = vsb.probe(n if streams == 1 else streams, args.seed, tokens)
                        times = None if streams == 1 else [0.0] * len(reqs)
                        t0 = time.perf_counter()
                        got, cpu = asyncio.run(vsb.run_pattern(url, reqs, times, pids))
                        wall = time.perf_counter() - t0
                        bad = [r.error for r in got if r.error]
                        if bad:
                            raise RuntimeError(f"{system}: {len(bad)} requests failed: {bad[0]}")
                        per.append({k: (v - idle[k] * wall) / len(reqs) for k, v in cpu.items()})
                        if system == "colocated" and tokens == floor.LONG:
                            spacing[streams] = wall / (tokens * (n if streams == 1 else 1))
                    for proc in per[0]:
                        a, b = floor.fit(per[0][proc], per[1][proc])
                        out[(f"{vsb.LABEL[system]}: {proc}", streams)] = (a * 1e6, b * 1e6)
        print(f"{ALONE}: starting", file=sys.stderr, flush=True)
        alone = subprocess.run(
            [sys.executable, str(HERE / "vllm_engine_alone.py"), str(model), "--requests", str(n),
             "--concurrency", str(args.concurrency), "--seed", str(args.seed)],
            check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        for streams, (a, b) in json.loads(alone.stdout.strip().splitlines()[-1]).items():
            out[(ALONE, int(streams))] = (a, b)
        for streams, step in spacing.items():  # gRPC's own floor at the worker's spacing: a message a step
            print(f"{GRPC}: {streams} call(s), steps {step * 1e3:.1f} ms apart", file=sys.stderr, flush=True)
            cmd = [sys.executable, str(HERE / "grpc_floor.py"), "--json", "--calls", str(streams)]
            cmd += ["--step-ms", f"{step * 1e3:.3f}", "--steps", str(max(300, int(3 / step)))]
            floor_run = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            got = json.loads(floor_run.stdout.strip().splitlines()[-1])
            out[(GRPC, streams)] = (math.nan, got["grpc"] / streams)
            out[(WAKE, streams)] = (math.nan, got["wake"] / streams)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=15.0, help="engine step spacing (floor timer; sim steps)")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--requests", type=int, default=300, help="requests per batch (floor, control plane)")
    ap.add_argument("--fronts", type=int, default=2, help="the last control-plane row's fronts (0: skip it)")
    ap.add_argument("--vllm-requests", type=int, default=24, help="requests per batch at 1 stream (vLLM rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows (no vLLM installed)")
    args = ap.parse_args()

    t = Table(
        title=f"Relay cost: CPU per request and per output token, {args.requests} requests × {floor.SHORT} and "
        f"× {floor.LONG} tokens, {args.concurrency} streams, steps {args.step_ms:g} ms apart",
        title_justify="left",
    )
    for c in ("what", "process", "µs / request", "µs / token", "× floor / req", "× floor / token", "step ms"):
        t.add_column(c, justify="left" if c in ("what", "process") else "right")
    raw = floor_rows("raw-socket", args)
    asgi = floor_rows("raw-asgi", args)

    def row(what: str, proc: str, a: float, b: float, step: float | None = None, mark: bool = False) -> None:
        ra, rb = a / raw[0], b / raw[1]
        ok = (lambda r, lim: f"[{'green' if r <= lim else 'red'}]{r:.2f}×[/]") if mark else (lambda r, lim: f"{r:.2f}×")
        t.add_row(what, proc, f"{a:,.0f}", f"{b:.1f}", ok(ra, 2.0), ok(rb, 1.25), f"{step:.1f}" if step else "")

    row("floor", "raw socket", raw[0], raw[1], raw[2])
    row("floor", "bare ASGI (uvicorn)", *asgi)
    t.add_section()
    setups = [(0, "one daemon"), (1, "controller + 1 front")]
    setups += [(args.fronts, f"controller + {args.fronts} fronts")] if args.fronts > 1 else []
    for fronts, label in setups:
        rows, step = tetri_rows(fronts, args)
        for k, (a, b) in rows.items():
            whole = k == "control plane"
            row(f"Tetri, {label}", f"[b]{k}[/b]" if whole else k, a, b, step if whole else None, whole and fronts <= 1)
        t.add_section()
    Console(width=170).print(t)
    if not args.no_vllm:
        v = vllm_rows(args)
        w = Table(
            title="vLLM's CPU build, a tiny random Llama: each process's own CPU (its engine core excluded)",
            title_justify="left",
        )
        for c in ("streams", "process", "µs / request", "µs / token", "× API server / token"):
            w.add_column(c, justify="left" if c == "process" else "right")
        for streams in (1, args.concurrency):
            base = v[(f"{vsb.LABEL['vllm']}: API server", streams)][1]
            for (proc, s), (a, b) in v.items():
                if s == streams:
                    if proc.startswith(vsb.LABEL["colocated"]):  # Tetri's processes: the target's rows
                        ratio = f"[{'green' if b / base <= 0.5 else 'red'}]{b / base:.2f}×[/]"
                    else:  # the floors beside them, uncoloured; plain vLLM's own row is the base
                        ratio = f"{b / base:.2f}×" if proc in (ALONE, GRPC, WAKE) else ""
                    w.add_row(str(streams), proc, "" if math.isnan(a) else f"{a:,.0f}", f"{b:.1f}", ratio)
            w.add_section()
        Console(width=170).print(w)
    print("targets: control plane ≤ 1.25× the raw-socket floor per token and ≤ 2× per request; the vLLM worker "
          "process ≤ 0.5× plain vLLM's API server per token, at 1 stream and at", args.concurrency)  # fmt: skip


if __name__ == "__main__":
    main()
