"""Property tests: every policy's schedule is feasible, its TEL recomputes, and no bound exceeds it."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

from tetri.planner.bounds import cheap_bound
from tetri.planner.lp import solve_lp
from tetri.planner.metrics import summarize
from tetri.planner.policies import run_policy

from .checker import check_schedule
from .strategies import workloads

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OFFLINE = ["fcfs", "mcsf", "mcsf-skip", "size", "area", "sorted-f"]


@SETTINGS
@given(workloads())
def test_offline_policies_feasible_and_above_bounds(case):
    w, memory = case
    tels = {}
    for name in OFFLINE:
        for solver in ["dp", "swap", "quantile", "auto"] if name == "sorted-f" else ["auto"]:
            for backfill in [False, True] if name == "sorted-f" else [False]:
                res = run_policy(name, w, memory, solver=solver, backfill=backfill)
                tel = check_schedule(w, memory, res.schedule)
                assert summarize(w, res.schedule)["tel"] == tel
                tels[(name, solver, backfill)] = tel
    lower = cheap_bound(w, memory)
    assert lower <= min(tels.values())
    horizon = min(int(run_policy(n, w, memory).schedule.finish.max()) for n in OFFLINE)
    lp = solve_lp(w, memory, horizon)
    assert lp.bound <= min(tels.values())
    lp_sched = run_policy("sorted-lp", w, memory).schedule
    assert lp.bound <= check_schedule(w, memory, lp_sched)


@SETTINGS
@given(workloads(arrivals=True))
def test_policies_with_arrivals(case):
    w, memory = case
    for name in [*OFFLINE, "sorted-f-online"]:
        res = run_policy(name, w, memory)
        tel = check_schedule(w, memory, res.schedule)
        assert cheap_bound(w, memory) <= tel
    every = run_policy("sorted-f-online", w, memory, replan_every=3)
    check_schedule(w, memory, every.schedule)
    assert every.schedule.replans >= 1


@SETTINGS
@given(workloads(predicted=True))
def test_amin_never_exceeds_memory_with_true_lengths(case):
    w, memory = case
    res = run_policy("sorted-f-amin", w, memory)
    tel = check_schedule(w, memory, res.schedule, allow_evictions=True)
    assert summarize(w, res.schedule)["peak_memory"] <= memory
    assert cheap_bound(w, memory) <= tel


@SETTINGS
@given(workloads())
def test_amin_with_exact_predictions_is_sorted_f(case):
    w, memory = case
    from tetri.planner.workload import Workload

    exact = Workload(w.ids, w.s, w.o, w.a, w.o.copy(), w.o.copy())
    amin = run_policy("sorted-f-amin", exact, memory, solver="dp")
    plain = run_policy("sorted-f", exact, memory, solver="dp")
    assert not amin.schedule.evictions
    assert np.array_equal(amin.schedule.start, plain.schedule.start)
