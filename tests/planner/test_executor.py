"""The executor's admission rules on hand-made cases whose schedules can be worked out on paper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from tetri.planner.executor import execute, memory_trace
from tetri.planner.policies import run_policy
from tetri.planner.profile import KVProfile
from tetri.planner.workload import Workload

from .checker import check_schedule
from .strategies import workloads


def test_fcfs_blocks_behind_its_head_and_mcsf_skip_does_not():
    # M = 10. r0 (s=4, o=4) peaks at 8; r1 (s=5, o=1) needs 6 slots; r2 (s=1, o=1) needs 2.
    w = Workload.from_arrays([4, 5, 1], [4, 1, 1])
    fcfs = run_policy("fcfs", w, 10).schedule
    # r0 holds 5, 6, 7, 8 in steps 0-3; r1's 6 slots fit beside none of them, so r1 starts at 4
    # and r2, which would fit at once (5 + 2), waits behind it.
    assert fcfs.start.tolist() == [0, 4, 4]
    mcsf = run_policy("mcsf", w, 10).schedule  # ascending o: r1, r2 (8 slots together), then r0
    assert mcsf.start.tolist() == [1, 0, 0]


def test_skip_scan_passes_a_misfit():
    # M = 12, ascending o: r0 (s=8, o=1) holds 9; r1 (s=8, o=2) misfits beside it (9 + 9).
    # stop: r1 at 1 (9, 10), r2 (s=1, o=3) at 2 (10 + 2, then 3).
    # skip: r2 joins r0 at 0 (9 + 2, then 3, 4), which pushes r1 to 3.
    w = Workload.from_arrays([8, 8, 1], [1, 2, 3])
    stop = run_policy("mcsf", w, 12).schedule
    skip = run_policy("mcsf-skip", w, 12).schedule
    assert stop.start.tolist() == [0, 1, 2]
    assert skip.start.tolist() == [0, 3, 0]


def test_delayed_start_fits_without_a_completion():
    # A running request finishing at step 5 holds 10 + τ + 1 at step τ; a candidate started one step
    # later holds one slot less at that peak: the admission test is exact step by step.
    prof = KVProfile(20)
    prof.add(0, 10, 5, 0)  # holds 11..15 over steps 0..4
    assert not prof.fits(3, 3, 2)  # at τ=4: 15 + (3 + 3) = 21
    assert prof.fits(3, 3, 3)  # at τ=4: 15 + (3 + 2) = 20
    assert prof.earliest_start(3, 3, 2) == 3


def test_backfill_fills_a_gap_without_delaying_the_head():
    # M = 20: r0 runs (s=10, o=6). Head r1 (s=9, o=5) fits only once r0 is done; r2 (s=1, o=2)
    # fits now and is gone before then.
    w = Workload.from_arrays([10, 9, 1], [6, 5, 2])
    order = np.array([0, 1, 2])
    plain = execute(w, 20, order)
    filled = execute(w, 20, order, backfill=True)
    assert plain.start[1] == filled.start[1]
    assert filled.start[2] < plain.start[2]
    check_schedule(w, 20, filled)


def test_memory_trace_counts_growth():
    w = Workload.from_arrays([2], [3])
    sched = execute(w, 10, np.array([0]))
    assert memory_trace(w, sched).tolist() == [3, 4, 5]


def test_arrivals_are_respected():
    w = Workload.from_arrays([1, 1], [2, 2], [0, 7])
    sched = run_policy("fcfs", w, 100).schedule
    assert sched.start.tolist() == [0, 7]


def test_amin_evicts_and_requeues_when_truth_outgrows_the_estimate():
    # Two requests predicted to need 1 output token really need 6: the plan packs both, the truth
    # does not fit (2 + 6 + 2 + 6 = 16 > 12), so one is evicted and restarted.
    w = Workload(("a", "b"), np.array([2, 2]), np.array([6, 6]), np.array([0, 0]), np.array([1, 1]), np.array([1, 1]))
    res = run_policy("sorted-f-amin", w, 12)
    check_schedule(w, 12, res.schedule, allow_evictions=True)
    assert res.schedule.evictions


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_skip_scan_matches_a_naive_step_by_step_scan(case):
    w, memory = case
    order = np.lexsort((np.arange(w.n), w.a, w.o))
    fast = execute(w, memory, order, scan="skip").start.tolist()
    assert fast == naive_skip(w, memory, order.tolist())


def naive_skip(w: Workload, memory: int, order: list[int]) -> list[int]:
    """One step at a time, every waiting request re-tested in order (the definition)."""
    s, o = w.s.tolist(), w.o.tolist()
    start = [-1] * w.n
    t = 0
    while min(start) < 0:
        for i in order:
            if start[i] >= 0:
                continue
            ok = all(
                sum(s[j] + tau - start[j] + 1 for j in range(w.n) if 0 <= start[j] <= tau < start[j] + o[j])
                + s[i]
                + tau
                - t
                + 1
                <= memory
                for tau in range(t, t + o[i])
            )
            if ok:
                start[i] = t
        t += 1
    return start


def test_skip_scan_rejects_an_unsorted_order():
    w = Workload.from_arrays([1, 1], [5, 1])
    with pytest.raises(ValueError, match="non-decreasing"):
        execute(w, 10, np.array([0, 1]), scan="skip")
