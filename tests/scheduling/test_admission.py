"""Intra-decode admission (TetriInfer §3.4): greedy, reserve-static, reserve-dynamic and plan.

Memory model (the module's docstring): KV counted in tokens; a request with context c and r tokens
still to produce holds c + k tokens in the k-th next step, k = 1..r, and then frees them. Requests
admitted now start growing in the same next step as the running ones."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tetri.scheduling.admission import ADMISSION_POLICIES, Running, Waiting, admit

SETTINGS = settings(max_examples=100, deadline=None)


def peak(items: Sequence[Running | Waiting]) -> int:
    return sum(x.context + x.remaining for x in items)


def simulate(items: Sequence[Running | Waiting]) -> list[int]:
    """Memory in each future step k = 1.., brute force."""
    horizon = max((x.remaining for x in items), default=0)
    return [sum(x.context + k for x in items if k <= x.remaining) for k in range(1, horizon + 1)]


def pick(waiting: Sequence[Waiting], ids: Sequence[str]) -> list[Waiting]:
    by_id = {w.request_id: w for w in waiting}
    return [by_id[i] for i in ids]


running_st = st.lists(st.builds(Running, st.just(""), st.integers(1, 300), st.integers(1, 300)), max_size=6)
waiting_st = st.lists(st.builds(Waiting, st.just(""), st.integers(1, 300), st.integers(1, 300)), max_size=8)


def named(running: list[Running], waiting: list[Waiting]) -> tuple[list[Running], list[Waiting]]:
    return (
        [Running(f"run{i}", r.context, r.remaining) for i, r in enumerate(running)],
        [Waiting(f"w{i}", w.context, w.remaining) for i, w in enumerate(waiting)],
    )


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_admits_while_the_next_step_fits_and_overcommits_the_future() -> None:
    waiting = [Waiting("a", 10, 80), Waiting("b", 10, 80)]
    assert admit("greedy", [], waiting, capacity=100) == ["a", "b"]  # next step: 22 ≤ 100
    assert max(simulate(waiting)) == 180 > 100  # ... but the batch outgrows memory later
    assert admit("reserve-static", [], waiting, capacity=100) == ["a"]  # peak 180 > 100
    assert admit("reserve-dynamic", [], waiting, capacity=100) == ["a"]  # nobody finishes early


def test_greedy_counts_the_next_step_of_running_requests() -> None:
    running = [Running("r", 50, 1000)]  # holds 51 next step
    assert admit("greedy", running, [Waiting("a", 48, 1)], capacity=100) == ["a"]  # 51 + 49 = 100
    assert admit("greedy", running, [Waiting("a", 49, 1)], capacity=100) == []


@SETTINGS
@given(running=running_st, waiting=waiting_st, capacity=st.integers(1, 3000))
def test_greedy_admitted_batch_fits_the_next_step(
    running: list[Running], waiting: list[Waiting], capacity: int
) -> None:
    running, waiting = named(running, waiting)
    out = admit("greedy", running, waiting, capacity)
    assert out == [w.request_id for w in waiting[: len(out)]]  # a prefix: FCFS
    if out:
        assert simulate([*running, *pick(waiting, out)])[0] <= capacity
    if len(out) < len(waiting):  # the next one would not have fitted
        assert simulate([*running, *waiting[: len(out) + 1]])[0] > capacity


# --- reserve-static -----------------------------------------------------------------------------


def test_reserve_static_counts_running_requests_peak() -> None:
    running = [Running("r", 100, 300)]  # peak 400
    assert admit("reserve-static", running, [Waiting("a", 50, 50)], capacity=500) == ["a"]
    assert admit("reserve-static", running, [Waiting("a", 50, 51)], capacity=500) == []


@SETTINGS
@given(running=running_st, waiting=waiting_st, capacity=st.integers(1, 3000))
def test_reserve_static_never_admits_beyond_the_predicted_peak(
    running: list[Running], waiting: list[Waiting], capacity: int
) -> None:
    running, waiting = named(running, waiting)
    out = admit("reserve-static", running, waiting, capacity)
    assert out == [w.request_id for w in waiting[: len(out)]]
    alone = not running and len(out) == 1  # admitted alone: allowed even if its prediction overflows
    if out and not alone:
        batch: list[Running | Waiting] = [*running, *pick(waiting, out)]
        assert peak(batch) <= capacity
        assert max(simulate(batch)) <= capacity  # hence never a swap, if predictions are right
    if len(out) < len(waiting):
        assert peak([*running, *waiting[: len(out) + 1]]) > capacity or (
            simulate([*running, *waiting[: len(out) + 1]])[0] > capacity
        )


# --- reserve-dynamic ----------------------------------------------------------------------------


def test_reserve_dynamic_admits_more_when_the_shortest_job_finishes_first() -> None:
    running = [Running("short", 100, 10), Running("long", 100, 500)]  # peaks 110 + 600
    waiting = [Waiting("a", 100, 300)]
    capacity = 800  # static: 710 + 400 > 800; within 10 steps: 110 + 110 + 110 ≤ 800
    assert admit("reserve-static", running, waiting, capacity) == []
    assert admit("reserve-dynamic", running, waiting, capacity) == ["a"]
    assert admit("greedy", running, waiting, capacity) == ["a"]


def test_reserve_dynamic_refuses_when_memory_runs_out_before_the_shortest_job_finishes() -> None:
    running = [Running("r", 100, 200), Running("s", 100, 300)]
    waiting = [Waiting("a", 100, 300)]
    # within r_min = 200 steps: 300 + 300 + 300 = 900 > 800
    assert admit("reserve-dynamic", running, waiting, capacity=800) == []
    assert admit("reserve-dynamic", running, waiting, capacity=900) == ["a"]


def test_reserve_dynamic_with_nothing_running_falls_back_to_static() -> None:
    waiting = [Waiting("a", 10, 50), Waiting("b", 10, 50)]
    assert admit("reserve-dynamic", [], waiting, capacity=100) == ["a"]


@SETTINGS
@given(running=running_st, waiting=waiting_st, capacity=st.integers(1, 3000))
def test_reserve_dynamic_never_admits_less_than_static_nor_more_than_greedy(
    running: list[Running], waiting: list[Waiting], capacity: int
) -> None:
    running, waiting = named(running, waiting)
    static = admit("reserve-static", running, waiting, capacity)
    dynamic = admit("reserve-dynamic", running, waiting, capacity)
    greedy = admit("greedy", running, waiting, capacity)
    assert dynamic[: len(static)] == static
    assert greedy[: len(dynamic)] == dynamic
    alone = not running and len(dynamic) == 1  # admitted alone: allowed even if its prediction overflows
    if dynamic and not alone:  # memory suffices until the first job (possibly an admitted one) finishes
        batch: list[Running | Waiting] = [*running, *pick(waiting, dynamic)]
        first_done = min(x.remaining for x in batch)
        assert max(simulate(batch)[:first_done]) <= capacity


def test_reserve_policies_admit_a_lone_request_that_fits_now():
    """A prediction above capacity must not block an idle instance's queue forever; the engine's
    preemption fallback covers a wrong guess."""
    for policy in ("reserve-static", "reserve-dynamic"):
        assert admit(policy, [], [Waiting("big", 10, 500), Waiting("next", 1, 1)], capacity=100) == ["big"]


# --- all of them --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["greedy", "reserve-static", "reserve-dynamic"])
def test_fcfs_a_request_that_does_not_fit_blocks_later_ones(policy: str) -> None:
    waiting = [Waiting("big", 500, 10), Waiting("small", 5, 5)]
    assert admit(policy, [], waiting, capacity=400) == []
    assert admit(policy, [], waiting[1:], capacity=400) == ["small"]


@pytest.mark.parametrize("policy", ADMISSION_POLICIES)
def test_max_running_is_respected(policy: str) -> None:
    running = [Running("r0", 5, 5), Running("r1", 5, 5)]
    waiting = [Waiting(f"w{i}", 5, 5) for i in range(5)]
    plan = [w.request_id for w in waiting]
    assert admit(policy, running, waiting, 10_000, max_running=4, plan_order=plan) == ["w0", "w1"]
    assert admit(policy, running, waiting, 10_000, max_running=2, plan_order=plan) == []
    assert admit(policy, running, waiting, 10_000, max_running=1, plan_order=plan) == []


@pytest.mark.parametrize("policy", ADMISSION_POLICIES)
def test_nothing_waiting(policy: str) -> None:
    assert admit(policy, [Running("r", 5, 5)], [], 100, plan_order=[]) == []


def test_unknown_admission_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="greedy, reserve-static, reserve-dynamic, plan"):
        admit("optimistic", [], [], 100)


# --- plan ---------------------------------------------------------------------------------------


def test_plan_admits_in_plan_order_not_queue_order() -> None:
    waiting = [Waiting("a", 10, 10), Waiting("b", 10, 10), Waiting("c", 10, 10)]
    assert admit("plan", [], waiting, 1000, plan_order=["c", "a", "b"]) == ["c", "a", "b"]


def test_plan_skips_planned_requests_that_have_not_arrived() -> None:
    waiting = [Waiting("a", 10, 10), Waiting("c", 10, 10)]
    assert admit("plan", [], waiting, 1000, plan_order=["a", "b", "c"]) == ["a", "c"]
    assert admit("plan", [], waiting, 1000, plan_order=["b", "c", "a"]) == ["c", "a"]


def test_plan_without_an_order_admits_nothing() -> None:
    assert admit("plan", [], [Waiting("a", 1, 1)], 1000) == []


def test_plan_stops_at_the_first_planned_request_that_does_not_fit() -> None:
    waiting = [Waiting("a", 50, 40), Waiting("b", 50, 40), Waiting("c", 1, 1)]
    assert admit("plan", [], waiting, 100, plan_order=["a", "b", "c"]) == ["a"]


def test_plan_uses_the_future_not_just_the_peak() -> None:
    # a finishes after 10 steps; b starts growing late enough that the two never peak together
    running = [Running("r", 100, 10)]
    waiting = [Waiting("b", 100, 200)]
    capacity = 320  # static: 110 + 300 > 320; step by step: max(200 + 2·10, 300) ≤ 320
    assert admit("reserve-static", running, waiting, capacity) == []
    assert max(simulate([*running, *waiting])) <= capacity
    assert admit("plan", running, waiting, capacity, plan_order=["b"]) == ["b"]


def test_plan_counts_running_requests_like_the_other_policies() -> None:
    running = [Running("r", 10, 10)]  # holds 11..20
    waiting = [Waiting("w", 10, 10)]  # holds 11..20
    assert max(simulate([*running, *waiting])) == 40
    assert admit("reserve-static", running, waiting, capacity=39) == []
    assert admit("plan", running, waiting, capacity=39, plan_order=["w"]) == []  # admits: overflow to 40


def check_plan(
    running: list[Running], waiting: list[Waiting], arrived: list[Waiting], order: list[str], capacity: int
) -> None:
    out = admit("plan", running, arrived, capacity, plan_order=order)
    here = {w.request_id for w in arrived}
    present = [rid for rid in order if rid in here]
    assert out == present[: len(out)]  # plan order among the arrived, none of them skipped
    if len(out) < len(present):  # it stopped: the next planned one here would overflow
        nxt = present[len(out)]
        assert max(simulate([*running, *pick(waiting, [*out, nxt])])) > capacity
    if out:
        assert max(simulate([*running, *pick(waiting, out)])) <= capacity


@st.composite
def plan_case(
    draw: st.DrawFn, with_running: bool
) -> tuple[list[Running], list[Waiting], list[Waiting], list[str], int]:
    running, waiting = named(draw(running_st) if with_running else [], draw(waiting_st))
    order = [w.request_id for w in draw(st.permutations(waiting))]
    missing: set[str] = set()
    some_late = draw(st.booleans())
    if order and some_late:  # some planned requests have not arrived yet
        missing = draw(st.sets(st.sampled_from(order), max_size=2))
    arrived = [w for w in waiting if w.request_id not in missing]
    if draw(st.booleans()):  # a capacity right at the edge of some planned prefix
        j = draw(st.integers(0, len(order)))
        edge = max(simulate([*running, *pick(waiting, order[:j])]), default=1)
        capacity = max(1, edge - draw(st.integers(-2, 6)))
    else:
        capacity = draw(st.integers(1, 3000))
    return running, waiting, arrived, order, capacity


@SETTINGS
@given(case=plan_case(with_running=False))
def test_plan_admitted_set_is_exactly_the_feasible_prefix_of_the_arrived_when_nothing_runs(
    case: tuple[list[Running], list[Waiting], list[Waiting], list[str], int],
) -> None:
    check_plan(*case)


@SETTINGS
@given(case=plan_case(with_running=True))
@example(case=([Running("r", 10, 10)], [w := Waiting("w", 10, 10)], [w], ["w"], 39))
def test_plan_admitted_set_keeps_future_feasibility(
    case: tuple[list[Running], list[Waiting], list[Waiting], list[str], int],
) -> None:
    running = case[0]
    assume(not running or max(simulate(running)) <= case[4])  # the running set itself fits
    check_plan(*case)
