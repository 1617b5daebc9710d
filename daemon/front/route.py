"""Where a request's attempt starts, and the front's count of what it routed where: the routing half of
the global scheduler (TetriInfer §3.2) on the front's copy of the cluster.

One call into the pure core's rule (`tetri.scheduling.routing.choose_entry`) picks the entry instance; here
is only what a live front adds: waiting a moment when none can take the request now, the routing time
metric, round-robin's turn, and the per-instance count of requests routed and not finished (the load the
rule reads before the next report shows it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from tetri.scheduling.routing import choose_entry

from ..cluster import Cluster, Instance
from ..inflight import Inflight
from ..metrics import Metrics

NO_INSTANCE = "no healthy instance can serve the request (need prefill + decode, or colocated)"


class Router:
    def __init__(
        self,
        cluster: Cluster,
        metrics: Metrics | None = None,
        entry_wait_s: float = 5.0,
        migration_wait_s: float = 30.0,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.entry_wait_s = entry_wait_s
        self.migration_wait_s = migration_wait_s

    def registered(self, model: str) -> bool:
        """Whether instances of the model that could serve a request together are registered, whatever
        their state now (colocated, or prefill and decode)."""
        entry = self.cluster.catalog().get(model)
        roles = frozenset() if entry is None else entry.roles
        return "colocated" in roles or {"prefill", "decode"} <= roles

    async def entry(
        self,
        fl: Inflight,
        exclude: frozenset[str],
        prompt: Sequence[int] = (),
        predicted: tuple[int, int] | None = None,
        split: bool = False,
    ) -> Instance | str:
        """The entry instance for this attempt, or why there is none. A migrating request waits up to
        `migration_wait_s` for one (a worker restarting); a new request up to `entry_wait_s` while its
        model's instances are registered but none can take it now (a load report late on a busy host, a
        flip, a drain), and not at all when they are not. The `prompt` (what the prefix caches hold of it)
        and `predicted` (what is left of the predicted range) choose the instance and colocated or split
        where the model has both; `split` (a decode instance pinned) only split."""
        start = time.monotonic()
        while True:
            inst = self.pick(fl.model, exclude, prompt, predicted, split)
            if inst is not None:
                return inst
            wait = self.migration_wait_s if fl.migrations else self.entry_wait_s * self.registered(fl.model)
            if time.monotonic() - start >= wait or fl.cancelled or fl.interrupted:
                return NO_INSTANCE
            await asyncio.sleep(0.05)

    def pick(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        prompt: Sequence[int] = (),
        predicted: tuple[int, int] | None = None,
        split: bool = False,
    ) -> Instance | None:
        """The entry instance now (`choose_entry` on this front's copy of the cluster), None: none can take
        the request now. Under round-robin, the chosen role's turn advances."""
        started = time.perf_counter()
        cluster, pol = self.cluster, self.cluster.policies
        iid = choose_entry(cluster, pol, model, exclude, prompt, predicted, split)
        if iid is None:
            return None
        inst = cluster.instances[iid]
        if pol.routing == "round-robin":
            cluster.turns[(inst.role, model)] += 1
        if self.metrics is not None:
            self.metrics.route.observe(time.perf_counter() - started)
        return inst

    def serve_on(self, fl: Inflight, inst: Instance) -> None:
        """The request runs on this instance now: counted there (and no longer where it ran)."""
        self.release(fl)
        fl.serving = (inst.id, inst.address)
        fl.counted = inst
        self.cluster.routed(inst, +1)

    def release(self, fl: Inflight) -> None:
        """The request no longer runs where it was counted."""
        if fl.counted is not None:  # that entry, even if re-registered since
            self.cluster.routed(fl.counted, -1)
        fl.counted = None
        fl.serving = None

    def suspect(self, instance_id: str) -> None:
        """A call there failed at the transport: no new work there until it reports again."""
        self.cluster.suspect(instance_id)
