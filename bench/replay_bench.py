"""A Sorted-F plan replayed on the live sim cluster, against an fcfs replay of the same backlog.

For each seed: generate a chat backlog (the planner's `short` class, all at t = 0), plan it offline with
Sorted-F and with fcfs at M = the decode instance's KV capacity, replay both on a live 1P+1D sim cluster
(`tetrictl.replay.Replay`, the code behind `tetrictl plan replay`) and print planned TEL (steps) beside
measured TEL (model seconds: the status table's times, on the cluster clock), their Sorted-F / fcfs ratios, and how well
the measured completion order follows the plan (Kendall's τ).

    python bench/replay_bench.py                       # opt-13b-v100, 120 requests, seeds 0-2
    python bench/replay_bench.py -n 200 --profile tiny --time-scale 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tetri.planner.generate import Mix, generate
from tetri.planner.planfile import build_plan, parse_plan
from tetri.planner.policies import run_policy
from tetrictl.client import Target, TetriClient
from tetrictl.procs import start_local_cluster
from tetrictl.replay import Progress, Replay, backlog


async def replay(url: str, plan_doc: dict, order: str) -> tuple[dict, Progress]:
    plan = parse_plan(json.dumps(plan_doc))
    async with TetriClient(Target(url, None)) as c:
        r = Replay(c, plan, backlog(plan), order=order)
        info = await r.prepare()
        return info, await r.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=120, help="requests per backlog")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--profile", default="opt-13b-v100")
    ap.add_argument("--time-scale", type=float, default=10.0)
    args = ap.parse_args()
    console = Console(width=170)
    cluster = start_local_cluster(
        ["prefill", "decode"],
        state_dir=Path(tempfile.mkdtemp(prefix="tetri-replay-bench-")),
        profile=args.profile,
        time_scale=args.time_scale,
        mode="disaggregated",
        port=0,
        grpc_port=0,
    )
    t = Table(title=f"plan replay vs fcfs replay — {args.profile}, 1P+1D, n = {args.n}, time scale {args.time_scale:g}")
    for col in (
        "seed",
        "M",
        "planned TEL sorted-f",
        "planned TEL fcfs",
        "planned ratio",
        "measured TEL sorted-f (s)",
        "measured TEL fcfs (s)",
        "measured ratio",
        "τ sorted-f",
        "τ fcfs",
    ):
        t.add_column(col, justify="right")
    try:
        import httpx

        capacity = next(
            i["kv_capacity_tokens"]
            for i in httpx.get(f"{cluster.url}/api/v1/instances", timeout=10).json()["instances"]
            if i["role"] == "decode"
        )
        max_len = httpx.get(f"{cluster.url}/api/v1/cluster", timeout=10).json()["max_model_len"]
        for seed in range(args.seeds):
            w = generate(Mix.parse("short"), args.n, seed=seed)
            w, _ = w.check_memory(min(capacity, max_len), drop_oversized=True)
            docs = {p: build_plan(w, capacity, run_policy(p, w, capacity)) for p in ("sorted-f", "fcfs")}
            _, sf = asyncio.run(replay(cluster.url, docs["sorted-f"], "plan"))
            _, ff = asyncio.run(replay(cluster.url, docs["sorted-f"], "fcfs"))
            assert sf.failed == 0 and ff.failed == 0, (sf, ff)
            sf_tel = sf.measured_tel_s or 0  # status-table times: the cluster clock, model seconds
            ff_tel = ff.measured_tel_s or 0
            t.add_row(
                str(seed),
                f"{capacity:,}",
                f"{docs['sorted-f']['tel']:,}",
                f"{docs['fcfs']['tel']:,}",
                f"{docs['sorted-f']['tel'] / docs['fcfs']['tel']:.3f}",
                f"{sf_tel:,.1f}",
                f"{ff_tel:,.1f}",
                f"{sf_tel / ff_tel:.3f}",
                f"{sf.order_agreement:.3f}",
                f"{ff.order_agreement:.3f}",
            )
    finally:
        cluster.stop()
    console.print(t)


if __name__ == "__main__":
    main()
