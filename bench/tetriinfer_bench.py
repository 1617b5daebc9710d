"""TetriInfer vs the vLLM baselines (vllm-v0, vllm-v1) on the discrete-event simulator: the paper's
table, the ablations, a sensitivity study of the comparison's setup, and the simulator's speed.

    python bench/tetriinfer_bench.py                    # everything (about a minute)
    python bench/tetriinfer_bench.py --only table       # table | ablations | sensitivity | speed | agreement

Pin it to one core for the speed figures: ``taskset -c 0 python bench/tetriinfer_bench.py --only speed``.
Prints rich tables; asserts nothing (tests/des asserts behaviour). docs/bench.md records the output.
"""

from __future__ import annotations

import argparse
import time

from tetri.des.cluster import simulate
from tetri.des.experiments import (
    BenchSetup,
    calibrated_rate,
    des_runner,
    requests_for,
    run_ablations,
    run_bench,
    speed_workload,
    tetri_config,
    vanilla_config,
)
from tetri.des.metrics import summarize
from tetri.des.workloads import WORKLOADS
from tetrictl.bench_cmd import print_ablations, print_tables
from tetrictl.bench_live import live_runner
from tetrictl.output import table


def paper_table(seed: int) -> None:
    print_tables(run_bench(WORKLOADS, BenchSetup(seed=seed)))


def ablations(seed: int) -> None:
    print_ablations(run_ablations(BenchSetup(seed=seed)))


def sensitivity(seed: int) -> None:
    """The same comparison under other readings of the paper's setup (unpublished, see docs/bench.md)."""
    variants = [
        ("1P+1D vs ×2, Poisson 0.8 (default)", BenchSetup(seed=seed)),
        ("1P+1D vs ×2, burst", BenchSetup(seed=seed, burst=True)),
        ("1P+1D vs ×1, Poisson 0.8", BenchSetup(seed=seed, vanilla_instances=1)),
        ("1P+1D vs ×1, burst", BenchSetup(seed=seed, vanilla_instances=1, burst=True)),
        ("1P+3D vs ×4, Poisson 0.8", BenchSetup(seed=seed, instances=4, prefill_instances=1)),
    ]
    rows = []
    for label, setup in variants:
        doc = run_bench(WORKLOADS, setup)
        for w in doc["workloads"]:
            for baseline, c in w["change"].items():
                rows.append(
                    (
                        label,
                        w["workload"],
                        baseline,
                        *[f"{c[k]:+.0%}" for k in ("avg_ttft_s", "avg_jct_s", "cost_gpu_s")],
                        "—" if c["perf_per_dollar"] is None else f"{c['perf_per_dollar']:.2f}×",
                    )
                )
    cols = ["setup", "workload", "vs", "TTFT", "JCT", "cost (GPU·s)", "perf/$ (good req/$)"]
    table("sensitivity: TetriInfer's change vs each baseline", cols, rows)


def speed(seed: int) -> None:
    rows = []
    for profile in ("opt-13b-v100", "llama3-8b-h100"):
        requests, tetri = speed_workload(10_000, 32, seed, profile)
        for label, cfg in (
            ("TetriInfer 16P+16D", tetri),
            ("vllm-v0 ×32", vanilla_config(BenchSetup(profile=profile, instances=32), "vllm-v0")),
            ("vllm-v1 ×32", vanilla_config(BenchSetup(profile=profile, instances=32), "vllm-v1")),
        ):
            t0 = time.perf_counter()
            res = simulate(requests, cfg)
            wall = time.perf_counter() - t0
            rows.append((profile, label, len(requests), res.events, res.makespan, wall, res.events / wall))
    table(
        "DES speed: 10,000 Mixed requests on 32 instances (one process)",
        ["profile", "system", "requests", "events", "model time (s)", "wall (s)", "events/s"],
        rows,
    )


def agreement(seed: int) -> None:
    """The same requests on the simulator and on live sim clusters (real processes; minutes)."""
    rows = []
    for name, n, scale in (("LPLD", 32, 1.0), ("Mixed", 32, 2.0), ("LPHD", 16, 2.0)):
        setup = BenchSetup(profile="opt-13b-v100", instances=2, n=n, seed=seed)
        requests = requests_for(name, setup, calibrated_rate(name, setup, des_runner))
        systems = [("TetriInfer", tetri_config(setup))] + [(b, vanilla_config(setup, b)) for b in setup.baselines]
        for system, config in systems:
            d = summarize(des_runner(requests, config))
            live = summarize(live_runner(scale)(requests, config))
            rows.append(
                [f"{name}, {n}, {scale:g}x", system]
                + [
                    f"{d[k]:.3f} → {live[k]:.3f} ({live[k] / d[k]:.2f})"
                    for k in ("avg_ttft_s", "avg_jct_s", "makespan_s")
                ]
            )
    table(
        "Live vs simulated (simulated → live, ratio)",
        ["workload, n, time scale", "system", "avg TTFT s", "avg JCT s", "makespan s"],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["table", "ablations", "sensitivity", "speed", "agreement"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    parts = {
        "table": paper_table,
        "ablations": ablations,
        "sensitivity": sensitivity,
        "speed": speed,
        "agreement": agreement,
    }
    for name, fn in parts.items():
        if args.only in (None, name):
            fn(args.seed)


if __name__ == "__main__":
    main()
