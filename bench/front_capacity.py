"""How many GPUs one front core carries: the discrete-event simulator's throughput per GPU at each of the
five workloads' lengths, against a front's measured CPU per request and per streamed token.

    python bench/front_capacity.py --us-per-request A --us-per-token B
        [--profiles llama3-8b-h100,llama3-8b-a100,llama3-8b-h200,opt-13b-v100] [-n 2048]

A and B are a front's CPU per request and per token, as `bench/control_plane_cost.py --fronts 1` reports
them (with tokens one engine step apart: `--time-scale 1`). For each profile and workload the simulator
runs TetriInfer on two GPUs (one prefill, one decode instance) with every request arriving at once, so
the GPUs are saturated; requests and output tokens per second per GPU follow from the makespan. One front
core then carries 1 / (requests/s × A + tokens/s × B) GPUs. The simulator's throughput is what its cost
profile says (tetri/profiles.toml), not a measurement on a GPU.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from tetri.des.cluster import simulate
from tetri.des.experiments import BenchSetup, requests_for, tetri_config
from tetri.des.names import WORKLOADS

BURST = 1e6  # requests per second: all of them at (nearly) t = 0


def per_gpu(profile: str, workload: str, n: int) -> tuple[float, float, float, float]:
    """(requests/s, output tokens/s) per GPU at saturation, and the mean prompt and output lengths."""
    setup = BenchSetup(profile=profile, instances=2, n=n)
    reqs = requests_for(workload, setup, BURST)
    result = simulate(reqs, tetri_config(setup))
    gpus = result.provisioned
    tokens = sum(r.output_len for r in reqs)
    return (
        len(reqs) / result.makespan / gpus,
        tokens / result.makespan / gpus,
        sum(r.prompt_len for r in reqs) / len(reqs),
        tokens / len(reqs),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--us-per-request", type=float, required=True, help="a front's CPU µs per request")
    ap.add_argument("--us-per-token", type=float, required=True, help="a front's CPU µs per streamed token")
    ap.add_argument("--profiles", default="llama3-8b-h100,llama3-8b-a100,llama3-8b-h200,opt-13b-v100")
    ap.add_argument("-n", type=int, default=2048, help="requests per simulated burst")
    args = ap.parse_args()
    a, b = args.us_per_request * 1e-6, args.us_per_token * 1e-6
    t = Table(
        title=f"GPUs one front core carries, at {args.us_per_request:g} µs per request and "
        f"{args.us_per_token:g} µs per token (simulated saturation throughput, TetriInfer 1P+1D, burst of {args.n})",
        title_justify="left",
    )
    for i, c in enumerate(["profile", "workload", "prompt", "output", "req/s / GPU", "tok/s / GPU", "GPUs / core"]):
        t.add_column(c, justify="left" if i < 2 else "right")
    for profile in [p.strip() for p in args.profiles.split(",") if p.strip()]:
        for k, w in enumerate(WORKLOADS):
            rps, tps, prompt, out = per_gpu(profile, w, args.n)
            gpus = 1.0 / (rps * a + tps * b)
            t.add_row(
                profile if k == 0 else "", w, f"{prompt:.0f}", f"{out:.0f}", f"{rps:,.2f}", f"{tps:,.0f}", f"{gpus:.1f}"
            )
        t.add_section()
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
