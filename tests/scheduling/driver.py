"""Drives an `InstanceScheduler` as an engine does, for the property tests: one iteration in flight at a
time (`step`: plan one, or complete the one in flight), and `finish_all`, the liveness check — with the
plan left as it is, release what is held and load what is pulled until every request is gone. `LIFECYCLE`:
the operations both draw from besides their own."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from tetri.scheduling.instance import InstanceScheduler, IterationPlan, Outcome, Phase

# the operations on requests already added (an index into them), and iterations (3 in 6: most runs finish)
LIFECYCLE = (
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("loaded"), st.integers(0, 50)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
)


class Driver:
    def __init__(
        self,
        s: InstanceScheduler,
        now: Callable[[], float] = lambda: 0.0,
        on_plan: Callable[[IterationPlan], None] = lambda plan: None,
        on_done: Callable[[IterationPlan, Outcome], None] = lambda plan, out: None,
    ) -> None:
        self.s, self.now, self.on_plan, self.on_done = s, now, on_plan, on_done
        self.inflight: IterationPlan | None = None

    def step(self) -> None:
        """Plan an iteration when none is in flight (`on_plan` sees it), else complete it (`on_done`)."""
        if self.inflight is None:
            plan = self.s.schedule(self.now())
            if plan is not None:
                self.on_plan(plan)
                self.inflight = plan if plan.pieces else None
            return
        plan, self.inflight = self.inflight, None
        self.on_done(plan, self.s.complete(plan))

    def finish_all(self, ids: list[str], after: Callable[[], None] = lambda: None) -> None:
        """Run until nothing is left, loading what each plan pulls and, when nothing can be planned,
        releasing what is held and loading what is loading; `check()` and `after` after each turn."""
        s = self.s
        for _ in range(20_000):
            if self.inflight is not None:
                self.step()
            else:
                plan = s.schedule(self.now())
                for rid in plan.pulled if plan is not None else ():
                    s.loaded(rid)
                if plan is not None and plan.pieces:
                    self.inflight = plan
                elif plan is None:
                    held = [rid for rid in ids if s.phase(rid) in (Phase.HELD, Phase.LOADING)]
                    if not held:
                        break
                    for rid in held:
                        (s.release if s.phase(rid) is Phase.HELD else s.loaded)(rid)
            s.check()
            after()
