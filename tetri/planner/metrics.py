"""Latency metrics of a schedule: TEL, average, percentiles, makespan, peak memory."""

from __future__ import annotations

import numpy as np

from .executor import Schedule, memory_trace
from .workload import Workload


def latencies(w: Workload, sched: Schedule) -> np.ndarray:
    return sched.finish - w.a


def summarize(w: Workload, sched: Schedule) -> dict[str, float | int]:
    lat = latencies(w, sched)
    trace = memory_trace(w, sched)
    return {
        "tel": int(lat.sum()),
        "avg_latency": float(lat.mean()),
        "p50_latency": float(np.percentile(lat, 50)),
        "p99_latency": float(np.percentile(lat, 99)),
        "makespan": int(sched.finish.max()),
        "peak_memory": int(trace.max()) if len(trace) else 0,
        "evictions": len(sched.evictions),
    }
