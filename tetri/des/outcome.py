"""How a simulated setup did on a workload, and how setups rank: the one scoring `tetrictl advise` and the
`advise` flip policy's model share (goodput within the SLOs at the offered rate, then the lower mean JCT).

Pure: a run's records in, plain numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .metrics import summarize
from .records import RunResult
from .slo import SloSet
from .workloads import Request


def offered_rate(requests: Sequence[Request]) -> float | None:
    """Requests per second over the arrival span; None when they all arrive at once."""
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    return (len(requests) - 1) / span if span > 0 and len(requests) > 1 else None


def outcome(result: RunResult, slo: SloSet, price: float, rate: float | None) -> dict[str, Any]:
    """What a setup gives on the workload: goodput (module docstring), latency percentiles, $ per M tokens;
    the bench's `summarize` gives the share within the SLOs, the p99s, the JCT and the cost."""
    m = summarize(result, price, slo)
    reqs = result.requests
    tpots = [r.tpot for r in reqs if r.output_len > 1]
    tokens = sum(r.output_len for r in reqs)
    return {
        "goodput_rps": (rate if rate is not None else result.offered / result.makespan) * m["slo_attainment"],
        "within_slo": m["slo_attainment"],
        "rejected": m["rejected"],
        "p50_ttft_s": float(np.percentile([r.ttft for r in reqs], 50)) if reqs else 0.0,
        "p99_ttft_s": m["p99_ttft_s"],
        "p50_tpot_s": float(np.percentile(tpots, 50)) if tpots else 0.0,
        "p99_tpot_s": m["p99_tpot_s"],
        "avg_jct_s": m["avg_jct_s"],
        "usd_per_m_tokens": m["cost_usd"] / tokens * 1e6 if tokens else 0.0,
        "makespan_s": m["makespan_s"],
    }


def score(o: dict[str, Any]) -> tuple[float, float]:
    """How setups rank: goodput, then the lower mean JCT."""
    return (round(o["goodput_rps"], 9), -o["avg_jct_s"])
