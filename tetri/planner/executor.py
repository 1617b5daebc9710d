"""The discrete-step executor: continuous batching under a KV budget M, driven by a priority order.

Every planner policy is "an order + an admission rule" run by this one executor:

* ``scan="stop"`` — each step, admit the first waiting request in priority order while the whole
  future stays within M; the first misfit blocks everything behind it (FCFS, MC-SF, size, Sorted-F).
* ``scan="skip"`` — a misfit is skipped and the scan goes on (``mcsf-skip``).
* ``backfill=True`` (stop only) — while the head is blocked until step T, also admit later requests
  that fit now and finish before T. They vanish before the head's window, so they provably delay
  nothing earlier in the list (see docs/planner.md).
* ``replan`` — a callback that re-orders the waiting set (receding horizon, ``sorted-f-online``).
* ``estimates`` — admission sees only estimated output lengths (``sorted-f-amin``); the true lengths
  are revealed as tokens are produced. An outlived estimate is refined with ``refine``; if the true
  memory would pass M the most recently started request is evicted (its KV dropped) and re-queued.

The executor jumps from event to event instead of stepping: the admission test gives the exact first
step the blocked head fits (`KVProfile.earliest_start`), and completions never change the future
profile, so nothing can change between events.

`execute_rest` runs the same loop on part of a list: the requests still to admit, from step `t0`, with
what already runs pre-loaded, and gives up as soon as a lower bound on their latency passes a limit —
the improvement phase's incremental evaluation (`improve.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .profile import KVProfile
from .waitqueue import INF, WaitQueue
from .workload import IntArray, Workload

Scan = Literal["stop", "skip"]
# replan(waiting request indices, now, running (request, start) pairs) -> the waiting in the new order
Replan = Callable[[IntArray, int, list[tuple[int, int]]], IntArray]
# refine(current estimate, tokens produced so far, request index) -> new estimate (> produced)
Refine = Callable[[int, int, int], int]

BACKFILL_LOOKAHEAD = 64  # candidates examined per event while the head is blocked


@dataclass
class Schedule:
    """Start and completion step per request (index order of the workload) plus evicted attempts."""

    start: IntArray
    finish: IntArray
    evictions: list[tuple[int, int, int]] = field(default_factory=list)  # (request, start, stop)
    events: int = 0
    replans: int = 0


def doubling_refine(hi: IntArray | None) -> Refine:
    """Raise an outlived estimate to min(hi, 2·estimate); past hi (a missed prediction), double it."""

    def refine(est: int, produced: int, i: int) -> int:
        cap = int(hi[i]) if hi is not None else 0
        new = min(cap, 2 * est) if est < cap else 2 * est
        return max(new, produced + 1)

    return refine


class _Run:
    def __init__(
        self,
        w: Workload,
        memory: int,
        order: IntArray,
        scan: Scan,
        backfill: bool,
        replan: Replan | None,
        replan_every: int | None,
        estimates: IntArray | None,
        refine: Refine | None,
        running: Sequence[tuple[int, int]] = (),
        t0: int | None = None,
        abort_above: int | None = None,
    ) -> None:
        if (running or abort_above is not None) and (scan != "stop" or replan or estimates is not None):
            raise ValueError("a partial run (running set, abort limit) takes the plain stop scan only")
        if scan == "skip" and (backfill or replan is not None):
            raise ValueError("backfill and re-planning apply to the stop scan only")
        if replan is not None and estimates is not None:
            raise ValueError("re-planning with estimated lengths is not supported")
        admit_len = estimates if estimates is not None else w.o
        if scan == "skip" and np.any(np.diff(admit_len[np.asarray(order)]) < 0):
            raise ValueError("the skip scan needs an order by non-decreasing output length")
        self.w, self.M = w, memory
        self.s = w.s.tolist()
        self.o = w.o.tolist()
        self.a = w.a.tolist()
        self.scan, self.backfill = scan, backfill
        self.replan, self.replan_every = replan, replan_every
        self.amin = estimates is not None
        self.est = (estimates if estimates is not None else w.o).tolist()
        self.refine = refine or doubling_refine(w.hi)
        self.prof = KVProfile(memory)  # what admission sees (estimates under amin)
        self.truth = KVProfile(memory) if self.amin else self.prof
        n = w.n
        self.start = [-1] * n
        self.finish = [-1] * n
        self.evictions: list[tuple[int, int, int]] = []
        members = np.asarray(order, dtype=np.int64).tolist()
        self.remaining = len(members)
        self.events = 0
        self.replans = 0
        self.arrivals = sorted(members, key=lambda i: (self.a[i], i))
        self.t0 = t0
        for i, p in running:  # already admitted (a partial run): they hold their KV, not in the order
            self.prof.add(i, self.s[i], self.o[i], p)
        # abort limit: Σ (finish − arrival) of those started + Σ (o − a) of the rest + rest × next step
        self.abort_above = abort_above
        self.done_latency = 0
        self.rest_o_minus_a = sum(self.o[i] - self.a[i] for i in members)
        self.next_arrival = 0  # pointer into arrivals: first not yet seen
        self.pending_replan = False
        self.last_replan = -INF
        self.arrived_waiting: set[int] = set()  # for re-planning only
        self._set_order(np.asarray(order, dtype=np.int64))

    # --- priority order --------------------------------------------------------------------------
    def _set_order(self, order: IntArray) -> None:
        self.order = order.tolist()
        self.pos = {i: p for p, i in enumerate(self.order)}
        vals = [self.a[i] if self.start[i] < 0 else INF for i in self.order]
        self.queue = WaitQueue(vals)
        if self.scan == "skip":
            self.next_seen_skip = 0
            self.squeue = WaitQueue([INF] * len(self.order))
        if self.backfill:
            self.oq = WaitQueue([self.est[i] if self.start[i] < 0 else INF for i in self.order])

    def _maybe_replan(self, t: int) -> None:
        """Receding horizon: the new order holds only the arrived, waiting requests; later arrivals
        join at the next re-plan (at their arrival, or within K steps)."""
        if self.replan is None or not self.pending_replan:
            return
        if self.replan_every is not None and t < self.last_replan + self.replan_every:
            return
        waiting = np.array(sorted(self.arrived_waiting), dtype=np.int64)
        running = [(i, self.start[i]) for i in self.prof.ids()]
        self._set_order(np.asarray(self.replan(waiting, t, running), dtype=np.int64) if len(waiting) else waiting)
        self.pending_replan = False
        self.last_replan = t
        self.replans += 1

    # --- state changes ---------------------------------------------------------------------------
    def _begin(self, i: int, t: int) -> None:
        self.start[i] = t
        self.arrived_waiting.discard(i)
        p = self.pos[i]
        self.queue.set(p, INF)
        if self.scan == "skip":
            self.squeue.set(p, INF)
        if self.backfill:
            self.oq.set(p, INF)
        self.prof.add(i, self.s[i], self.est[i], t)
        if self.amin:
            self.truth.add(i, self.s[i], self.o[i], t)
        else:
            self.finish[i] = t + self.o[i]
            self.remaining -= 1
            self.done_latency += t + self.o[i] - self.a[i]
            self.rest_o_minus_a -= self.o[i] - self.a[i]

    def _evict(self, i: int, t: int) -> None:
        self.evictions.append((i, self.start[i], t))
        self.truth.remove(i)
        self.prof.remove(i)
        self.est[i] = max(self.est[i], t - self.start[i] + 1)
        self.start[i] = -1
        self.queue.set(self.pos[i], t)
        if self.scan == "skip":
            self.squeue.set(self.pos[i], self.s[i])
        if self.backfill:
            self.oq.set(self.pos[i], self.est[i])

    def _amin_events(self, t: int) -> None:
        for i in self.truth.advance(t):
            self.finish[i] = self.start[i] + self.o[i]
            self.remaining -= 1
            self.prof.remove(i)
        for i in self.prof.advance(t):  # estimate ran out but the request is still producing
            produced = t - self.start[i]
            new = min(self.refine(self.est[i], produced, i), self.M - self.s[i])
            self.est[i] = max(new, produced + 1)
            self.prof.add(i, self.s[i], self.est[i], self.start[i])
        while self.truth.first_overflow(t) == t:
            victim = max(self.truth.ids(), key=lambda j: (self.start[j], j))
            self._evict(victim, t)

    # --- admission -------------------------------------------------------------------------------
    def _admit_stop(self, t: int) -> int:
        """Admit in order until the head misfits; returns the next step worth looking at."""
        q, prof, s, est, order = self.queue, self.prof, self.s, self.est, self.order
        head = q.first_leq(t)
        while head is not None:
            i = order[head]
            if not prof.fits(s[i], est[i], t):
                break
            self._begin(i, t)
            head = q.first_leq(t, head + 1)
        if head is None:
            return INF
        i = order[head]
        wake = prof.earliest_start(s[i], est[i], t)
        if self.backfill and wake > t + 1:
            self._backfill(t, head, wake)
        return wake

    def _backfill(self, t: int, head: int, wake: int) -> None:
        window = wake - t  # a candidate with o ≤ window is gone before the head's first step
        pos, looked = head + 1, 0
        while looked < BACKFILL_LOOKAHEAD:
            p = self.oq.first_leq(window, pos)
            if p is None:
                return
            i = self.order[p]
            looked += 1
            if self.a[i] <= t and self.prof.fits(self.s[i], self.est[i], t):
                self._begin(i, t)
            pos = p + 1

    def _admit_skip(self, t: int) -> int:
        """Scan in order, skipping misfits. The order is by non-decreasing o, so a request behind a
        misfit (s_f, o_f) with s ≥ s_f is dominated and cannot fit either: the scan only visits the
        running minima of s (a short staircase), and the next event is a lower bound on the earliest
        step any misfit fits, which no dominated request can beat."""
        sq, prof, s, est, order = self.squeue, self.prof, self.s, self.est, self.order
        while self.next_seen_skip < self.w.n and self.a[self.arrivals[self.next_seen_skip]] <= t:
            i = self.arrivals[self.next_seen_skip]
            if self.start[i] < 0:
                sq.set(self.pos[i], s[i])
            self.next_seen_skip += 1
        misfits: list[int] = []
        p = sq.first_leq(INF - 1)
        while p is not None:
            i = order[p]
            if prof.fits(s[i], est[i], t):
                self._begin(i, t)
                p = sq.first_leq(INF - 1 if not misfits else s[misfits[-1]] - 1, p + 1)
            else:
                misfits.append(i)
                p = sq.first_leq(s[i] - 1, p + 1)
        if not misfits:
            return INF
        # A misfit with s ≥ the slots free now cannot start before a completion frees some (usage
        # only grows until then); the others get their exact earliest step.
        free = self.M - prof.usage_now(t)
        nxt = prof.next_completion() or INF
        for i in misfits:
            if s[i] < free:
                nxt = min(nxt, prof.earliest_start(s[i], est[i], t))
        return nxt

    # --- main loop -------------------------------------------------------------------------------
    def run(self) -> Schedule | None:
        """The schedule; None when a partial run's latency bound passed its abort limit."""
        n = len(self.arrivals)
        t = self.t0 if self.t0 is not None else (self.a[self.arrivals[0]] if n else 0)
        if self.abort_above is not None and self.rest_o_minus_a + self.remaining * t > self.abort_above:
            return None
        while self.remaining > 0:
            self.events += 1
            while self.next_arrival < n and self.a[self.arrivals[self.next_arrival]] <= t:
                if self.replan is not None:
                    self.arrived_waiting.add(self.arrivals[self.next_arrival])
                self.next_arrival += 1
                self.pending_replan = True
            if self.amin:
                self._amin_events(t)
            else:
                self.prof.advance(t)
            self._maybe_replan(t)
            wake = self._admit_stop(t) if self.scan == "stop" else self._admit_skip(t)
            nxt = wake
            if self.next_arrival < n:
                nxt = min(nxt, self.a[self.arrivals[self.next_arrival]])
            if self.replan is not None and self.pending_replan and self.replan_every is not None:
                nxt = min(nxt, self.last_replan + self.replan_every)
            if self.amin:
                for cand in (self.truth.next_completion(), self.prof.next_completion()):
                    if cand is not None:
                        nxt = min(nxt, cand)
                over = self.truth.first_overflow(t + 1)
                if over is not None:
                    nxt = min(nxt, over)
            if self.remaining == 0:
                break
            if nxt >= INF:
                raise RuntimeError("executor stalled: a waiting request can never start")  # a bug
            t = max(nxt, t + 1)
            # every request not yet started starts at t or later
            if self.abort_above is not None and self.done_latency + self.rest_o_minus_a + self.remaining * t > (
                self.abort_above
            ):
                return None
        return Schedule(
            np.array(self.start, dtype=np.int64),
            np.array(self.finish, dtype=np.int64),
            self.evictions,
            self.events,
            self.replans,
        )


def execute(
    w: Workload,
    memory: int,
    order: IntArray,
    *,
    scan: Scan = "stop",
    backfill: bool = False,
    replan: Replan | None = None,
    replan_every: int | None = None,
    estimates: IntArray | None = None,
    refine: Refine | None = None,
) -> Schedule:
    """Run ``w`` under budget ``memory`` admitting in ``order`` (a permutation of request indices)."""
    if sorted(np.asarray(order).tolist()) != list(range(w.n)):
        raise ValueError("order must be a permutation of the request indices")
    sched = _Run(w, memory, order, scan, backfill, replan, replan_every, estimates, refine).run()
    assert sched is not None  # no abort limit
    return sched


def execute_rest(
    w: Workload,
    memory: int,
    rest: IntArray,
    running: Sequence[tuple[int, int]],
    t0: int,
    abort_above: int | None = None,
) -> IntArray | None:
    """The finish steps of ``rest`` (requests not yet admitted, in priority order) admitted with the stop
    rule from step ``t0``, while ``running`` ((request, start) pairs) hold their KV; None as soon as their
    total latency is sure to pass ``abort_above``. Equal to the tail of a whole run when every request
    of ``rest`` has arrived by ``t0`` and ``running`` is what the whole run had running at ``t0``."""
    sched = _Run(w, memory, rest, "stop", False, None, None, None, None, running, t0, abort_above).run()
    return None if sched is None else sched.finish[np.asarray(rest, dtype=np.int64)]


def memory_trace(w: Workload, sched: Schedule) -> IntArray:
    """True KV usage per step 0..makespan-1 (evicted attempts included), from difference arrays."""
    segs = [(i, int(sched.start[i]), int(sched.finish[i])) for i in range(w.n)]
    segs += list(sched.evictions)
    horizon = max((e for _, _, e in segs), default=0)
    const = np.zeros(horizon + 2, dtype=np.int64)
    slope = np.zeros(horizon + 2, dtype=np.int64)
    for i, p, e in segs:
        const[p] += int(w.s[i]) - p + 1
        const[e] -= int(w.s[i]) - p + 1
        slope[p] += 1
        slope[e] -= 1
    tau = np.arange(horizon + 2, dtype=np.int64)
    return (np.cumsum(const) + tau * np.cumsum(slope))[:horizon]
