"""The improvement phase: partial runs equal the tail of a whole run, moves never make a plan worse, and
sorted-f --solver auto is never worse than any of its seeds."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetri.planner.executor import execute, execute_rest
from tetri.planner.improve import Budget, improve, start_order, tel_of
from tetri.planner.policies import Improve, run_policy

from .checker import check_schedule
from .strategies import workloads

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(workloads(max_n=14), st.data())
def test_a_partial_run_is_the_tail_of_the_whole_run(case, data):
    w, memory = case
    order = np.array(data.draw(st.permutations(range(w.n))), dtype=np.int64)
    whole = execute(w, memory, order)
    p = data.draw(st.integers(0, w.n - 1))
    t0 = int(whole.start[order[p - 1]]) if p else 0
    running = [(int(i), int(whole.start[i])) for i in order[:p] if whole.finish[i] > t0]
    rest = order[p:]
    fin = execute_rest(w, memory, rest, running, t0)
    assert fin is not None and np.array_equal(fin, whole.finish[rest])
    latency = int((whole.finish[rest] - w.a[rest]).sum())
    assert execute_rest(w, memory, rest, running, t0, abort_above=latency) is not None  # never aborts a run
    assert execute_rest(w, memory, rest, running, t0, abort_above=int(w.o[rest].sum()) - 1) is None  # below Σo


@SETTINGS
@given(workloads(max_n=14), st.data())
def test_improve_never_worse_than_a_seed_and_reports_its_own_schedule(case, data):
    w, memory = case
    seeds = {f"s{k}": np.array(data.draw(st.permutations(range(w.n))), dtype=np.int64) for k in range(3)}
    imp = improve(w, memory, seeds, max_evals=60, seed=data.draw(st.integers(0, 9)))
    assert imp.tel <= min(imp.seed_tel.values())
    assert imp.seed_tel == {k: tel_of(w, execute(w, memory, v)) for k, v in seeds.items()}
    again = execute(w, memory, imp.order)  # the order executes into the reported schedule
    assert np.array_equal(again.start, imp.schedule.start) and tel_of(w, again) == imp.tel
    assert check_schedule(w, memory, again) == imp.tel
    assert imp.accepted <= imp.evaluations <= 60


@SETTINGS
@given(workloads(max_n=12, arrivals=True))
def test_improve_with_arrivals_runs_whole_evaluations_and_stays_exact(case):
    w, memory = case
    seeds = {"fcfs": np.lexsort((np.arange(w.n), w.a)).astype(np.int64)}
    imp = improve(w, memory, seeds, max_evals=40)
    assert imp.tel <= imp.seed_tel["fcfs"]
    assert tel_of(w, execute(w, memory, imp.order)) == imp.tel


@SETTINGS
@given(workloads(max_n=12))
def test_a_skip_schedule_replays_under_the_stop_rule(case):
    """The seeds are start orders; the stop rule replays MC-SF-skip's schedule step for step."""
    w, memory = case
    skip = run_policy("mcsf-skip", w, memory).schedule
    replay = execute(w, memory, start_order(skip))
    assert np.array_equal(replay.start, skip.start)


@SETTINGS
@given(workloads(max_n=12))
def test_auto_is_never_worse_than_its_seed_policies(case):
    w, memory = case
    auto = run_policy("sorted-f", w, memory, improvement=Improve(max_evals=30))
    assert auto.improved is not None and auto.solver.endswith("+improve")
    tel = check_schedule(w, memory, auto.schedule)
    for name, kw in (
        ("area", {}),
        ("size", {}),
        ("mcsf-skip", {}),
        ("sorted-f", {"solver": "swap"}),
        ("sorted-f", {"solver": "quantile"}),
    ):
        assert tel <= tel_of(w, run_policy(name, w, memory, **kw).schedule), name
    flat = np.concatenate(auto.batches)  # the plan's batches are the order, cut where starts change
    assert np.array_equal(execute(w, memory, flat).start, auto.schedule.start)


def test_the_same_evaluation_count_gives_the_same_plan():
    from tetri.planner.generate import Mix, generate

    w = generate(Mix.parse("short:0.8,long:0.2"), 120, seed=2)
    w, _ = w.check_memory(8192, drop_oversized=True)
    a = run_policy("sorted-f", w, 8192, improvement=Improve(max_evals=80, seed=1))
    b = run_policy("sorted-f", w, 8192, improvement=Improve(max_evals=80, seed=1))
    assert a.improved is not None and b.improved is not None
    assert np.array_equal(a.schedule.start, b.schedule.start) and a.improved.evaluations == 80


def test_budget_stops_the_search_on_the_given_clock():
    now = [0.0]
    budget = Budget(2.0, lambda: now[0])
    assert not budget.spent()
    now[0] = 1.999
    assert not budget.spent()
    now[0] = 2.0
    assert budget.spent()
    assert not Budget().spent()  # no clock: the evaluation count bounds the search

    from tetri.planner.generate import Mix, generate

    w = generate(Mix.parse("short"), 60, seed=1)
    ticks = iter(range(10**6))
    res = run_policy("sorted-f", w, 4096, improvement=Improve(Budget(5, lambda: next(ticks)), 10**9))
    assert res.improved is not None and res.improved.evaluations < 10  # five ticks of the fake clock


@SETTINGS
@given(workloads(max_n=10, arrivals=True))
def test_online_auto_is_feasible(case):
    w, memory = case
    res = run_policy("sorted-f-online", w, memory, improvement=Improve(max_evals=5))
    assert res.solver == "swap+area"
    check_schedule(w, memory, res.schedule)


@SETTINGS
@given(workloads(max_n=10, predicted=True))
def test_amin_auto_plans_on_the_ranges_and_stays_within_memory(case):
    w, memory = case
    res = run_policy("sorted-f-amin", w, memory, improvement=Improve(max_evals=20))
    assert res.improved is not None
    check_schedule(w, memory, res.schedule, allow_evictions=True)
