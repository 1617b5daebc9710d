"""`tetrictl advise`: for a workload (a trace), a profile, a GPU budget and SLOs, the setup to run.

Every candidate runs on the simulator with the workload's own arrivals: each colocated baseline on all the
GPUs, and TetriInfer at every P:D split × ChunkSize × prefill order × decode admission (the rest of its
policies are the bench's: an oracle length predictor at 74.9%, power-of-two dispatch). A setup's **goodput**
is the workload's offered rate ((requests − 1) / arrival span) × the share of its requests within their
SLOs; the advice is the setup with the highest goodput, goodputs within 1% counting as equal and the lower
mean JCT deciding among them, and a disaggregated setup only when it beats the best colocated one so.
Colocated vllm-v1 is also tried admitting the least predicted work first (`queue_order` srpt, lengths from
an oracle at the paper's 74.9%), and with either order putting the requests that waited past the SLO's TTFT
after those that can still meet it (`ttft_target_s`), alone and with each of a few token budgets
(`token_budget`: fewer prompt tokens an iteration, so lower TPOT, while the TTFT has slack), and, when asked
(`ttft_misses`), rejecting those requests instead (`ttft_miss` reject: clients get 429); the result keeps
every named baseline as vLLM runs it (FCFS, no predictor) under `baselines`. With 3 GPUs or more, hybrid
clusters too: colocated, prefill and decode instances at once (every count of each), the daemon choosing per
request (`pd_route` length) to split the prompts at least as long as the workload's median, 75th or 90th
percentile (the length alone, or the other path when theirs has more than 4 more waiting:
`pd_backlog_slack`) and run the rest colocated (each named baseline's schedule with the TTFT target), P/D at
the profile's ChunkSize, FCFS prefill, greedy admission, no length predictor. Beside it: TTFT and TPOT
percentiles and the dollars per million output tokens (provisioned GPUs × the run's wall time × price).
Every candidate routes cache-aware (`routing`, the default: on a workload whose prompts share nothing it
routes as least-load does); the advice's setup is then run again with cache-blind least-load routing, and
the better of the two is the advice (`routing` in the result: both outcomes and the pick), so a trace with
repeated prefixes (hash ids: conversations, agent loops, shared documents) says what routing by the
prefix cache buys on it.

Pure: requests and a spec in, plain data out; the shell (`tetrictl advise`) reads the trace, prints,
and with `--apply` sets the policies and flips instances on a live cluster to match.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tetri.costmodel import DEFAULT_PROFILE, default_chunk_size, load_profile
from tetri.scheduling.colocated import BASELINES
from tetri.scheduling.names import QUEUE_ORDERS, TTFT_MISSES
from tetri.scheduling.policyset import PolicySet

from .cluster import ClusterConfig, simulate
from .experiments import PAPER_ACCURACY, TETRI_POLICY
from .outcome import offered_rate, outcome, score
from .records import RunResult
from .slo import DEFAULT_SLO, SloSet
from .workloads import Request, WorkloadSpecError

Runner = Callable[[Sequence[Request], ClusterConfig], RunResult]
Progress = Callable[[int, int], None]

MODES = ("colocated", "disaggregated", "hybrid")
ROUTINGS_COMPARED = ("cache-aware", "least-load")  # the advice's setup is run with each
MIN_GPUS = {"colocated": 1, "disaggregated": 2, "hybrid": 3}
PROMPT_QUANTILES = (0.5, 0.75, 0.9)  # hybrid: split the prompts at least as long as these shares of the workload's
BACKLOG_SLACKS = (0, 4)  # hybrid: the length alone, or the other path past 4 more requests waiting
# lengths as the paper's predictor knows them (74.9% of 200-token buckets right)
ORACLE_74 = PolicySet(predictor="oracle", predictor_accuracy=PAPER_ACCURACY)


@dataclass(frozen=True)
class AdviceSpec:
    profile: str = DEFAULT_PROFILE
    gpus: int = 4
    slo: SloSet = field(default=DEFAULT_SLO)
    price: float = 2.0  # dollars per GPU-hour
    chunks: tuple[int, ...] = ()  # TetriInfer ChunkSizes tried; () = the profile's, 256, 512, 1024
    prefill_policies: tuple[str, ...] = ("fcfs", "sjf")
    admissions: tuple[str, ...] = ("greedy", "reserve-dynamic")
    baselines: tuple[str, ...] = BASELINES
    queue_orders: tuple[str, ...] = QUEUE_ORDERS  # colocated vllm-v1 also tried with these (candidates())
    token_budgets: tuple[int, ...] = (256, 384, 512)  # and with these `token_budget`s (its TTFT target on)
    ttft_misses: tuple[str, ...] = ("last",)  # and doing this with the requests past it (reject: only if asked)
    seed: int = 0
    modes: tuple[str, ...] = MODES  # which kinds of setup to consider (a running cluster's own: --mode)

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise WorkloadSpecError(f"--gpus must be at least 1, got {self.gpus}")
        if not self.price > 0:
            raise WorkloadSpecError(f"the price must be positive, got {self.price}")
        if any(c < 1 for c in self.chunks):
            raise WorkloadSpecError(f"--chunks: each ChunkSize must be at least 1 token, got {list(self.chunks)}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise WorkloadSpecError(f"--mode must be any, {' or '.join(MODES)}, got {','.join(self.modes) or 'none'}")
        fits = [m for m in self.modes if self.gpus >= MIN_GPUS[m]]
        if not fits:
            need = min(MIN_GPUS[m] for m in self.modes)
            kinds = " or ".join(self.modes)
            raise WorkloadSpecError(f"a {kinds} setup needs at least {need} GPUs, got --gpus {self.gpus}")
        if not self.ttft_misses or any(m not in TTFT_MISSES for m in self.ttft_misses):
            got = ",".join(self.ttft_misses) or "none"
            raise WorkloadSpecError(f"--ttft-miss must be one or more of {', '.join(TTFT_MISSES)}, got {got}")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad or not self.baselines:
            raise WorkloadSpecError(f"unknown baseline {bad[0] if bad else ''!r} (choose from {', '.join(BASELINES)})")
        try:
            load_profile(self.profile)
        except ValueError as e:
            raise WorkloadSpecError(str(e)) from None

    def chunk_sizes(self) -> tuple[int, ...]:
        if self.chunks:
            return self.chunks
        return tuple(sorted({default_chunk_size(load_profile(self.profile)), 256, 512, 1024}))

    def candidates(self, prompt_lens: Sequence[int] = ()) -> list[dict[str, Any]]:
        """Every setup to try: the colocated baselines, then TetriInfer's (a disaggregated setup needs 2 GPUs),
        then the hybrids (3 GPUs: colocated, prefill and decode instances at once, each request colocated or
        split by its prompt's length: at the `PROMPT_QUANTILES` of `prompt_lens`, the workload's)."""
        out: list[dict[str, Any]] = []
        for b in self.baselines if "colocated" in self.modes else ():
            pol = PolicySet(colocated_schedule=b)
            out.append({"mode": "colocated", "colocated": self.gpus, "baseline": b, "policies": pol.to_dict()})
        # vllm-v1 with Tetri's waiting order: srpt (lengths at 74.9%), and either order putting the requests
        # past the SLO's TTFT after those that can still meet it; with that target, each token budget
        # (fewer prompt tokens an iteration while no prompt is urgent)
        target = self.slo.default.ttft_s
        for order in self.queue_orders if "colocated" in self.modes and "vllm-v1" in self.baselines else ():
            known = ORACLE_74 if order == "srpt" else PolicySet()
            base = known.changed(colocated_schedule="vllm-v1", queue_order=order)
            tried = [
                base.changed(ttft_target_s=target, ttft_miss=miss, token_budget=b)
                for miss in self.ttft_misses
                for b in (0, *self.token_budgets)
            ]
            for pol in ([base] if order != "fcfs" else []) + tried:  # fcfs alone: the baseline itself
                out.append({"mode": "colocated", "colocated": self.gpus, "baseline": None, "policies": pol.to_dict()})
        for p in range(1, self.gpus) if "disaggregated" in self.modes else ():
            for chunk in self.chunk_sizes():
                for order in self.prefill_policies:
                    for admission in self.admissions:
                        pol = TETRI_POLICY.changed(chunk_size=chunk, prefill_policy=order, decode_admission=admission)
                        out.append(
                            {"mode": "disaggregated", "prefill": p, "decode": self.gpus - p, "policies": pol.to_dict()}
                        )
        lengths = np.asarray(prompt_lens) if len(prompt_lens) else np.asarray([512, 1024, 2048])
        thresholds = sorted({max(1, int(q)) for q in np.quantile(lengths, PROMPT_QUANTILES)})
        base = PolicySet(  # no length predictor: the route reads the prompt's length only
            chunk_size=default_chunk_size(load_profile(self.profile)),
            ttft_target_s=target,
            pd_route="length",
        )
        for c in range(1, self.gpus - 1) if "hybrid" in self.modes else ():
            for p in range(1, self.gpus - c):
                for threshold, schedule, slack in itertools.product(thresholds, self.baselines, BACKLOG_SLACKS):
                    pol = base.changed(pd_prompt_tokens=threshold, colocated_schedule=schedule, pd_backlog_slack=slack)
                    out.append(
                        {
                            "mode": "hybrid",
                            "colocated": c,
                            "prefill": p,
                            "decode": self.gpus - c - p,
                            "policies": pol.to_dict(),
                        }
                    )
        return out


def setup_config(spec: AdviceSpec, setup: dict[str, Any]) -> ClusterConfig:
    """The simulator's cluster for one candidate setup."""
    pol = PolicySet(**setup["policies"])
    if setup["mode"] == "colocated":
        return ClusterConfig(mode="vanilla", profile=spec.profile, instances=spec.gpus, policy=pol, seed=spec.seed)
    return ClusterConfig(
        mode="tetri",
        profile=spec.profile,
        instances=spec.gpus,
        prefill_instances=setup["prefill"],
        colocated_instances=setup.get("colocated", 0) if setup["mode"] == "hybrid" else 0,
        policy=pol,
        seed=spec.seed,
    )


def jittered(requests: Sequence[Request], jitter_s: float, seed: int) -> list[Request]:
    """`requests` with each arrival moved by up to ±`jitter_s` (uniform, from `seed`; none before 0), in
    arrival order."""
    moves = np.random.default_rng(seed).uniform(-jitter_s, jitter_s, len(requests))
    moved = [replace(r, arrival=max(0.0, r.arrival + float(d))) for r, d in zip(requests, moves, strict=True)]
    return sorted(moved, key=lambda r: r.arrival)


def expected_outcome(
    requests: Sequence[Request],
    spec: AdviceSpec,
    setup: dict[str, Any],
    jitter_s: float,
    draws: int = 16,
    runner: Runner = simulate,
) -> dict[str, Any]:
    """`setup`'s outcome on `requests` (rated at their own offered rate) as the mean over `draws` runs, each
    with the arrivals moved by up to ±`jitter_s` (`jittered`, seeds 0 … draws − 1); `goodput_min` and
    `goodput_max` say how far the draws went. Past capacity, with requests turned away at a TTFT target, a
    move far below a millisecond changes which requests miss it, and the goodput by several percent either
    way (docs/bench.md): one run's figure is one draw of that, and a live run on the same trace is another,
    which is held to the mean."""
    if draws < 1:
        raise ValueError("draws must be at least 1")
    rate = offered_rate(requests)
    config = setup_config(spec, setup)
    runs = [outcome(runner(jittered(requests, jitter_s, k), config), spec.slo, spec.price, rate) for k in range(draws)]
    mean = {key: float(np.mean([o[key] for o in runs])) for key in runs[0]}
    goodputs = [o["goodput_rps"] for o in runs]
    return mean | {"goodput_min": min(goodputs), "goodput_max": max(goodputs), "draws": draws}


EVEN = 0.01  # goodputs within 1% of each other count as equal: the lower mean JCT decides


def best(setups: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The setup with the highest goodput, goodputs within `EVEN` of the highest counting as equal and the
    lowest mean JCT deciding among them (the earliest listed on a tie); None for none."""
    if not setups:
        return None
    top = max(t["outcome"]["goodput_rps"] for t in setups)
    near = [t for t in setups if t["outcome"]["goodput_rps"] >= top / (1 + EVEN)]
    return min(near, key=lambda t: t["outcome"]["avg_jct_s"])


def _kept(setup: dict[str, Any]) -> dict[str, Any]:
    return {"policies": setup["policies"], "outcome": setup["outcome"]}


def advise(
    requests: Sequence[Request], spec: AdviceSpec, runner: Runner = simulate, progress: Progress | None = None
) -> dict[str, Any]:
    """Every candidate's outcome, the best colocated setup, the best overall (the advice)."""
    if not requests:
        raise WorkloadSpecError("the workload has no requests")
    peak = max(r.prompt_len + r.output_len for r in requests)
    limit = load_profile(spec.profile).model.max_model_len
    if peak > limit:
        raise WorkloadSpecError(f"a request needs {peak} tokens of context; {spec.profile}'s model has {limit}")
    rate = offered_rate(requests)
    setups = spec.candidates([r.prompt_len for r in requests])
    tried = []
    for k, setup in enumerate(setups):
        result = runner(requests, setup_config(spec, setup))
        tried.append(setup | {"outcome": outcome(result, spec.slo, spec.price, rate)})
        if progress is not None:
            progress(k + 1, len(setups))
    coloc = [t for t in tried if t["mode"] == "colocated"]  # the baselines first, as named
    colocated = best(coloc)
    disagg = [t for t in tried if t["mode"] == "disaggregated"]
    best_disagg = best(disagg)
    hybrid = [t for t in tried if t["mode"] == "hybrid"]
    advice = best(coloc + disagg + hybrid)  # over every setup at once (colocated first: it wins a tie)
    assert advice is not None  # AdviceSpec has at least one kind of setup, and GPUs for it
    advice, routing = _routing(requests, spec, advice, runner, rate)
    return {
        "profile": spec.profile,
        "gpus": spec.gpus,
        "slo": spec.slo.to_dict(),
        "price_per_gpu_hour": spec.price,
        "requests": len(requests),
        "offered_rps": rate,
        "advice": advice,
        "baselines": {t["baseline"]: _kept(t) for t in coloc if t["baseline"]},  # as vLLM runs them
        "best_colocated": colocated,
        "best_disaggregated": best_disagg,
        "best_hybrid": best(hybrid),
        "routing": routing,
        "candidates": tried,
    }


def _routing(
    requests: Sequence[Request], spec: AdviceSpec, advice: dict[str, Any], runner: Runner, rate: float | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The advice's setup with each routing of `ROUTINGS_COMPARED`: the advice with the better one (cache-aware
    on a tie), and both outcomes."""
    outcomes: dict[str, dict[str, Any]] = {}
    setups: dict[str, dict[str, Any]] = {}
    for name in ROUTINGS_COMPARED:
        pol = PolicySet(**advice["policies"]).changed(routing=name)
        setups[name] = advice | {"policies": pol.to_dict()}
        if pol.to_dict() == advice["policies"]:
            outcomes[name] = advice["outcome"]
        else:
            outcomes[name] = outcome(runner(requests, setup_config(spec, setups[name])), spec.slo, spec.price, rate)
    pick = max(ROUTINGS_COMPARED, key=lambda name: (score(outcomes[name]), name == "cache-aware"))
    return setups[pick] | {"outcome": outcomes[pick]}, {"outcomes": outcomes, "pick": pick}
