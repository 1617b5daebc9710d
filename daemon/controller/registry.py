"""The controller's registry (TetriInfer §3.2's cluster monitor): registrations, load reports, health, cordons,
flips and the decode-load broadcast, over the cluster both rooms hold (`daemon.cluster.Cluster`).

Workers stream a load report every report interval; a report is answered with the decode load (what
prefill dispatchers choose from; other roles get the policies only), built at most every half interval
and only when a decode instance's load changed; the gRPC edge sends a stream only an answer newer than
the last it sent there. A report's batch of prefix-cache events feeds the index (`cache`): a registration
starts the instance's entry afresh (the worker's next report carries its whole cache), a removal drops it;
fronts follow the index's changes through their view stream (`daemon.controller.edge`).
An instance that misses `unhealthy_after` intervals is marked unhealthy and gets no new work until it
reports again. A cordoned instance (`cordon`: the admin API's `POST /api/v1/instances/{id}/cordon`) gets
no new work either — no new prompts, no new hand-overs (broadcasts and fronts' views show it `cordoned`)
— whatever it reports, until `uncordon`; what runs there runs to completion. The flag lives in this
registry only: it survives a re-registration, and the instance's removal (it comes back cordoned), not
a restart of the daemon.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable

from tetri.clock import ClusterClock
from tetri.scheduling.cacheindex import CacheEvents
from tetri.scheduling.flip import ROLES as FLIP_ROLES
from tetri.scheduling.flip import leaves_unserved
from tetri.scheduling.policyset import PolicySet

from ..cluster import (
    Cluster,
    ClusterView,
    DecodeBroadcast,
    DecodeInstanceLoad,
    Instance,
    InstanceState,
    LoadReport,
    Registration,
    says_more,
)
from ..db.writer import BatchWriter

log = logging.getLogger(__name__)


class Registry(Cluster):
    def __init__(
        self,
        report_interval_s: float,
        unhealthy_after: int,
        writer: BatchWriter | None = None,
        sample_every: int = 10,
        clock: ClusterClock | None = None,
        dead_after_s: float = 10.0,
    ) -> None:
        super().__init__(report_interval_s, unhealthy_after, clock)
        self.writer = writer
        self.sample_every = sample_every
        self.dead_after_s = dead_after_s
        # the broadcast, built at most once per half report interval (and at once after a change of the
        # registry, of a state or role, or of the policies): each report is answered with it, so the daemon's
        # work per interval is O(instances), not O(instances²) as when every answer was built afresh
        self._broadcast: tuple[DecodeBroadcast, DecodeBroadcast] | None = None
        self._built_at = 0.0
        self._news_at: float | None = None  # when a decode instance first reported what the broadcast lacks
        # told, at each rebuild that shows news, the wall seconds since the first report it shows
        self.on_broadcast: Callable[[float], None] | None = None
        self.started = self.clock.now()

    def invalidate(self) -> None:
        self._broadcast = None
        super().invalidate()

    def refusal(self, reg: Registration) -> str | None:
        """Why this registration is refused: malformed, or its id is held by another live worker (one at
        another address that reported within the health limit; a failed call alone does not free the
        id). A worker re-registering itself is accepted."""
        old = self.instances.get(reg.instance_id)
        limit = self.clock.model_seconds(self.unhealthy_after * self.report_interval_s)
        if old is not None and old.address != reg.address and self.clock.now() - old.last_report <= limit:
            return f"instance id {reg.instance_id!r} is held by a live worker at {old.address}"
        return reg.refusal()

    def report(self, msg: LoadReport, cache: CacheEvents | None = None) -> bool:
        """Take a load report (and its batch of prefix-cache events); False when the instance is not
        registered (removed as dead)."""
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            return False
        if cache is not None:
            self.cache.apply(inst.id, cache)
        now = self.clock.now()
        if inst.role == "decode" and self._news_at is None and says_more(inst.load, msg):
            self._news_at = now
        inst.load = msg
        inst.last_report = now
        inst.reports += 1
        self.changes += 1
        if inst.state == "unhealthy":
            log.warning("instance %s is reporting again", inst.id)
        if not inst.flip_pending:
            state, role = msg.state or "active", msg.role or inst.role  # the worker's own word
            if (state, role) != (inst.state, inst.role):
                inst.state, inst.role = state, role
                self.invalidate()
        self._reindex(inst)
        if (
            self.writer is not None
            and inst.recorded  # a sample written before the instance's row would be refused
            and (inst.sampled_report < 0 or inst.reports - inst.sampled_report >= self.sample_every)
        ):
            inst.sampled_report = inst.reports
            self.writer.submit_load_samples(
                [
                    {
                        "instance_id": inst.id,
                        "ts": inst.last_report,
                        "queued": msg.queued,
                        "running": msg.running,
                        "kv_used_tokens": msg.kv_used_tokens,
                        "kv_capacity_tokens": msg.kv_capacity_tokens,
                        "tokens_per_s": msg.tokens_per_s,
                    }
                ]
            )
        return True

    def check_health(self, now: float | None = None) -> list[str]:
        """Mark instances that missed `unhealthy_after` reports; returns the ids newly marked. Instances
        silent for `dead_after_s` (wall) are removed from the registry (`on_removed` is told). `now` is
        the cluster clock."""
        now = self.clock.now() if now is None else now
        limit = self.clock.model_seconds(self.unhealthy_after * self.report_interval_s)
        dead = self.clock.model_seconds(self.dead_after_s)
        marked = []
        for inst in list(self.instances.values()):
            silent = now - inst.last_report
            if silent > dead:
                del self.instances[inst.id]
                self.cache.drop(inst.id)
                self.invalidate()
                log.warning("instance %s silent for %.1f s: removed", inst.id, self.dead_after_s)
                if self.on_removed is not None:
                    self.on_removed(inst)
            elif inst.state != "unhealthy" and silent > limit:
                inst.state = "unhealthy"
                self.invalidate()
                marked.append(inst.id)
                log.warning("instance %s missed %d reports: unhealthy", inst.id, self.unhealthy_after)
        return marked

    def begin_flip(self, inst: Instance) -> None:
        """The daemon starts flipping this instance: it leaves routing and the broadcast (peers stop
        handing over to it) whatever its reports say, until `end_flip`."""
        inst.flip_pending, inst.state = True, "draining"
        self.invalidate()

    def end_flip(self, inst: Instance, role: str | None) -> None:
        """The flip ended: done (the instance now in `role`), or not (None: in its old role). It is active
        again, unless it failed while a failed call had marked it unhealthy."""
        inst.flip_pending = False
        if role is not None:
            inst.role = role
        if role is not None or inst.state != "unhealthy":
            inst.state = "active"
        self.invalidate()

    # --- cordon -------------------------------------------------------------------------------------------
    def serving(self, model: str) -> tuple[Counter[str], int]:
        """What takes `model`'s new work, as `leaves_unserved` counts it: its schedulable instances by role,
        and its prefill instances draining for a flip (their held KV goes to a decode instance)."""
        active = Counter(i.role for i in self.healthy(*FLIP_ROLES, model=model))
        draining = sum(
            1 for i in self.instances.values() if i.model == model and i.role == "prefill" and i.flip_pending
        )
        return active, draining

    def cordon_refusal(self, inst: Instance) -> str | None:
        """Why this instance may not be cordoned (None: it may): it is the last that keeps its model served
        (`leaves_unserved`, the rule flips apply). One already out of routing (cordoned, flipping,
        unhealthy) may always be."""
        if not inst.schedulable:
            return None
        return leaves_unserved(inst.id, inst.role, *self.serving(inst.model))

    def cordon(self, inst: Instance) -> bool:
        """No new work for this instance (call `cordon_refusal` first); whether it was not cordoned yet."""
        if inst.cordoned:
            return False
        inst.cordoned, inst.cordoned_at = True, self.clock.now()
        self.cordoned_ids[inst.id] = inst.cordoned_at
        self.invalidate()
        return True

    def uncordon(self, inst: Instance) -> bool:
        """Routing may send it new work again; whether it was cordoned."""
        if not inst.cordoned:
            return False
        inst.cordoned = False
        self.cordoned_ids.pop(inst.id, None)
        self.invalidate()
        return True

    def decode_broadcast(self, role: str = "prefill") -> DecodeBroadcast:
        """The answer to a load report from an instance in `role`: the decode instances' load for a prefill
        instance (its dispatcher chooses from them), none for the others; the policies for all. Rebuilt at
        most every half report interval, and only when a decode instance's load changed (an idle cluster's
        is built once), or at once after `invalidate`; between, the same objects."""
        now = self.clock.now()
        news = self._news_at
        if self._broadcast is None or (
            news is not None and now - self._built_at >= self.clock.model_seconds(self.report_interval_s / 2)
        ):
            if news is not None and self.on_broadcast is not None:
                self.on_broadcast((now - news) / self.clock.scale)
            self._news_at = None
            full = DecodeBroadcast(
                instances=[
                    DecodeInstanceLoad(i.id, i.address, self._broadcast_load(i), i.model)
                    for i in self.instances.values()
                    if i.role == "decode"
                ],
                timestamp=now,
                policies_json=json.dumps(self.policies.to_dict()),
                policy_version=self.policy_version,
            )
            self._broadcast, self._built_at = (full, dataclasses.replace(full, instances=[])), now
        return self._broadcast[0] if role == "prefill" else self._broadcast[1]

    def answer(self, role: str, policy_version: int) -> DecodeBroadcast | None:
        """What a load report from an instance in `role` running `policy_version` is answered with: a
        prefill instance, the broadcast with the decode load (its dispatcher chooses from it); any other,
        the policies when they changed, else nothing (a reply not sent is half the cost of a report)."""
        if role != "prefill" and policy_version == self.policy_version:
            return None
        return self.decode_broadcast(role)

    def view(self) -> ClusterView:
        """The registry as a front follows it (instances flipping show as draining: out of routing; active
        ones cordoned as `cordoned`)."""
        return ClusterView(
            [
                InstanceState(
                    i.registration(),
                    "draining" if i.flip_pending else i.shown_state,
                    i.load,
                )
                for i in self.instances.values()
            ],
            json.dumps(self.policies.to_dict()),
            self.policy_version,
            self.clock.now(),
            self.clock.scale,
            settled=self.clock.now() - self.started >= self.clock.model_seconds(self.dead_after_s),
        )

    def set_policies(self, policies: PolicySet) -> None:
        self.policies = policies
        self.policy_version += 1
        self.invalidate()

    @staticmethod
    def _broadcast_load(i: Instance) -> LoadReport:
        return dataclasses.replace(
            i.load, state=i.shown_state, kv_capacity_tokens=i.load.kv_capacity_tokens or i.kv_capacity_tokens
        )

    async def monitor(self) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            self.check_health()
