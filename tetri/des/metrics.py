"""The metrics an operator buys on, and the paper's (TetriInfer §5), from per-request and per-instance
records.

* TTFT = first token − arrival; JCT = finish − arrival; TPOT = (JCT − TTFT) / (output − 1) (average and
  p99, linear interpolation between order statistics as `numpy.percentile` does).
* SLO attainment = the share of requests within their class's TTFT and TPOT targets (`slo.py`; every
  table states the SLOs). Goodput = requests within their SLOs per second of wall time (first arrival →
  last finish or rejection), as DistServe counts it (refs). A request an instance rejected (`ttft_miss` reject) counts
  in the share as outside its SLO; TTFT, TPOT and JCT are the served requests'.
* Cost = provisioned GPUs × wall time (one instance = one GPU, paid for whether it runs or idles);
  `busy_s` (Σ iteration time) is reported beside it. perf/$ = goodput per dollar: requests within their
  SLOs per dollar of provisioned GPU time (`cost_usd` at the price per GPU-hour).
* `active_span_s`: Σ over instances of first → last activity (the figure earlier benches called resource
  usage). It counts a provisioned GPU that never ran as free, so it is kept for reference, not for cost.
* Prefill latency = TTFT (arrival → first token); prefill waiting time = arrival → the start of the first
  prefill iteration that includes the request.

Pure: records in, plain dicts of floats out (the same for a DES run and a live run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .records import RunResult
from .slo import DEFAULT_SLO, SloSet

# (key, label, better): "lower" or "higher" is better; the bench table and plot show these.
HEADLINE = (
    ("avg_ttft_s", "avg TTFT (s)", "lower"),
    ("p99_ttft_s", "p99 TTFT (s)", "lower"),
    ("p99_tpot_s", "p99 TPOT (s)", "lower"),
    ("avg_jct_s", "avg JCT (s)", "lower"),
    ("slo_attainment", "within SLO", "higher"),
    ("goodput_rps", "goodput (req/s)", "higher"),
    ("cost_gpu_s", "cost (GPU·s)", "lower"),
    ("perf_per_dollar", "perf/$ (good req/$)", "higher"),
)
RATIOS = ("perf_per_dollar", "goodput_rps")  # compared as new / base (1.4 = 1.4×), the rest as changes


def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) if xs.size else 0.0


def _mean(xs: np.ndarray) -> float:
    return float(xs.mean()) if xs.size else 0.0


def summarize(result: RunResult, price_per_gpu_hour: float = 2.0, slo: SloSet = DEFAULT_SLO) -> dict[str, Any]:
    """The metrics of one run (see the module docstring for each definition)."""
    if price_per_gpu_hour <= 0:
        raise ValueError("the price per GPU-hour must be positive")
    reqs = result.requests
    ttft = np.array([r.ttft for r in reqs])
    tpot = np.array([r.tpot for r in reqs if r.output_len > 1])
    jct = np.array([r.jct for r in reqs])
    wait = np.array([r.prefill_wait for r in reqs])
    n = result.offered  # the rejected count as outside the SLO; the latencies are the served requests'
    good = sum(1 for r in reqs if slo.met(r))
    wall = result.makespan
    gpus = result.provisioned
    cost_gpu_s = gpus * wall
    cost_usd = cost_gpu_s / 3600.0 * price_per_gpu_hour
    tokens = sum(r.output_len for r in reqs)
    return {
        "n": n,
        "slo": slo.label(),
        "avg_ttft_s": _mean(ttft),
        "p99_ttft_s": _pct(ttft, 99),
        "avg_tpot_s": _mean(tpot),
        "p99_tpot_s": _pct(tpot, 99),
        "avg_jct_s": _mean(jct),
        "p99_jct_s": _pct(jct, 99),
        "avg_prefill_latency_s": _mean(ttft),
        "avg_prefill_wait_s": _mean(wait),
        "within_slo": good,
        "rejected": len(result.rejected),
        "slo_attainment": good / n if n else 0.0,
        "goodput_rps": good / wall if wall else 0.0,
        "gpus": gpus,
        "wall_s": wall,
        "cost_gpu_s": cost_gpu_s,
        "cost_usd": cost_usd,
        "busy_s": sum(i.busy_s for i in result.instances),
        "active_span_s": sum(i.span_s for i in result.instances),
        "perf_per_dollar": good / cost_usd if cost_usd else 0.0,
        "makespan_s": wall,
        "output_tokens_per_s": tokens / wall if wall else 0.0,
        "preemptions": result.preemptions,
        "padding_tokens": result.padding_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "flips": len(result.flips),
        "prefix_hit_ratio": result.prefix_hit_ratio,
        "cached_prompt_tokens": sum(r.cached_tokens for r in reqs),
    }


def relative_change(
    new: dict[str, Any], base: dict[str, Any], keys: Sequence[str] | None = None
) -> dict[str, float | None]:
    """(new − base) / base per metric (−0.44 = 44% lower); perf/$ and goodput as the ratio new / base
    (1.4 = 1.4×). None where the base is 0."""
    out: dict[str, float | None] = {}
    for k in keys or [k for k, _, _ in HEADLINE]:
        b, v = float(base[k]), float(new[k])
        if k in RATIOS:
            out[k] = v / b if b else None
        else:
            out[k] = (v - b) / b if b else None
    return out
