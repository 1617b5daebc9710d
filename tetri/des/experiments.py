"""The bench (TetriInfer vs the vLLM baselines per workload) and the ablations, as functions returning plain
data (dicts, lists, floats, strings: JSON-ready). `tetrictl bench` and `bench/tetriinfer_bench.py` print
them; docs/bench.md explains the choices.

A *runner* turns (requests, cluster config) into a `RunResult`; `des_runner` simulates. A live runner
(later) replays the same requests against a running cluster and returns the same per-request records, so
every function here takes `runner=` and works unchanged.

Systems (one instance = one GPU, the same budget for both):
* TetriInfer: `prefill_instances` prefill + the rest decode; ChunkSize the profile's (the paper's 512
  on opt-13b-v100, the roofline's knee elsewhere: `costmodel.default_chunk_size`), sjf with PrefillSchedBatch
  16, oracle predictor at 74.9% accuracy over 200-token buckets, power-of-two dispatch, reserve-dynamic
  decode admission (refs: the paper's settings).
* The baselines, by name (`tetri.scheduling.colocated`), each on the same number of colocated instances
  with greedy admission: `vllm-v0` (the paper's vLLM of early 2024: prefill-first, prompt batches padded
  to their longest, recompute preemption) and `vllm-v1` (today's: chunked prefill mixed into the decode
  batches under the token budget). Every result compares TetriInfer with each (`change[baseline]`).

Arrival rate: `load` × the first baseline's saturated throughput on the same requests (all arriving at
t = 0, simulated once), so a rate means the same thing on every profile: at load 0.8 that baseline is
busy but keeps up on average.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tetri.costmodel import DEFAULT_PROFILE, CostModel, default_chunk_size, load_profile
from tetri.scheduling.admission import RESERVE_POINTS
from tetri.scheduling.colocated import BASELINES
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.presets import TETRIINFER

from .cluster import ClusterConfig, simulate
from .flipadvisor import advising
from .metrics import HEADLINE, relative_change, summarize
from .records import RunResult
from .slo import DEFAULT_SLO, SloSet
from .workloads import (
    WORKLOADS,
    Request,
    WorkloadSpecError,
    check_workload_name,
    describe,
    make_workload,
    shifting_workload,
)

Runner = Callable[[Sequence[Request], ClusterConfig], RunResult]
Progress = Callable[[int, int], None]

TETRI = "TetriInfer"
PAPER_ACCURACY = 0.749  # refs: the OPT-125M predictor's accuracy over 200-token buckets
# the `tetriinfer` preset with the paper's predictor accuracy (an oracle at 74.9%) and no flips (the bench
# compares fixed splits); `tetri_config` sets the setup's ChunkSize (the profile's by default)
TETRI_POLICY = TETRIINFER.changed(predictor="oracle", predictor_accuracy=PAPER_ACCURACY, flip_policy="off")
# colocated instances use only the baseline's schedule and vLLM's (greedy) admission
BASELINE_POLICIES = {b: PolicySet(colocated_schedule=b) for b in BASELINES}


def des_runner(requests: Sequence[Request], config: ClusterConfig) -> RunResult:
    return simulate(requests, config)


def _noop(done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class BenchSetup:
    """The knobs of a bench run. `prefill_instances` defaults to half the instances (at least one);
    `vanilla_instances` to `instances` (the same hardware budget)."""

    profile: str = DEFAULT_PROFILE
    instances: int = 2
    prefill_instances: int | None = None
    vanilla_instances: int | None = None
    n: int = 128
    seed: int = 0
    price: float = 2.0
    load: float = 0.8
    burst: bool = False  # all requests at t = 0 instead of Poisson arrivals
    slo: SloSet = DEFAULT_SLO  # what goodput and perf/$ count as served well
    baselines: tuple[str, ...] = BASELINES  # compared with TetriInfer; the first calibrates the rate
    chunk_size: int | None = None  # TetriInfer's ChunkSize; None: the profile's (`default_chunk_size`)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise WorkloadSpecError(f"-n must be at least 1, got {self.n}")
        if self.instances < 2:
            raise WorkloadSpecError(f"need at least 2 instances (one prefill, one decode), got {self.instances}")
        if not 1 <= self.n_prefill < self.instances:
            raise WorkloadSpecError(f"prefill instances must be within 1..{self.instances - 1}, got {self.n_prefill}")
        if self.n_vanilla < 1:
            raise WorkloadSpecError(f"vanilla instances must be at least 1, got {self.n_vanilla}")
        if not self.price > 0:
            raise WorkloadSpecError(f"the price must be positive, got {self.price}")
        if not 0 < self.load <= 10:
            raise WorkloadSpecError(f"the load must be within (0, 10], got {self.load}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise WorkloadSpecError(f"the chunk size must be at least 1 token, got {self.chunk_size}")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad or not self.baselines or len(set(self.baselines)) != len(self.baselines):
            what = f"unknown baseline {bad[0]!r}" if bad else "each baseline once, at least one"
            raise WorkloadSpecError(f"{what} (choose from {', '.join(BASELINES)})")

    @property
    def n_prefill(self) -> int:
        return self.prefill_instances if self.prefill_instances is not None else max(1, self.instances // 2)

    @property
    def chunk(self) -> int:
        return self.chunk_size if self.chunk_size is not None else default_chunk_size(load_profile(self.profile))

    @property
    def n_vanilla(self) -> int:
        return self.vanilla_instances if self.vanilla_instances is not None else self.instances


def tetri_config(setup: BenchSetup, policy: PolicySet = TETRI_POLICY, **changes: Any) -> ClusterConfig:
    """TetriInfer on the setup's hardware split, with `policy` at the setup's ChunkSize."""
    cfg = ClusterConfig(
        mode="tetri",
        profile=setup.profile,
        instances=setup.instances,
        prefill_instances=setup.n_prefill,
        policy=policy.changed(chunk_size=setup.chunk),
        seed=setup.seed,
    )
    return replace(cfg, **changes) if changes else cfg


def vanilla_config(setup: BenchSetup, baseline: str | None = None) -> ClusterConfig:
    """The colocated cluster running `baseline` (default: the setup's first)."""
    policy = BASELINE_POLICIES[baseline or setup.baselines[0]]
    return ClusterConfig(
        mode="vanilla", profile=setup.profile, instances=setup.n_vanilla, policy=policy, seed=setup.seed
    )


def requests_for(name: str, setup: BenchSetup, rate: float, n: int | None = None) -> list[Request]:
    """`make_workload` within the profile's limits (context length, KV capacity)."""
    profile = load_profile(setup.profile)
    cap = CostModel(profile).kv_capacity_tokens()
    return make_workload(
        name, n or setup.n, setup.seed, rate, max_model_len=profile.model.max_model_len, kv_capacity=cap
    )


def calibrated_rate(
    name: str, setup: BenchSetup, runner: Runner = des_runner, config: ClusterConfig | None = None
) -> float:
    """`setup.load` × the throughput of `config` (default: the first baseline) on these requests all
    arriving at t = 0."""
    burst = requests_for(name, setup, math.inf)
    res = runner(burst, config or vanilla_config(setup))
    return setup.load * len(burst) / res.makespan if res.makespan > 0 else 1.0


def bench_workload(
    name: str, setup: BenchSetup, runner: Runner = des_runner, rate: float | None = None
) -> dict[str, Any]:
    """TetriInfer vs each baseline on one workload: the metrics of every system and TetriInfer's relative
    change against each baseline (`change[baseline]`)."""
    name = check_workload_name(name)
    if rate is None:  # the arrival rate is part of the workload: calibrated on the simulator, whatever runs it
        rate = math.inf if setup.burst else calibrated_rate(name, setup, des_runner)
    requests = requests_for(name, setup, rate)
    systems = {TETRI: summarize(runner(requests, tetri_config(setup)), setup.price, setup.slo)}
    for b in setup.baselines:
        systems[b] = summarize(runner(requests, vanilla_config(setup, b)), setup.price, setup.slo)
    return {
        "workload": name,
        "rate_rps": None if math.isinf(rate) else rate,  # None: a burst at t = 0
        "lengths": describe(requests),
        "systems": systems,
        "change": {b: relative_change(systems[TETRI], systems[b]) for b in setup.baselines},
    }


def run_bench(
    workloads: Sequence[str] = WORKLOADS,
    setup: BenchSetup | None = None,
    runner: Runner = des_runner,
    progress: Progress = _noop,
    mode: str = "des",
) -> dict[str, Any]:
    """The paper's end-to-end table (§5) for each workload, plus the setup that produced it."""
    setup = setup or BenchSetup()
    names = [check_workload_name(w) for w in workloads]
    rows = []
    for k, name in enumerate(names):
        rows.append(bench_workload(name, setup, runner))
        progress(k + 1, len(names))
    return {
        "mode": mode,
        "setup": {
            "profile": setup.profile,
            "instances": setup.instances,
            "tetri_split": {"prefill": setup.n_prefill, "decode": setup.instances - setup.n_prefill},
            "vanilla_instances": setup.n_vanilla,
            "baselines": list(setup.baselines),
            "chunk_size": setup.chunk,
            "n": setup.n,
            "seed": setup.seed,
            "price_per_gpu_hour": setup.price,
            "slo": setup.slo.to_dict(),
            "load": None if setup.burst else setup.load,
            "arrivals": "burst at t = 0" if setup.burst else "Poisson",
            "tetri_policy": TETRI_POLICY.changed(chunk_size=setup.chunk).to_dict(),
        },
        "metrics": [{"key": k, "label": label, "better": better} for k, label, better in HEADLINE],
        "workloads": rows,
    }


# --- ablations ---------------------------------------------------------------------------------


def ablation_chunking(setup: BenchSetup, runner: Runner = des_runner) -> dict[str, Any]:
    """(1) Chunked prefill on/off × fcfs/sjf on Mixed: average prefill latency (arrival → first token)
    and prefill waiting time (arrival → prefill start). A burst: all requests arrive at t = 0 (a prefill
    backlog; assumed — the paper's exact load is not published). Fixed batch = whole prompts up to the
    vLLM budget (max(max_model_len, 2048) tokens) per iteration, unpadded."""
    requests = requests_for("Mixed", setup, math.inf)
    rows = []
    for chunked in (False, True):
        for order in ("fcfs", "sjf"):
            cfg = tetri_config(setup, TETRI_POLICY.changed(prefill_policy=order), chunked=chunked)
            m = summarize(runner(requests, cfg), setup.price, setup.slo)
            rows.append(
                {
                    "prefill": "chunked" if chunked else "fixed batch",
                    "order": order,
                    "avg_prefill_latency_s": m["avg_prefill_latency_s"],
                    "avg_prefill_wait_s": m["avg_prefill_wait_s"],
                    "padding_tokens": m["padding_tokens"],
                }
            )
    base = rows[0]  # fixed batch, fcfs
    for r in rows:
        r["latency_change_vs_fixed_fcfs"] = r["avg_prefill_latency_s"] / base["avg_prefill_latency_s"] - 1
    fcfs = {r["prefill"]: r for r in rows if r["order"] == "fcfs"}
    for r in rows:
        r["wait_change_vs_fcfs"] = r["avg_prefill_wait_s"] / fcfs[r["prefill"]]["avg_prefill_wait_s"] - 1
    return {"workload": "Mixed (burst at t = 0)", "n": len(requests), "rows": rows}


def ablation_predictor(setup: BenchSetup, runner: Runner = des_runner) -> dict[str, Any]:
    """(2) Predictor accuracy (exact / ideal 100% / 74.9% / none) × decode admission (greedy / reserve-static /
    reserve-dynamic, each reserve policy at the lower, mid and upper point of the predicted bucket): JCT
    and preemptions on LPHD, where decode memory binds (light prompts, heavy
    outputs). Rate: `setup.load` × TetriInfer's own saturated throughput (greedy admission), so the
    decode instances are busy but not swamped. "ideal" is the right 200-token bucket every time (its lower
    end still underestimates by up to 199 tokens); "exact" uses 1-token buckets (lower end = truth)."""
    rate = calibrated_rate("LPHD", setup, runner, tetri_config(setup, TETRI_POLICY.changed(decode_admission="greedy")))
    requests = requests_for("LPHD", setup, rate)
    rows = []
    predictors = (
        ("exact (1-token buckets)", "oracle", 1.0, 1),
        ("ideal (100%)", "oracle", 1.0, 200),
        ("74.9%", "oracle", PAPER_ACCURACY, 200),
        ("none", "none", 1.0, 200),
    )
    cases = [("greedy", "lower")] + [(a, p) for a in ("reserve-static", "reserve-dynamic") for p in RESERVE_POINTS]
    for label, predictor, accuracy, granularity in predictors:
        for admission, point in cases:
            if point != "lower" and (predictor == "none" or granularity == 1):
                continue  # without a bucket (none, or 1-token buckets) every point is the same
            pol = TETRI_POLICY.changed(
                predictor=predictor,
                predictor_accuracy=accuracy,
                predictor_granularity=granularity,
                decode_admission=admission,
                reserve_point=point,
            )
            res = runner(requests, tetri_config(setup, pol))
            m = summarize(res, setup.price, setup.slo)
            decode_time = sum(r.finish - r.decode_start for r in res.requests if r.decode_start is not None)
            rows.append(
                {
                    "predictor": label,
                    "admission": admission,
                    "reserve_point": point if admission != "greedy" else "-",
                    "avg_jct_s": m["avg_jct_s"],
                    "p99_jct_s": m["p99_jct_s"],
                    "preemptions": m["preemptions"],
                    "recomputed_tokens": m["recomputed_tokens"],
                    "total_decode_time_s": decode_time,
                    "makespan_s": m["makespan_s"],
                }
            )
    return {"workload": "LPHD", "rate_rps": rate, "n": len(requests), "rows": rows}


def ablation_flip(
    setup: BenchSetup, runner: Runner = des_runner, *, instances: int = 4, prefill: int = 2, window_s: float = 10.0
) -> dict[str, Any]:
    """(3) Instance flips on a workload that shifts from prefill-heavy (HPLD) to decode-heavy (LPHD):
    the `idle` TransitionWatcher (low 10%, high 80%, the paper's one-minute window scaled down to
    `window_s`, checked every second) vs the same fixed split. Rates: each phase at `setup.load` × the
    vanilla throughput of that phase on the same hardware."""
    hw = replace(setup, instances=instances, prefill_instances=prefill, vanilla_instances=instances)
    r1 = calibrated_rate("HPLD", replace(hw, n=setup.n // 2), runner)
    r2 = calibrated_rate("LPHD", replace(hw, n=setup.n - setup.n // 2), runner)
    profile = load_profile(setup.profile)
    requests = shifting_workload(
        setup.n,
        setup.seed,
        rates=(r1, r2),
        max_model_len=profile.model.max_model_len,
        kv_capacity=CostModel(profile).kv_capacity_tokens(),
    )
    rows = []
    for label, flip in (("fixed split", "off"), ("flips (idle watcher)", "idle"), ("flips (advise)", "advise")):
        pol = TETRI_POLICY.changed(flip_policy=flip, flip_window_s=window_s)
        res = runner(requests, advising(tetri_config(hw, pol)))  # the advise policy's model, as data
        m = summarize(res, setup.price, setup.slo)
        rows.append(
            {
                "system": label,
                "avg_ttft_s": m["avg_ttft_s"],
                "avg_jct_s": m["avg_jct_s"],
                "p99_jct_s": m["p99_jct_s"],
                "makespan_s": m["makespan_s"],
                "cost_gpu_s": m["cost_gpu_s"],
                "flips": [
                    {
                        "instance": f.instance_id,
                        "from": f.from_role,
                        "to": f.to_role,
                        "started_s": f.started,
                        "drained_s": f.drained,
                        "done_s": f.done,
                    }
                    for f in res.flips
                ],
            }
        )
    return {
        "workload": f"HPLD → LPHD ({setup.n // 2} + {setup.n - setup.n // 2} requests)",
        "rates_rps": [r1, r2],
        "start_split": {"prefill": prefill, "decode": instances - prefill},
        "window_s": window_s,
        "rows": rows,
    }


def run_ablations(
    setup: BenchSetup | None = None, runner: Runner = des_runner, progress: Progress = _noop
) -> dict[str, Any]:
    setup = setup or BenchSetup()
    out: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[BenchSetup, Runner], dict[str, Any]]]] = [
        ("chunking", ablation_chunking),
        ("predictor", ablation_predictor),
        ("flip", ablation_flip),
    ]
    for k, (name, fn) in enumerate(steps):
        out[name] = fn(setup, runner)
        progress(k + 1, len(steps))
    return out


def speed_workload(
    n: int = 10_000, instances: int = 32, seed: int = 0, profile: str = DEFAULT_PROFILE
) -> tuple[list[Request], ClusterConfig]:
    """The DES speed case: n Mixed requests on `instances` (half prefill) at 0.8 × the vanilla
    2-instance rate scaled up (× instances / 2). Time `simulate` on it."""
    base = BenchSetup(profile=profile, n=128, seed=seed)
    rate = calibrated_rate("Mixed", base) * instances / 2
    requests = requests_for("Mixed", base, rate, n)
    return requests, tetri_config(replace(base, instances=instances, prefill_instances=instances // 2))
