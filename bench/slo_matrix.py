"""The SLO matrix: chat-, code- and RAG-like mixes (`tetri.des.mixes`) at three loads each, on the
simulator, the advice and Tetri's colocated setups against vLLM's baselines as vLLM runs them.

    python bench/slo_matrix.py [--requests 600] [--mixes chat,code,rag] [--loads 0.7,1.0,1.4]
        [--gpus 4] [--profile llama3-8b-h100] [--slo ttft=0.5,tpot=0.05] [--seed 0] [--advise]
        [--ttft-miss last[,reject]] [--orders fcfs,srpt] [--json FILE]

Per mix, vllm-v1's capacity on `--gpus` colocated instances: the highest Poisson rate at which at least
90% of the requests meet the SLO (bisection over the rate, the same requests' lengths at every rate).
Each point is that mix at `load` × the capacity. Setups, each on every point:
  * vllm-v1, vllm-v0 — the baselines as vLLM runs them (FCFS, no predictor, its own schedule);
  * srpt — vllm-v1's schedule admitting the least predicted work first, with aging (`queue_order`
    srpt), lengths from an oracle predictor at the paper's 74.9% accuracy over 200-token buckets (never
    the exact lengths);
  * fcfs+ttft, srpt+ttft — the same with `ttft_target_s` at the SLO's TTFT: a request that waited past it
    goes after those that can still meet theirs;
  * ttft+budget — fcfs+ttft with `token_budget` 384: 384 tokens an iteration (not vLLM's 2048) while no
    prompt has waited half the TTFT target, so fewer prompt tokens slow the decodes;
  * srpt+reject — srpt+ttft, but a request past the TTFT target is rejected (`ttft_miss` reject; live: 429
    with Retry-After) rather than served last; it counts as outside the SLO, and the latencies are those
    of the requests served;
  * advice — with `--advise`, what `tetrictl advise` picks on the point (every candidate it tries: slow);
    with `--ttft-miss last,reject` it may pick rejecting too;
  * best hybrid — with `--advise`, the best of its hybrid candidates: colocated, prefill and decode
    instances at once, the prompts longer than a percentile of the point's split (`pd_route` length).
Per setup: goodput (offered rate × share within the SLO), mean and p99 JCT, the p99 JCT of the requests
served within the SLO, mean TTFT and TPOT, and the ratios to vllm-v1. A point is a **win** for a setup
when its goodput is ≥ 1.3× vllm-v1's, or ≥ 0.99× with mean JCT ≤ 0.8×; a **loss** when its goodput is
below 0.99× vllm-v1's, or within 1% with mean JCT above 1.05×.

Per mix, the learned predictor's accuracy too (`learned_accuracy`): fitted on 2,000 of the mix's requests
with prompts of random token ids (the mixes draw prompt and answer lengths independently, so a prompt tells
nothing of its answer's length but its own length), held-out share of 200-token buckets right, beside the
share of the most common bucket (what a predictor that knows nothing gets). `--orders fcfs` keeps the
advice to Tetri's setups that need no predictor.

Deterministic for a seed. Prints one table per mix; asserts nothing (tests/des assert behaviour).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tetri.des.advise import ORACLE_74, AdviceSpec, advise, outcome, setup_config
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.mixes import MIXES, make_mix
from tetri.des.slo import SloSet, parse_slos
from tetri.des.workloads import Request
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import LearnedPredictor, bucket_of
from tetrictl.output import table

COLUMNS = ["load", "setup", "goodput req/s", "within SLO", "rejected", "mean JCT s", "p99 JCT", "p99 JCT within SLO"]
COLUMNS += ["mean TTFT s", "mean TPOT ms", "vs vllm-v1"]
WITHIN = 0.9  # capacity: the highest rate with at least this share of requests within the SLO

SETUPS: dict[str, PolicySet] = {
    "vllm-v1": PolicySet(colocated_schedule="vllm-v1"),
    "vllm-v0": PolicySet(colocated_schedule="vllm-v0"),
    "srpt": ORACLE_74.changed(colocated_schedule="vllm-v1", queue_order="srpt"),
    "fcfs+ttft": PolicySet(colocated_schedule="vllm-v1"),  # ttft_target_s: the SLO's TTFT (main)
    "srpt+ttft": ORACLE_74.changed(colocated_schedule="vllm-v1", queue_order="srpt"),
    "ttft+budget": PolicySet(colocated_schedule="vllm-v1", token_budget=384),
    "srpt+reject": ORACLE_74.changed(colocated_schedule="vllm-v1", queue_order="srpt", ttft_miss="reject"),
}
WITH_TTFT = ("fcfs+ttft", "srpt+ttft", "ttft+budget", "srpt+reject")


def run(
    requests: Sequence[Request],
    policy: PolicySet,
    rate: float,
    args: argparse.Namespace,
    slo: SloSet,
    cfg: ClusterConfig | None = None,
) -> dict[str, Any]:
    """One setup on one point, offered at `rate` (colocated on every GPU unless `cfg` says otherwise)."""
    if cfg is None:
        cfg = ClusterConfig(mode="vanilla", profile=args.profile, instances=args.gpus, policy=policy, seed=args.seed)
    result = simulate(requests, cfg)
    o = outcome(result, slo, 2.0, rate)
    good = [r.jct for r in result.requests if slo.met(r)]
    o["rejected"] = len(result.rejected)
    o["p99_jct_s"] = float(np.percentile([r.jct for r in result.requests], 99))
    o["p99_jct_within_s"] = float(np.percentile(good, 99)) if good else float("nan")
    o["mean_ttft_s"] = float(np.mean([r.ttft for r in result.requests]))
    tpots = [r.tpot for r in result.requests if r.output_len > 1]
    o["mean_tpot_s"] = float(np.mean(tpots)) if tpots else 0.0
    return o


def capacity(mix: str, args: argparse.Namespace, slo: SloSet) -> float:
    """vllm-v1's capacity on this mix (module docstring), to 2%."""

    def ok(rate: float) -> bool:
        requests = make_mix(mix, args.requests, rate, args.seed)
        return run(requests, SETUPS["vllm-v1"], rate, args, slo)["within_slo"] >= WITHIN

    lo, hi = 0.0, 1.0
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 0.02 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def learned_accuracy(mix: str, seed: int, n: int = 2000) -> tuple[float, float]:
    """The learned predictor on the mix (module docstring): its held-out accuracy, and the most common
    200-token bucket's share."""
    reqs = make_mix(mix, n, 1.0, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 32_000, r.prompt_len).tolist() for r in reqs]
    outputs = [r.output_len for r in reqs]
    p = LearnedPredictor(200)
    acc = p.fit(prompts, outputs, seed=seed)
    buckets = np.bincount(np.minimum([bucket_of(o, 200) for o in outputs], p.buckets - 1))
    assert acc is not None
    return acc, float(buckets.max() / len(outputs))


def verdict(o: dict[str, Any], base: dict[str, Any]) -> str:
    g = o["goodput_rps"] / base["goodput_rps"] if base["goodput_rps"] else float("inf")
    j = o["avg_jct_s"] / base["avg_jct_s"]
    if g >= 1.3 or (g >= 0.99 and j <= 0.8):
        return "win"
    if g < 0.99 or (g <= 1.01 and j > 1.05):
        return "loss"
    return "even"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--loads", default="0.7,1.0,1.4")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--slo", default="ttft=0.5,tpot=0.05")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--advise", action="store_true", help="also run `tetrictl advise` on each point (slow)")
    ap.add_argument("--json", type=Path, help="write every point's outcomes here")
    ap.add_argument("--ttft-miss", default="last", help="--advise: last, or last,reject to let it try rejecting")
    ap.add_argument("--orders", default="fcfs,srpt", help="--advise: the waiting orders it tries (fcfs: no predictor)")
    args = ap.parse_args()
    slo = parse_slos([args.slo])
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    target = slo.default.ttft_s
    setups = {k: p.changed(ttft_target_s=target) if k in WITH_TTFT else p for k, p in SETUPS.items()}
    doc: list[dict[str, Any]] = []
    verdicts: dict[str, list[str]] = {}
    for mix in [m.strip() for m in args.mixes.split(",") if m.strip()]:
        cap = capacity(mix, args, slo)
        learned, prior = learned_accuracy(mix, args.seed)
        rows = []
        for load in loads:
            rate = load * cap
            requests = make_mix(mix, args.requests, rate, args.seed)
            got = {name: run(requests, pol, rate, args, slo) for name, pol in setups.items()}
            if args.advise:
                misses = tuple(m.strip() for m in args.ttft_miss.split(",") if m.strip())
                orders = tuple(o.strip() for o in args.orders.split(",") if o.strip())
                spec = AdviceSpec(profile=args.profile, gpus=args.gpus, slo=slo, seed=args.seed)
                spec = dataclasses.replace(spec, ttft_misses=misses, queue_orders=orders)
                advised = advise(requests, spec)
                for name, setup in (("advice", advised["advice"]), ("best hybrid", advised["best_hybrid"])):
                    if setup is not None:
                        cfg = setup_config(spec, setup)
                        got[name] = run(requests, cfg.policy, rate, args, slo, cfg) | {"setup": setup}
            base = got["vllm-v1"]
            for name, o in got.items():
                v = "" if name == "vllm-v1" else verdict(o, base)
                verdicts.setdefault(name, []).append(v)
                rows.append(
                    (
                        f"{load:g}× ({rate:.3g}/s)" if name == "vllm-v1" else "",
                        name,
                        f"{o['goodput_rps']:.3g} ({o['goodput_rps'] / base['goodput_rps']:.2f}×)",
                        f"{o['within_slo']:.0%}",
                        str(o["rejected"]),
                        f"{o['avg_jct_s']:.2f} ({o['avg_jct_s'] / base['avg_jct_s']:.2f}×)",
                        f"{o['p99_jct_s']:.2f}",
                        f"{o['p99_jct_within_s']:.2f} ({o['p99_jct_within_s'] / base['p99_jct_within_s']:.2f}×)",
                        f"{o['mean_ttft_s']:.3f}",
                        f"{o['mean_tpot_s'] * 1000:.1f}",
                        v,
                    )
                )
            doc.append(
                {"mix": mix, "capacity_rps": cap, "load": load, "rate_rps": rate, "outcomes": got}
                | {"learned_accuracy": learned, "most_common_bucket": prior}
            )
        table(
            f"{mix}: {args.requests} requests on {args.gpus} × {args.profile}, SLO {slo.label()}; vllm-v1's "
            f"capacity {cap:.3g} req/s (≥ {WITHIN:.0%} within the SLO); learned predictor {learned:.1%} (most "
            f"common bucket {prior:.1%}), srpt's oracle 74.9%",
            COLUMNS,
            rows,
        )
    for name, vs in verdicts.items():
        if name != "vllm-v1":
            print(f"{name}: {vs.count('win')} wins, {vs.count('even')} even, {vs.count('loss')} losses of {len(vs)}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
