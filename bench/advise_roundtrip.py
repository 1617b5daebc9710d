"""`tetrictl advise` end to end: its predicted goodput against the goodput the live cluster then gets.

    python bench/advise_roundtrip.py [--workload Mixed] [--rate 20] [-n 160] [--profile llama3-8b-h100]
        [--start 2,2] [--time-scale 1] [--slo ttft=0.2,tpot=0.015] [--baseline vllm-v0,vllm-v1]
        [--ttft-miss last[,reject]] [--mode any|colocated,disaggregated,hybrid]

1. A live sim cluster starts (`--start P,D` prefill and decode workers, the default policies; or `--start
   colocated:N`, N colocated workers as vllm-v1, vLLM's own schedule) and serves the named mix (the
   paper's five, or the SLO matrix's chat, code and rag: `tetri.des.mixes`) at its Poisson arrivals: the
   history.
2. Its status table is exported as a trace (`tetrictl requests export`, `tetri.des.trace.rows_to_trace`).
3. `advise` (the simulator) recommends a setup for the trace on P + D GPUs and the SLOs.
4. The advice is applied to the live cluster (`apply_advice`: policies, then flips between the colocated,
   prefill and decode roles). When no sequence of flips gets there (a 1P+1D cluster cannot become two
   colocated instances without leaving the model unserved), a cluster of the advice's roles starts
   instead, and the advice is applied to it.
5. The same trace is replayed live, each request under an id of its own (`again-` and the trace's), and
   its goodput (offered rate × share within the SLOs, as `advise` counts it) is printed beside the
   simulator's for those requests: its mean over 16 runs with the arrivals moved by up to a wall
   millisecond (`expected_outcome`; past capacity one run is one draw, docs/bench.md). Target: within
   10%. The oracle length predictor draws its mistakes per request id, so the advice's own figure is one
   draw of them: it is printed too, and matches only where the advice predicts no lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tetri.des.advise import MODES, AdviceSpec, advise, expected_outcome, offered_rate, outcome
from tetri.des.mixes import MIXES, make_mix
from tetri.des.slo import parse_slos
from tetri.des.trace import read_trace, rows_to_trace
from tetri.des.workloads import make_workload
from tetri.scheduling.flip import ROLES, flip_path
from tetrictl.advise_cmd import apply_advice, describe
from tetrictl.bench_live import replay_on
from tetrictl.client import Target, TetriClient
from tetrictl.output import table
from tetrictl.procs import LocalCluster, start_local_cluster


async def _export(url: str) -> list[dict]:
    async with TetriClient(Target(url, None), timeout=30) as c:
        return rows_to_trace(await c.all_requests(status="finished"))


async def _apply(url: str, doc: dict) -> dict:
    async with TetriClient(Target(url, None), timeout=30) as c:
        return await apply_advice(c, doc, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="Mixed")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (model time)")
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--start", default="2,2", help="P,D: prefill,decode workers; colocated:N: N colocated")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--slo", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default="vllm-v0,vllm-v1", help="colocated baselines advise considers")
    ap.add_argument("--ttft-miss", default="last", help="last, or last,reject: advise may also try rejecting (429)")
    ap.add_argument("--mode", default="any", help="setups advise considers: any, or colocated,disaggregated,hybrid")
    a = ap.parse_args()
    if a.start.startswith("colocated:"):
        roles = ["colocated"] * int(a.start.split(":", 1)[1])
    else:
        p, d = (int(x) for x in a.start.split(","))
        roles = ["prefill"] * p + ["decode"] * d
    gpus = len(roles)
    scale = a.time_scale
    baselines = tuple(b.strip() for b in a.baseline.split(",") if b.strip())
    misses = tuple(m.strip() for m in a.ttft_miss.split(",") if m.strip())
    modes = MODES if a.mode == "any" else tuple(m.strip() for m in a.mode.split(",") if m.strip())
    spec = AdviceSpec(
        profile=a.profile,
        gpus=gpus,
        slo=parse_slos(a.slo),
        seed=a.seed,
        baselines=baselines,
        ttft_misses=misses,
        modes=modes,
    )
    state = Path(tempfile.mkdtemp(prefix="tetri-advise-"))
    clusters: list[LocalCluster] = []

    def start(roles: list[str], name: str) -> LocalCluster:
        colocated = "colocated" in roles  # colocated instances run vllm-v1, vLLM's own schedule
        mode = "hybrid" if colocated and len(set(roles)) > 1 else "colocated" if colocated else "disaggregated"
        policies = {"colocated_schedule": "vllm-v1"} if colocated else None
        cluster = start_local_cluster(
            roles, state_dir=state / name, profile=a.profile, time_scale=scale, mode=mode, policies=policies
        )
        clusters.append(cluster)
        return cluster

    try:
        live = start(roles, "history")
        model_len = spec_model_len(a.profile)
        if a.workload in MIXES:
            history = make_mix(a.workload, a.n, a.rate, a.seed, max_model_len=model_len)
        else:
            history = make_workload(a.workload, a.n, a.seed, a.rate, max_model_len=model_len)
        replay_on(live.url, history, scale, gpus)
        lines = asyncio.run(_export(live.url))
        trace = read_trace(json.dumps(x) for x in lines)
        doc = advise(trace, spec)
        advice = doc["advice"]
        goal = {r: advice.get(r, 0) for r in ROLES} if advice["mode"] != "colocated" else {"colocated": gpus}
        applied = ""
        if flip_path(Counter(roles), goal) is None:  # no flips get there: a cluster of the advice's roles
            live.stop()
            clusters.remove(live)
            live = start([r for r in ROLES for _ in range(goal.get(r, 0))], "advised")
            applied = f"started {advice['mode']}; "
        done = asyncio.run(_apply(live.url, doc))
        applied += f"policies {', '.join(done['changed']) or 'unchanged'}; {len(done['flips'])} flip(s)"
        again = [replace(r, request_id=f"again-{r.request_id}") for r in trace]
        result = replay_on(live.url, again, scale, gpus, keep_ids=True)
        got = outcome(result, spec.slo, spec.price, offered_rate(trace))
    finally:
        for c in clusters:
            c.stop()
    # the simulator's mean over arrivals moved by up to a wall millisecond: past capacity one run is one draw
    want = expected_outcome(again, spec, advice, 1e-3 * scale)
    rows = [
        (k, advice["outcome"][k], want[k], got[k], got[k] / want[k] if want[k] else None)
        for k in ("goodput_rps", "within_slo", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s")
    ]
    table(
        f"advise round trip: {len(trace)} requests of {a.workload} at {offered_rate(trace) or 0:.3g} req/s on "
        f"{gpus} × {a.profile} (started {a.start}); advice {describe(advice)} ({applied}); SLO {spec.slo.label()}",
        ["metric", "advice", "predicted (simulator, mean of 16)", "live", "live / predicted"],
        rows,
    )


def spec_model_len(profile: str) -> int:
    from tetri.costmodel import load_profile

    return load_profile(profile).model.max_model_len


if __name__ == "__main__":
    main()
