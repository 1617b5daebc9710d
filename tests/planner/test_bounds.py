"""Lower bounds against the true optimum of tiny instances, found by exhaustive search."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.planner.bounds import best_bound, cheap_bound
from tetri.planner.lp import LPTooLarge, solve_lp
from tetri.planner.policies import run_policy
from tetri.planner.workload import Workload


def brute_optimal_tel(w: Workload, memory: int) -> int:
    s, o, a = w.s.tolist(), w.o.tolist(), w.a.tolist()
    horizon = max(a) + sum(o)  # an optimal schedule never idles after the last arrival
    best = None
    for starts in itertools.product(*[range(a[i], horizon) for i in range(w.n)]):
        tel = sum(starts[i] + o[i] - a[i] for i in range(w.n))
        if best is not None and tel >= best:
            continue
        ok = all(
            sum(s[i] + t - starts[i] + 1 for i in range(w.n) if starts[i] <= t < starts[i] + o[i]) <= memory
            for t in range(horizon + max(o))
        )
        if ok:
            best = tel
    assert best is not None
    return best


@st.composite
def tiny(draw):
    n = draw(st.integers(1, 3))
    s = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    o = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    a = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    memory = draw(st.integers(max(x + y for x, y in zip(s, o, strict=True)), 12))
    return Workload.from_arrays(s, o, a), memory


@settings(max_examples=80, deadline=None)
@given(tiny())
def test_bounds_below_optimum_and_policies_above(case):
    w, memory = case
    opt = brute_optimal_tel(w, memory)
    assert cheap_bound(w, memory) <= opt
    for horizon in (1, 3, int(w.a.max() + w.o.sum())):
        assert solve_lp(w, memory, horizon).bound <= opt  # valid for any horizon
    for name in ("fcfs", "mcsf", "mcsf-skip", "size", "sorted-f", "sorted-lp"):
        assert int((run_policy(name, w, memory).schedule.finish - w.a).sum()) >= opt


def test_lp_beats_cheap_bound_on_a_contended_instance():
    rng = np.random.default_rng(7)
    w = Workload.from_arrays(rng.integers(1, 30, 25), rng.integers(1, 20, 25))
    horizon = int(run_policy("sorted-f", w, 80).schedule.finish.max())
    b = best_bound(w, 80, horizon)
    assert b.method == "lp" and b.lp is not None and b.lp >= b.cheap


def test_lp_refuses_huge_instances_and_cheap_bound_stands_in():
    w = Workload.from_arrays([100] * 400, [2000] * 400)
    b = best_bound(w, 1_000_000, horizon=100_000)
    assert b.method == "cheap" and "too large" in b.detail
    try:
        solve_lp(w, 1_000_000, 100_000)
    except LPTooLarge:
        pass
    else:  # pragma: no cover
        raise AssertionError("expected LPTooLarge")
