"""An independent feasibility checker, written from the model in docs/planner.md only: it steps
through time one step at a time and shares no code with the executor."""

from __future__ import annotations

from tetri.planner.executor import Schedule
from tetri.planner.workload import Workload


def check_schedule(w: Workload, memory: int, sched: Schedule, allow_evictions: bool = False) -> int:
    """Assert the model's rules; returns the TEL recomputed from scratch."""
    s, o, a = w.s.tolist(), w.o.tolist(), w.a.tolist()
    start, finish = sched.start.tolist(), sched.finish.tolist()
    segments: list[tuple[int, int, int]] = []  # (request, first step, one past last step)
    for i in range(w.n):
        assert start[i] >= a[i], f"request {i} starts at {start[i]} before its arrival {a[i]}"
        assert finish[i] == start[i] + o[i], f"request {i}: finish {finish[i]} != start + o"
        segments.append((i, start[i], finish[i]))
    if sched.evictions:
        assert allow_evictions, "a policy without eviction evicted"
        for i, p, e in sched.evictions:
            assert a[i] <= p < e <= start[i], f"evicted attempt of {i} [{p},{e}) must precede its final start"
            assert e - p < o[i], "an evicted attempt cannot have produced every token"
            segments.append((i, p, e))
    horizon = max(e for _, _, e in segments)
    for tau in range(horizon):
        used = sum(s[i] + tau - p + 1 for i, p, e in segments if p <= tau < e)
        assert used <= memory, f"step {tau}: {used} KV slots > M = {memory}"
    return sum(finish[i] - a[i] for i in range(w.n))
