"""Colocated vs disaggregated vLLM on the CPU, one run, with the sim engine's prediction beside each.

A tiny random-weight Llama (written here), one small mixed workload (half short, half long prompts;
half short, half longer answers; Poisson arrivals), replayed through the OpenAI API on
  * vLLM colocated: the daemon in colocated mode, one vLLM worker doing both phases (the vanilla baseline);
  * vLLM disaggregated: one prefill and one decode vLLM worker, KV handed over by HostKVConnector;
and the same requests through the discrete-event simulator with the profile `tetrictl profile` fitted on
this machine (--profiles-file; without one the table has no prediction). TTFT and JCT from the status
table, in seconds.

    tetrictl profile --engine vllm --model /tmp/tiny --block-size 32 -o profiles-cpu.toml
    python bench/vllm_cpu_bench.py --model /tmp/tiny --profiles-file profiles-cpu.toml --engine-cpus 1/0

Both systems run on the same 2 cores: disaggregated means two engines sharing them, not twice the hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from tetri.costmodel import load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.workloads import Request
from tetrictl.procs import spawn, stop_all, wait_ready


def workload(n: int, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    out = []
    for i in range(n):
        prompt = int(rng.integers(16, 65) if rng.random() < 0.5 else rng.integers(256, 513))
        answer = int(rng.integers(8, 33) if rng.random() < 0.5 else rng.integers(64, 161))
        out.append(Request(f"r{i}", float(t[i]), prompt, answer, answer))
    return out


def run_live(
    mode: str, model: Path, root: Path, reqs: list[Request], block: int, max_len: int, engine_cpus: str | None
) -> list[dict]:
    state = Path(tempfile.mkdtemp(dir=root, prefix=f"{mode}-"))
    daemon = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(state), "--mode", mode])
    procs = [daemon]
    try:
        ready = wait_ready(daemon, "daemon")
        roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        common = ["--engine", "vllm", "--model", str(model), "--daemon", ready["grpc"], "--block-size", str(block)]
        common += ["--max-model-len", str(max_len), "--kv-store", str(state / "kv"), "--served-model-name", "tetri-sim"]
        cpus = dict(zip(("prefill", "decode"), engine_cpus.split("/"), strict=True)) if engine_cpus else {}
        for role in roles:
            pin = ["--engine-cpus", cpus[role]] if role in cpus else []
            procs.append(spawn("workers.main", ["--role", role, *common, *pin]))
        for p, role in zip(procs[1:], roles, strict=True):
            wait_ready(p, role, timeout=600)

        async def send() -> None:
            async with httpx.AsyncClient(base_url=ready["url"], timeout=600) as h:
                t0 = time.monotonic()

                async def one(r: Request) -> None:
                    await asyncio.sleep(max(0.0, r.arrival - (time.monotonic() - t0)))
                    body = {
                        "model": "tetri-sim",
                        "prompt": [(7 * int(r.request_id[1:]) + k) % 500 + 1 for k in range(r.prompt_len)],
                        "max_tokens": r.output_len,
                        "tetri": {"request_id": r.request_id},
                    }
                    resp = await h.post("/v1/completions", json=body)
                    resp.raise_for_status()

                await asyncio.gather(*(one(r) for r in reqs))

        asyncio.run(send())
        time.sleep(0.5)
        return httpx.get(f"{ready['url']}/api/v1/requests", params={"limit": 1000}, timeout=30).json()["requests"]
    finally:
        stop_all(procs, grace=15)


def stats(ttft: list[float], jct: list[float]) -> list[str]:
    return [
        f"{np.mean(ttft):.3f}",
        f"{np.percentile(ttft, 99):.3f}",
        f"{np.mean(jct):.3f}",
        f"{np.percentile(jct, 99):.3f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny Llama written here)")
    ap.add_argument("--profiles-file", type=Path, help="profiles file from `tetrictl profile`")
    ap.add_argument("--profile", default="calibrated")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--engine-cpus",
        metavar="P/D",
        help="disaggregated: the cores of the prefill / decode engine (the workers' --engine-cpus), e.g. 1/0 on "
        "2 cores (default: anywhere, with vLLM's own binding)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = Path(tempfile.mkdtemp(prefix="tetri-vllm-bench-"))
    model = args.model
    if model is None:
        model = root / "tiny-llama"
        subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True)
    reqs = workload(args.n, args.rate, args.seed)
    profile = load_profile(args.profile, args.profiles_file) if args.profiles_file else None
    t = Table(title=f"vLLM on this CPU: {args.n} requests at {args.rate:g}/s (seconds)", title_justify="left")
    for c in ("system", "source", "avg TTFT", "p99 TTFT", "avg JCT", "p99 JCT"):
        t.add_column(c, justify="left" if c in ("system", "source") else "right")
    for mode, label in (("colocated", "vLLM colocated"), ("disaggregated", "vLLM 1 prefill + 1 decode")):
        live = run_live(mode, model, root, reqs, args.block_size, args.max_model_len, args.engine_cpus)
        rows = {r["id"]: r for r in live}
        mine = [rows[r.request_id] for r in reqs]
        assert all(r["status"] == "finished" for r in mine), [r["error"] for r in mine if r["status"] != "finished"]
        t.add_row(label, "measured", *stats([r["ttft_ms"] / 1000 for r in mine], [r["jct_ms"] / 1000 for r in mine]))
        if profile is not None:
            cfg = ClusterConfig(
                mode="vanilla" if mode == "colocated" else "tetri",
                profile=profile,
                instances=1 if mode == "colocated" else 2,
                prefill_instances=1,
                chunked=False,  # vLLM's chunked prefill never pads: whole prompts within max_num_batched_tokens
                prefill_batch_tokens=profile.max_batched_tokens,
            )
            res = simulate(reqs, cfg)
            t.add_row("", "sim (fitted profile)", *stats([x.ttft for x in res.requests], [x.jct for x in res.requests]))
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
