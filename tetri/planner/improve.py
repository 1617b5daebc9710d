"""The improvement phase: local search on the start order, on the exact executor.

Phase 1 of Sorted-F (`solvers.py`) builds batches by F(X); it is a heuristic, and on some mixes sorting
by size or MC-SF-skip executes better. The improvement phase takes several **seeds** — priority orders,
each executed with the stop rule: Sorted-F's list, and each baseline's *start order* (its requests
sorted by the step they started, which the stop rule executes into the same schedule) — keeps the one
with the lowest total end-to-end latency (TEL), then tries **moves** on it and keeps a move only when
the executed TEL drops:

* *advance*: take the request at position j and put it at position i < j (within `window`);
* *swap*: exchange the requests at positions i < j (within `window`).

Positions are drawn at random (a seeded generator, so a run with the same evaluation count is
repeatable). A move changes nothing before position i: with every request arrived (a backlog) the stop
rule admits strictly in list order, so the schedule of positions < i is the current one and only the
rest is re-executed (`executor.execute_rest`, from the step the request at i − 1 started, with what ran
then), and that run stops as soon as a lower bound on the rest's latency passes the current figure — a
rejected move usually costs a fraction of a full run. With arrivals spread out a move is evaluated by a
whole run. The result is never worse than any seed: a move is kept only when it lowers the TEL.

The search stops after `max_evals` move evaluations (by default `default_evals(n)`: the same count on
any machine, so the same input gives the same plan) or, when the shell opts in to a time limit, when
`budget.spent()` says the time is up (a clock is not the core's to read; the plan then depends on the
machine's speed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .executor import Schedule, execute, execute_rest
from .workload import IntArray, Workload

MOVE_WORK = 50_000  # moves × requests the default search tries: about what a second tried on a 2-core host
MAX_DEFAULT_EVALS = 1_000


def default_evals(n: int) -> int:
    """How many moves the improvement phase tries by default on `n` requests: `MOVE_WORK` // n, at most
    `MAX_DEFAULT_EVALS` (a move's evaluation costs about n steps, so this keeps the search's time near a
    second whatever n; docs/planner.md, "Improvement phase")."""
    return min(MAX_DEFAULT_EVALS, MOVE_WORK // max(1, n))


class Budget:
    """How long the search may go on: `spent()` is True once it must stop. Without a clock, never
    (the evaluation count bounds the search); the shell passes one, e.g. `time.perf_counter`."""

    def __init__(self, seconds: float = 0.0, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        self.until = clock() + seconds if clock is not None else 0.0

    def spent(self) -> bool:
        return self.clock is not None and self.clock() >= self.until


@dataclass
class Improved:
    order: IntArray
    schedule: Schedule
    seed: str  # the seed the search started from
    seed_tel: dict[str, int]  # every seed tried and its TEL
    tel: int
    evaluations: int = 0
    accepted: int = 0
    notes: list[str] = field(default_factory=list)


def start_order(sched: Schedule) -> IntArray:
    """A schedule's requests by start step (ties by index): the order the stop rule replays it in."""
    return np.lexsort((np.arange(len(sched.start)), sched.start)).astype(np.int64)


def tel_of(w: Workload, sched: Schedule) -> int:
    return int((sched.finish - w.a).sum())


class _Search:
    def __init__(self, w: Workload, memory: int, order: IntArray, sched: Schedule) -> None:
        self.w, self.M = w, memory
        self.order = order.copy()
        self.start = sched.start.copy()
        self.finish = sched.finish.copy()
        self.latency = sched.finish - w.a
        self.tel = int(self.latency.sum())
        self.backlog = bool(w.n) and int(w.a.max()) <= int(w.a.min())  # everyone arrives together

    def schedule(self) -> Schedule:
        return Schedule(self.start.copy(), self.finish.copy())

    def try_order(self, new: IntArray, first: int) -> bool:
        """Keep ``new`` (equal to the current order before position ``first``) if it executes better."""
        w = self.w
        if not self.backlog:
            sched = execute(w, self.M, new)
            tel = tel_of(w, sched)
            if tel >= self.tel:
                return False
            self.order, self.start, self.finish, self.tel = new, sched.start.copy(), sched.finish.copy(), tel
            return True
        rest = new[first:]
        t0 = int(self.start[self.order[first - 1]]) if first else int(w.a.min())
        prefix = self.order[:first]
        running = [(int(i), int(self.start[i])) for i in prefix if self.finish[i] > t0]
        old_rest = int((self.finish[rest] - w.a[rest]).sum())
        fin = execute_rest(w, self.M, rest, running, t0, abort_above=old_rest - 1)
        if fin is None:
            return False
        new_rest = int((fin - w.a[rest]).sum())
        if new_rest >= old_rest:
            return False
        self.finish[rest] = fin
        self.start[rest] = fin - w.o[rest]
        self.order = new
        self.tel += new_rest - old_rest
        return True


def improve(
    w: Workload,
    memory: int,
    seeds: Mapping[str, IntArray],
    *,
    budget: Budget | None = None,
    max_evals: int = 100_000,
    window: int = 64,
    seed: int = 0,
) -> Improved:
    """The best seed (by executed TEL), improved by moves until the budget or `max_evals` runs out."""
    budget = budget or Budget()
    if not seeds:
        raise ValueError("the improvement phase needs at least one seed order")
    runs = {name: execute(w, memory, order) for name, order in seeds.items()}
    seed_tel = {name: tel_of(w, s) for name, s in runs.items()}
    best = min(seed_tel, key=lambda k: (seed_tel[k], list(seeds).index(k)))
    search = _Search(w, memory, np.asarray(seeds[best], dtype=np.int64), runs[best])
    rng = np.random.default_rng(seed)
    evals = accepted = 0
    n = w.n
    while n > 1 and evals < max_evals and not budget.spent():
        j = int(rng.integers(1, n))
        i = max(0, j - int(rng.integers(1, min(window, j) + 1)))
        new = search.order.copy()
        if rng.random() < 0.5:  # advance j to i
            new[i + 1 : j + 1] = search.order[i:j]
            new[i] = search.order[j]
        else:  # swap i and j
            new[i], new[j] = search.order[j], search.order[i]
        evals += 1
        if search.try_order(new, i):
            accepted += 1
    return Improved(search.order, search.schedule(), best, seed_tel, search.tel, evals, accepted)
