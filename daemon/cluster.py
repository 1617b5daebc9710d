"""The cluster as both rooms hold it (TetriInfer §3.2): the instances registered, their load, the routing
index and the model catalogue, and the cluster clock every daemon timestamp comes from.

The controller's registry (`daemon.controller.registry.Registry`, a `Cluster`) takes registrations and
load reports, keeps health, cordons and flips, and answers reports with the decode-load broadcast. A front
holds a copy (`follow`: the controller's view stream, `ClusterView`) and routes on it: the entry rule is
`tetri.scheduling.routing.choose_entry`, which reads the routing index (`routes`), each instance's load
(`load`) and the prefix-cache index (`cache`, `tetri.scheduling.cacheindex`: which prompt blocks each
instance's engine holds; the registry feeds it from the load reports, a front replays its changes).

Everything here is plain data: the wire format's conversions are `daemon.wire`'s.

Times are on the cluster clock (`tetri.clock.ClusterClock`: model time when the cluster runs scaled).
The report interval paces processes, so it is wall time; the health limit (`unhealthy_after` ×
`report_interval_s` of wall time) is compared on the cluster clock as that many wall seconds × scale.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tetri.clock import ClusterClock
from tetri.scheduling.cacheindex import CacheIndex, Change
from tetri.scheduling.minindex import MinIndex
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.routing import InstanceLoad, load_key

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


@dataclass
class LoadReport:
    """One worker's load, as it last reported it (or as the daemon broadcasts it)."""

    instance_id: str = ""
    role: str = ""
    state: str = ""  # "active" | "draining" | "flipping" (the worker's word; "unhealthy", "cordoned" in broadcasts)
    queued: int = 0
    running: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    tokens_per_s: float = 0.0
    preemptions: int = 0
    timestamp: float = 0.0  # the worker's clock
    heavy: int = 0
    light: int = 0
    predicted_growth_tokens: int = 0
    policy_version: int = 0
    held_kv_tokens: int = 0  # prefill: KV not yet pulled by a decode instance (inside kv_used_tokens)
    prefix_query_tokens: int = 0  # its prefix cache over the engine's life: prompt tokens looked up,
    prefix_hit_tokens: int = 0  # and found cached


# what a report says, as opposed to when (the worker's timestamp): a decode instance's report that says
# nothing new leaves the broadcast as it is
_CONTENT = tuple(f.name for f in dataclasses.fields(LoadReport) if f.name != "timestamp")


def says_more(old: LoadReport, new: LoadReport) -> bool:
    return any(getattr(old, f) != getattr(new, f) for f in _CONTENT)


@dataclass(frozen=True)
class Registration:
    instance_id: str
    role: str
    address: str  # host:port of its Worker service
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int = 0  # 0: unknown (then token ids are only checked against int32)
    tokenizer: str = ""  # where the daemon loads the model's tokenizer (daemon.tokenizer.load_tokenizer)
    block_size: int = 0  # its engine's KV block size (the prefix cache's blocks); 0: unknown

    def refusal(self) -> str | None:
        """Why the daemon refuses this registration (None: it accepts it)."""
        if self.role not in ROLES:
            return f"unknown role {self.role!r}"
        if not self.instance_id or not self.address:
            return "instance_id and address are required"
        return None


@dataclass(frozen=True)
class DecodeInstanceLoad:
    instance_id: str
    address: str
    load: LoadReport
    model: str = ""


@dataclass(frozen=True)
class DecodeBroadcast:
    """The daemon's answer to each load report: decode load, and the runtime policies with their version."""

    instances: list[DecodeInstanceLoad]
    timestamp: float  # cluster clock
    policies_json: str
    policy_version: int


@dataclass(frozen=True)
class InstanceState:
    """One instance as the controller sees it: how it registered, its state (the controller's word) and
    its last load report."""

    registration: Registration
    state: str
    load: LoadReport


@dataclass(frozen=True)
class ClusterView:
    """What a front follows (`Cluster.view` on the controller, `Cluster.follow` on a front): every
    registered instance, the runtime policies with their version, and the cluster clock."""

    instances: list[InstanceState]
    policies_json: str
    policy_version: int
    clock_now: float
    time_scale: float
    admin_url: str = ""  # the controller's HTTP API (policy changes and flips go there)
    settled: bool = True  # False: the controller started less than its dead-after time ago (see `follow`)
    # the controller's prefix-cache index, relayed: its changes since the stream's last message, or all of
    # it (`cache_snapshot`: forget what you had); `cache_only`: this message says nothing else
    cache: list[Change] = field(default_factory=list)
    cache_snapshot: bool = False
    cache_only: bool = False


@dataclass(frozen=True)
class ModelEntry:
    """What the registered instances of one model announce, whatever their state."""

    context: int  # the smallest max_model_len among them (0 when one announces none)
    known_context: int | None  # the smallest they announce (None: none does)
    vocab_size: int | None  # the smallest vocabulary they announce (None: none does)
    roles: frozenset[str]


@dataclass
class Instance:
    id: str
    role: str
    address: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int = 0
    tokenizer: str = ""  # where the model's tokenizer is (as it registered)
    block_size: int = 0  # its engine's KV block size (as it registered)
    state: str = "active"  # active | draining | flipping | unhealthy
    last_report: float = 0.0  # cluster clock of the last report (or of the registration)
    load: LoadReport = field(default_factory=LoadReport)
    inflight: int = 0  # requests routed here by the daemon and not finished
    reports: int = 0
    flip_pending: bool = False  # the daemon started a flip: stay out of routing whatever reports say
    cordoned: bool = False  # an operator cordoned it: out of routing (new work) whatever reports say
    cordoned_at: float = 0.0  # cluster clock of the cordon
    recorded: bool = False  # the status tables hold its row: its load samples can be written
    sampled_report: int = -1  # the report last written as a load sample (-1: none yet)

    def registration(self) -> Registration:
        """The instance as it would register now (in its present role)."""
        r = (self.id, self.role, self.address, self.model, self.max_model_len, self.kv_capacity_tokens)
        return Registration(*r, self.vocab_size, self.tokenizer, self.block_size)

    def snapshot(self) -> InstanceLoad:
        return InstanceLoad(
            self.id,
            self.load.queued,
            self.load.running,
            self.load.kv_used_tokens,
            self.load.kv_capacity_tokens or self.kv_capacity_tokens,
            self.inflight,
        )

    @property
    def kv_usage(self) -> float:
        cap = self.load.kv_capacity_tokens or self.kv_capacity_tokens
        return self.load.kv_used_tokens / cap if cap else 0.0

    @property
    def shown_state(self) -> str:
        """Its state as broadcasts, views and the flip watcher see it: `cordoned` for an active one cordoned
        (workers hand over to `active` decode instances only; a front takes it back as the flag)."""
        return "cordoned" if self.cordoned and self.state == "active" else self.state

    @property
    def schedulable(self) -> bool:
        """Whether routing may send it new work: active, not cordoned, not flipping."""
        return self.state == "active" and not self.cordoned and not self.flip_pending

    def busy(self) -> bool:
        """Whether anything is in flight there: requests this daemon routed there, what its last report
        says queued or running, or (prefill) KV no decode instance has pulled yet."""
        ld = self.load
        return bool(self.inflight or ld.queued or ld.running or ld.held_kv_tokens)

    def to_dict(self, now: float, settle_s: float = 0.0) -> dict[str, object]:
        """The instance as the admin API shows it; `now` is the cluster clock. `drained`: cordoned, and
        nothing in flight there as of a load report received `settle_s` (cluster clock) or more after the
        cordon (hand-overs chosen from the broadcast before the cordon have landed by then)."""
        ld = self.load
        cap = ld.kv_capacity_tokens or self.kv_capacity_tokens
        drained = self.cordoned and not self.busy() and self.last_report - self.cordoned_at >= settle_s
        return {
            "id": self.id,
            "role": self.role,
            "state": self.state,
            "cordoned": self.cordoned,
            "drained": drained,
            "address": self.address,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "queued": ld.queued,
            "running": ld.running,
            "inflight": self.inflight,
            "kv_used_tokens": ld.kv_used_tokens,
            "kv_capacity_tokens": cap,
            "kv_usage": ld.kv_used_tokens / cap if cap else 0.0,
            "held_kv_tokens": ld.held_kv_tokens,
            "tokens_per_s": ld.tokens_per_s,
            "preemptions": ld.preemptions,
            "policy_version": ld.policy_version,
            "last_report_age_s": max(0.0, now - self.last_report),
            "prefix_query_tokens": ld.prefix_query_tokens,
            "prefix_hit_tokens": ld.prefix_hit_tokens,
            "prefix_hit_ratio": ld.prefix_hit_tokens / ld.prefix_query_tokens if ld.prefix_query_tokens else None,
        }


class Cluster:
    def __init__(self, report_interval_s: float, unhealthy_after: int, clock: ClusterClock | None = None) -> None:
        self.instances: dict[str, Instance] = {}
        # instance id -> when it was cordoned: the operator's word outlives the instance's removal (a worker
        # drained, stopped and started again under its id comes back cordoned, until uncordoned)
        self.cordoned_ids: dict[str, float] = {}
        self.report_interval_s = report_interval_s
        self.unhealthy_after = unhealthy_after
        self.clock = clock or ClusterClock()
        self.policies = PolicySet()
        self.policy_version = 0
        self.on_removed: Callable[[Instance], None] | None = None
        # the routing index, per (role, model), of the active instances, and each model's catalogue entry:
        # built after a change of the registry, of a state or role (`invalidate`), kept current between by
        # load reports and `routed`, so a request reads them instead of scanning the registry
        self._routes: dict[tuple[str, str], MinIndex] | None = None
        self._catalog: dict[str, ModelEntry] | None = None
        self.changes = 0  # counts what a front's view would show differently (reports, registry, states)
        self._followed_policies = ""  # a front: the policies of the last view it followed, as sent
        self.cache = CacheIndex()  # which prompt blocks each instance's prefix cache holds
        self.turns: Counter[tuple[str, str]] = Counter()  # round-robin's turn per (role, model)

    def instance_dicts(self) -> list[dict[str, object]]:
        now, settle = self.clock.now(), self.drain_settle_s()
        return [i.to_dict(now, settle) | {"index_blocks": self.cache.blocks(i.id)} for i in self.instances.values()]

    def instance_dict(self, inst: Instance) -> dict[str, object]:
        return inst.to_dict(self.clock.now(), self.drain_settle_s()) | {"index_blocks": self.cache.blocks(inst.id)}

    def drain_settle_s(self) -> float:
        """How long after a cordon (cluster clock) a load report shows what the cordon left there: one
        report interval for the prefill instances to get the broadcast that shows it, one for the instance
        to report what was handed over before."""
        return self.clock.model_seconds(2 * self.report_interval_s)

    # --- registry ---------------------------------------------------------------------------------
    def register(self, reg: Registration, relearn: bool = True) -> Instance:
        """Add (or renew) an instance; call `refusal` first. `relearn`: its prefix-cache entry starts afresh
        (the worker's next report carries its whole cache); a front's follows the controller's instead."""
        inst = Instance(
            reg.instance_id,
            reg.role,
            reg.address,
            reg.model,
            reg.max_model_len,
            reg.kv_capacity_tokens,
            reg.vocab_size,
            reg.tokenizer,
            reg.block_size,
            last_report=self.clock.now(),
        )
        old = self.instances.get(reg.instance_id)
        self.invalidate()
        if relearn:  # its cache as the worker tells it from now: its next report's batch is the whole of it
            self.cache.drop(inst.id)
        blocks = reg.kv_capacity_tokens // reg.block_size if reg.block_size else 0
        self.cache.limit(inst.id, reg.block_size, blocks)
        if old is not None:  # renewed in place: requests in flight there keep counting on this entry
            inst.inflight = old.inflight
            inst.cordoned, inst.cordoned_at = old.cordoned, old.cordoned_at  # an operator's word stands
            old.__dict__.update(inst.__dict__)
            return old
        if inst.id in self.cordoned_ids:  # cordoned, removed, back
            inst.cordoned, inst.cordoned_at = True, self.cordoned_ids[inst.id]
        self.instances[inst.id] = inst
        return inst

    def suspect(self, instance_id: str) -> None:
        """A call to this instance failed at the transport (it died or is unreachable): route nothing
        more to it until it reports again."""
        inst = self.instances.get(instance_id)
        if inst is not None and inst.state != "unhealthy":
            inst.state = "unhealthy"
            self.invalidate()
            log.warning("instance %s failed a call: unhealthy until it reports again", instance_id)

    # --- the routing index and the model catalogue --------------------------------------------------
    def routes(self) -> dict[tuple[str, str], MinIndex]:
        """Per (role, model), the active instances not cordoned by `load_key` (the least loaded first)."""
        if self._routes is None:
            routes: dict[tuple[str, str], MinIndex] = {}
            for i in self.instances.values():
                if i.state == "active" and not i.cordoned:
                    routes.setdefault((i.role, i.model), MinIndex()).set(load_key(i.snapshot()))
            self._routes = routes
        return self._routes

    def _reindex(self, inst: Instance) -> None:
        """The instance's load changed: its key in the routing index follows (when it is there)."""
        if self._routes is None or self.instances.get(inst.id) is not inst:
            return
        idx = self._routes.get((inst.role, inst.model))
        if idx is not None and inst.id in idx:
            idx.set(load_key(inst.snapshot()))

    def load(self, instance_id: str) -> InstanceLoad:
        """The instance's load as routing sees it (`tetri.scheduling.routing.choose_entry` reads it)."""
        return self.instances[instance_id].snapshot()

    def routed(self, inst: Instance, delta: int) -> None:
        """A request routed to this entry (+1) or finished with it (-1): the router's fresh load."""
        inst.inflight = max(0, inst.inflight + delta)
        self._reindex(inst)

    def healthy(self, *roles: str, model: str | None = None) -> list[Instance]:
        """Active instances not cordoned in these roles (serving `model`, when given)."""
        return [
            self.instances[iid]
            for (role, m), idx in self.routes().items()
            if role in roles and (model is None or m == model)
            for iid in idx
        ]

    def catalog(self) -> dict[str, ModelEntry]:
        """Each registered model's entry (`ModelEntry`), rebuilt only after the registry changes."""
        if self._catalog is None:
            by_model: dict[str, list[Instance]] = {}
            for i in self.instances.values():
                by_model.setdefault(i.model, []).append(i)
            self._catalog = {
                m: ModelEntry(
                    context=min(i.max_model_len for i in insts),
                    known_context=min((i.max_model_len for i in insts if i.max_model_len), default=None),
                    vocab_size=min((i.vocab_size for i in insts if i.vocab_size), default=None),
                    roles=frozenset(i.role for i in insts),
                )
                for m, insts in by_model.items()
            }
        return self._catalog

    def vocab_size(self, model: str) -> int | None:
        """The smallest vocabulary among the model's registered instances (None: none says)."""
        entry = self.catalog().get(model)
        return None if entry is None else entry.vocab_size

    def max_model_len(self, model: str | None = None) -> int | None:
        """The model's context (the smallest its instances announce); without a model, any model's."""
        catalog = self.catalog()
        lens = [e.known_context for m, e in catalog.items() if e.known_context and (model is None or m == model)]
        return min(lens) if lens else None

    def models(self) -> dict[str, int]:
        """Each served model and its context (the smallest its instances announce)."""
        return {m: e.context for m, e in self.catalog().items()}

    def invalidate(self) -> None:
        """Something the broadcast or the routing index shows changed (an instance's state or role, the
        registry, the policies): the next answer, index and catalogue are built afresh."""
        self._routes = None
        self._catalog = None
        self.changes += 1

    # --- a front's copy of the controller's registry ------------------------------------------------------
    def follow_cache(self, view: ClusterView) -> None:
        """A front takes the index changes a view message relays (its controller's, in order)."""
        if view.cache_snapshot:
            self.cache.forget_all()
        for change in view.cache:
            self.cache.replay(change)

    def follow(self, view: ClusterView) -> list[Instance]:
        """A front takes the controller's view: instances new (or re-registered at another address) are
        registered, each one's state, role and load become the view's (one this front found failing stays
        unhealthy until the view shows a newer report of it), those missing from it are removed
        (unless the view is not settled: a controller that just started does not know every live worker
        yet), and the policies are the view's. The front's own counts of requests routed to each instance
        stay. Returns the instances registered by this view."""
        if view.cache_only:
            self.follow_cache(view)
            return []
        now = self.clock.now()
        new: list[Instance] = []
        for s in view.instances:
            reg = s.registration
            inst = self.instances.get(reg.instance_id)
            if inst is None or (inst.address, inst.model, inst.tokenizer, inst.block_size) != (
                reg.address,
                reg.model,
                reg.tokenizer,
                reg.block_size,
            ):
                inst = self.register(reg, relearn=False)
                new.append(inst)
            # a call that failed here marked it unhealthy (`suspect`): so it stays until it reports again
            cordoned = s.state == "cordoned"
            shown = "active" if cordoned else s.state
            state = "unhealthy" if inst.state == "unhealthy" and s.load.timestamp == inst.load.timestamp else shown
            inst.load, inst.last_report = s.load, now
            inst.reports += 1
            if (inst.state, inst.role, inst.cordoned) != (state, reg.role, cordoned):
                if cordoned and not inst.cordoned:
                    inst.cordoned_at = now
                inst.state, inst.role, inst.cordoned = state, reg.role, cordoned
                self.invalidate()
            self._reindex(inst)
        seen = {s.registration.instance_id for s in view.instances}
        for gone in [i for i in self.instances.values() if i.id not in seen and view.settled]:
            del self.instances[gone.id]
            self.cache.drop(gone.id)
            self.invalidate()
            if self.on_removed is not None:
                self.on_removed(gone)
        self.follow_cache(view)
        if (view.policy_version, view.policies_json) != (self.policy_version, self._followed_policies):
            self.policies = PolicySet(**json.loads(view.policies_json))
            self.policy_version, self._followed_policies = view.policy_version, view.policies_json
            self.invalidate()
        return new
