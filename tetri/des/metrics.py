"""The paper's metrics (TetriInfer §5) from per-request and per-instance records.

* TTFT = first token − arrival; JCT = finish − arrival (average and p99, linear interpolation between
  order statistics as `numpy.percentile` does).
* Prefill latency = TTFT (arrival → first token); prefill waiting time = arrival → the start of the first
  prefill iteration that includes the request.
* Resource usage time (instance-seconds) = Σ over instances of (last activity − first activity): an
  instance counts from the start of its first iteration to the end of its last iteration or of the last
  KV transfer out of it (the paper aggregates prefill and decode instance wall time). An instance that
  never ran counts 0. `busy_s` (Σ iteration time) is reported beside it.
* perf/$ = requests served per dollar of resource usage: n / (resource usage in GPU-hours × price per
  GPU-hour); one instance = one GPU. `requests_per_gpu_hour` is the same without the price.

Pure: records in, plain dicts of floats out (the same for a DES run and, later, a live run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .records import RunResult

# (key, label, better): "lower" or "higher" is better; the bench table and plot show these.
HEADLINE = (
    ("avg_ttft_s", "avg TTFT (s)", "lower"),
    ("p99_ttft_s", "p99 TTFT (s)", "lower"),
    ("avg_jct_s", "avg JCT (s)", "lower"),
    ("p99_jct_s", "p99 JCT (s)", "lower"),
    ("resource_usage_s", "resource usage (GPU·s)", "lower"),
    ("perf_per_dollar", "perf/$ (requests/$)", "higher"),
)


def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) if xs.size else 0.0


def _mean(xs: np.ndarray) -> float:
    return float(xs.mean()) if xs.size else 0.0


def summarize(result: RunResult, price_per_gpu_hour: float = 2.0) -> dict[str, Any]:
    """The metrics of one run (see the module docstring for each definition)."""
    if price_per_gpu_hour <= 0:
        raise ValueError("the price per GPU-hour must be positive")
    reqs = result.requests
    ttft = np.array([r.ttft for r in reqs])
    jct = np.array([r.jct for r in reqs])
    wait = np.array([r.prefill_wait for r in reqs])
    usage = sum(i.span_s for i in result.instances)
    gpu_hours = usage / 3600.0
    n = len(reqs)
    tokens = sum(r.output_len for r in reqs)
    return {
        "n": n,
        "avg_ttft_s": _mean(ttft),
        "p99_ttft_s": _pct(ttft, 99),
        "avg_jct_s": _mean(jct),
        "p99_jct_s": _pct(jct, 99),
        "avg_prefill_latency_s": _mean(ttft),
        "avg_prefill_wait_s": _mean(wait),
        "resource_usage_s": usage,
        "busy_s": sum(i.busy_s for i in result.instances),
        "makespan_s": result.makespan,
        "requests_per_gpu_hour": n / gpu_hours if gpu_hours else 0.0,
        "perf_per_dollar": n / (gpu_hours * price_per_gpu_hour) if gpu_hours else 0.0,
        "output_tokens_per_s": tokens / result.makespan if result.makespan else 0.0,
        "preemptions": result.preemptions,
        "padding_tokens": result.padding_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "flips": len(result.flips),
    }


def relative_change(
    new: dict[str, Any], base: dict[str, Any], keys: Sequence[str] | None = None
) -> dict[str, float | None]:
    """(new − base) / base per metric (−0.44 = 44% lower); perf/$ as the ratio new / base (1.4 = 1.4×).
    None where the base is 0."""
    out: dict[str, float | None] = {}
    for k in keys or [k for k, _, _ in HEADLINE]:
        b, v = float(base[k]), float(new[k])
        if k == "perf_per_dollar":
            out[k] = v / b if b else None
        else:
            out[k] = (v - b) / b if b else None
    return out
