"""The vLLM engine as Tetri's worker builds it (`workers.main.build_engine`, the worker's flags in
bench/vllm_serving_bench.py), driven in a process of its own with no gRPC, no daemon link and no client:
what reading vLLM's engine core costs a process before any transport. A row of bench/relay_cost.py,
beside the worker process and plain vLLM's API-server process.

    python bench/vllm_engine_alone.py MODEL_DIR [--requests 24] [--concurrency 48] [--seed 0]

Prints one JSON line, streams → [µs per request, µs per token]: this process's own CPU (the engine core is
a child process), less its idle rate, fitted over 8- and 128-token batches as relay_cost fits the others.
Each request's tokens go to a list (`generate_to`): the worker's `_Feed` and gRPC are what it leaves out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transport_floor as floor
import vllm_serving_bench as vsb

from tetri.config import load_worker_settings
from tetri.sampling import Sampling
from workers.engines.base import EngineRequest
from workers.main import build_engine

IDLE_S = 3.0
GREEDY_PAST_EOS = Sampling(ignore_eos=True)  # as the bench's requests: temperature 0, ignore_eos


async def _batch(engine, reqs: list[tuple[list[int], int]], streams: int, tag: str) -> None:
    """Run `reqs` (prompt, max tokens), `streams` at a time, each one's tokens into a list."""
    pending = [EngineRequest(f"{tag}-{k}", tuple(p), n, sampling=GREEDY_PAST_EOS) for k, (p, n) in enumerate(reqs)]

    async def one(req: EngineRequest) -> None:
        got: list[int] = []
        await engine.generate_to(req, got)
        if len(got) != req.max_tokens:
            raise RuntimeError(f"{req.request_id}: {len(got)} tokens of {req.max_tokens}")

    for k in range(0, len(pending), streams):
        await asyncio.gather(*(one(r) for r in pending[k : k + streams]))


async def measure(model: str, requests: int, concurrency: int, seed: int) -> dict[str, list[float]]:
    kv_store = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="tetri-kv-")
    settings = load_worker_settings(
        None,
        role="colocated",
        engine="vllm",
        model=model,
        dtype=vsb.DTYPE,
        block_size=vsb.BLOCK,
        max_model_len=vsb.MAX_LEN,
        chunk_size=vsb.BATCHED,
        kv_connector="HostKVConnector",
        kv_store=kv_store,
    )
    engine = build_engine(settings, "alone")
    await engine.start()
    me = os.getpid()
    try:
        await _batch(engine, vsb.probe(4, seed + 1, 16), 4, "warm")
        before = vsb.own_cpu(me)
        await asyncio.sleep(IDLE_S)
        idle = (vsb.own_cpu(me) - before) / IDLE_S
        out: dict[str, list[float]] = {}
        for streams in (1, concurrency):
            per: list[float] = []
            for tokens in (floor.SHORT, floor.LONG):
                reqs = vsb.probe(requests if streams == 1 else streams, seed, tokens)
                t0, c0 = time.perf_counter(), vsb.own_cpu(me)
                await _batch(engine, reqs, streams, f"s{streams}-t{tokens}")
                wall = time.perf_counter() - t0
                per.append((vsb.own_cpu(me) - c0 - idle * wall) / len(reqs))
            a, b = floor.fit(per[0], per[1])
            out[str(streams)] = [a * 1e6, b * 1e6]
        return out
    finally:
        await engine.stop()
        shutil.rmtree(kv_store, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a local model directory (workers.engines.vllm.tinymodel writes one)")
    ap.add_argument("--requests", type=int, default=24, help="requests per batch at 1 stream")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(measure(a.model, a.requests, a.concurrency, a.seed))), flush=True)


if __name__ == "__main__":
    main()
