"""The planner's policies: each is a priority order plus the executor's admission rule.

Names (stable; the CLI and plan files use them):

=================  ==========================================================================
fcfs               arrival order (ties by file order), stop at the first misfit
mcsf               ascending o_i (Jaillet et al.'s MC-SF), stop at the first misfit
mcsf-skip          ascending o_i, skip misfits and keep scanning
size               ascending s_i + o_i, stop at the first misfit
area               ascending s_i·o_i + o_i(o_i+1)/2 (the KV slot-steps a request holds), stop rule
sorted-f           Sorted-F: phase-1 batches by F(X), each by non-decreasing o; stop rule. With
                   solver ``auto``, then the improvement phase (`improve.py`): the best of the
                   phase-1 lists (auto's, swap, quantile) and the area, size and MC-SF-skip start
                   orders (always built), improved by moves while the budget lasts
sorted-lp          requests by LP-relaxation completion, stop rule
sorted-f-amin      Sorted-F planned on the predicted lower bounds; the executor reveals true
                   lengths; outlived estimates refined, evictions keep memory within M. With
                   solver ``auto`` the improvement phase orders by the ranges' upper ends
sorted-f-online    receding horizon: Sorted-F re-planned over the waiting set at arrivals (or
                   every K steps); with solver ``auto`` a re-plan keeps phase 1's order or the area
                   order, whichever serves the waiting set sooner from what runs then (compared
                   while the improvement budget lasts; then the last winner)
=================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .bounds import area
from .executor import Schedule, execute, execute_rest
from .improve import Budget, Improved, improve, start_order
from .lp import LPTooLarge, lp_order, solve_lp
from .names import POLICIES
from .solvers import SWAP_MAX_N, Progress, sorted_f_phase1
from .workload import IntArray, Workload, WorkloadError


@dataclass
class PolicyResult:
    policy: str
    schedule: Schedule
    solver: str | None = None
    batches: list[IntArray] = field(default_factory=list)
    iterations: int = 0
    backfill: bool = False
    improved: Improved | None = None  # the improvement phase's account (sorted-f with solver auto)


@dataclass(frozen=True)
class Improve:
    """How far the improvement phase may search: a time budget (the shell's clock) and a move count.
    The default tries no moves: the best seed only."""

    budget: Budget = field(default_factory=Budget)
    max_evals: int = 0
    seed: int = 0


def _by(*keys: IntArray) -> IntArray:
    return np.lexsort(keys[::-1]).astype(np.int64)


def check_policy(name: str) -> None:
    if name not in POLICIES:
        raise WorkloadError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")


def run_policy(
    name: str,
    w: Workload,
    memory: int,
    *,
    solver: str = "auto",
    backfill: bool = False,
    replan_every: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    improvement: Improve | None = None,
) -> PolicyResult:
    """Plan and execute ``w`` under budget ``memory`` with policy ``name``. With solver auto, an
    ``improvement`` turns on sorted-f's improvement phase (and its counterparts in sorted-f-amin and
    sorted-f-online) within its bounds; without one, phase 1 alone (the CLI always passes one)."""
    check_policy(name)
    idx = np.arange(w.n, dtype=np.int64)
    if name == "fcfs":
        return PolicyResult(name, execute(w, memory, _by(w.a, idx)))
    if name in ("mcsf", "mcsf-skip"):
        order = _by(w.o, w.a, idx)
        sched = execute(w, memory, order, scan="skip") if name == "mcsf-skip" else execute(w, memory, order)
        return PolicyResult(name, sched)
    if name == "size":
        return PolicyResult(name, execute(w, memory, _by(w.s + w.o, w.a, idx)))
    if name == "area":
        return PolicyResult(name, execute(w, memory, _by(area(w), w.a, idx)))
    if name == "sorted-f":
        p1 = sorted_f_phase1(w.s, w.o, memory, solver, seed, progress)
        if solver != "auto" or backfill or improvement is None:  # (the improvement phase runs the stop rule)
            sched = execute(w, memory, p1.order, backfill=backfill)
            return PolicyResult(name, sched, p1.solver, p1.batches, p1.iterations, backfill)
        return _improved(w, memory, p1.order, p1.solver, p1.iterations, improvement)
    if name == "sorted-lp":
        horizon = int(run_policy("sorted-f", w, memory, solver=solver).schedule.finish.max())
        try:
            sol = solve_lp(w, memory, horizon)
        except LPTooLarge as e:
            raise WorkloadError(f"sorted-lp: instance too large: {e}") from None
        return PolicyResult(name, execute(w, memory, lp_order(sol), backfill=backfill), "lp", [], 1, backfill)
    if name == "sorted-f-amin":
        if w.lo is None or w.hi is None:
            raise WorkloadError("sorted-f-amin needs 'predicted_output' on every request")
        est = np.minimum(w.lo, memory - w.s)  # no request outgrows M (s + o ≤ M is checked)
        if solver != "auto" or backfill or improvement is None:
            p1 = sorted_f_phase1(w.s, est, memory, solver, seed, progress)
            sched = execute(w, memory, p1.order, estimates=est, backfill=backfill)
            return PolicyResult(name, sched, p1.solver, p1.batches, p1.iterations, backfill)
        # auto: phase 1 and the improvement phase see what the planner may see, the predicted ranges, taken
        # at their upper ends (against the lower ends and the midpoints, docs/planner.md: it executes best);
        # the executor admits on the lower ends as ever
        view = np.minimum(w.hi, memory - w.s)
        p1 = sorted_f_phase1(w.s, view, memory, solver, seed, progress)
        planned = _improved(
            Workload(w.ids, w.s, view, w.a), memory, p1.order, p1.solver, p1.iterations, improvement or Improve()
        )
        order = np.concatenate(planned.batches) if planned.batches else np.empty(0, dtype=np.int64)
        sched = execute(w, memory, order, estimates=est)
        return PolicyResult(name, sched, planned.solver, planned.batches, planned.iterations, False, planned.improved)

    # sorted-f-online
    online_solver = solver if solver != "auto" else "swap"
    used: dict[str, int] = {"iterations": 0, "compared": 0}
    areas = area(w)
    how = improvement or Improve()  # (unused without one: phase 1 only)
    prefer = ["phase 1"]  # the last comparison's winner, kept once the budget is spent

    def replan(waiting: IntArray, now: int, running: list[tuple[int, int]]) -> IntArray:
        chosen = online_solver if online_solver != "swap" or len(waiting) <= SWAP_MAX_N else "quantile"
        p1 = sorted_f_phase1(w.s[waiting], w.o[waiting], memory, chosen, seed + now)
        used["iterations"] += p1.iterations
        orders = {"phase 1": waiting[p1.order]}
        if solver != "auto" or improvement is None:
            return orders["phase 1"]
        # auto: phase 1's order or the area order, whichever serves the waiting set sooner from what runs
        # now (later arrivals unseen, as ever online) — compared while the improvement budget lasts
        orders["area"] = waiting[np.lexsort((waiting, areas[waiting]))]
        if used["compared"] < how.max_evals and not how.budget.spent():
            used["compared"] += 1
            cost = {}
            for label, cand in orders.items():
                fin = execute_rest(w, memory, cand, running, now)
                assert fin is not None
                cost[label] = int(fin.sum())
            prefer[0] = "area" if cost["area"] < cost["phase 1"] else "phase 1"
        return orders[prefer[0]]

    sched = execute(w, memory, _by(w.a, idx), replan=replan, replan_every=replan_every, backfill=backfill)
    label = online_solver + ("+area" if used["compared"] else "")
    return PolicyResult(name, sched, label, [], used["iterations"] + used["compared"], backfill)


def _improved(w: Workload, memory: int, order: IntArray, solver: str, iterations: int, how: Improve) -> PolicyResult:
    """Sorted-F's lists (auto's solver, swap, quantile) and the cheap baselines' start orders as seeds
    (MC-SF-skip's up to 5,000 requests), then moves (`improve.py`) while the budget lasts."""
    idx = np.arange(w.n, dtype=np.int64)
    seeds: dict[str, IntArray] = {f"sorted-f ({solver})": order}
    makers: list[tuple[str, Callable[[], IntArray]]] = [
        ("area", lambda: _by(area(w), w.a, idx)),
        ("size", lambda: _by(w.s + w.o, w.a, idx)),
    ]

    def phase1(other: str) -> Callable[[], IntArray]:
        return lambda: sorted_f_phase1(w.s, w.o, memory, other).order

    for other in ("swap", "quantile"):  # the other phase-1 solvers that scale (dp only as auto's choice)
        if other != solver and (other != "swap" or w.n <= SWAP_MAX_N):
            makers.append((f"sorted-f ({other})", phase1(other)))
    if w.n <= SWAP_MAX_N:  # the skip scan is the slowest baseline (17 s for 100,000 requests)
        makers.append(("mcsf-skip", lambda: start_order(run_policy("mcsf-skip", w, memory).schedule)))
    for label, make in makers:  # always, whatever the budget: it bounds the moves
        seeds[label] = make()
    imp = improve(w, memory, seeds, budget=how.budget, max_evals=how.max_evals, seed=how.seed)
    batches = _start_groups(imp.order, imp.schedule)
    return PolicyResult(
        "sorted-f", imp.schedule, f"{solver}+improve", batches, iterations + imp.evaluations, False, imp
    )


def _start_groups(order: IntArray, sched: Schedule) -> list[IntArray]:
    """An order cut where the start step changes: the requests admitted together, in order."""
    starts = sched.start[order]
    cuts = np.flatnonzero(np.diff(starts)) + 1
    return [np.asarray(g, dtype=np.int64) for g in np.split(order, cuts)]


def run_order(w: Workload, memory: int, order: IntArray, backfill: bool = False) -> Schedule:
    """Execute a given list (a plan's batches, flattened) with the stop rule."""
    return execute(w, memory, order, backfill=backfill)
