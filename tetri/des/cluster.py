"""The discrete-event cluster simulator: TetriInfer (disaggregated) or vanilla vLLM (colocated) on the
roofline cost model, on a virtual clock.

A shell of events around the objects the live system runs: each instance is an `InstanceScheduler`
(`tetri.scheduling.instance`, the same object the live sim engine loops over), the `routing` policy routes
arrivals, the predictor gives each request its range, `dispatch` picks a decode instance and a
`TransitionWatcher` decides flips. Time comes only from `CostModel`. A heap of events (arrival,
iteration done, KV pulled, watcher tick, flip done) ordered by (time, sequence number); no asyncio, no
sleeping, no wall clock; deterministic for a seed.

One instant at a time, in the order the live engines see it on a virtual clock (tests/des/test_parity.py
checks the plans are identical): (1) every event of the instant is applied (iteration results, arrivals,
finished transfers); (2) every idle instance with news plans its next iteration (`schedule()`); KV pulls
a decode instance's plan makes free the KV on the prefill instance once all plans of the round are made
(its worker learns of the pull after the decode engine has planned), and an idle prefill instance whose
KV was freed plans again in a next round of the same instant.

* **Prefill instance**: a prompt's KV is charged from its KV admission until a decode instance pulls it.
  On its last chunk: first token (TTFT), `dispatch` picks a decode instance, which queues the request with
  its KV remote (TetriInfer's request-level hand-over; NIXL-style pull). Held KV counts against the prefill
  instance's cache, so a prefill instance full of un-pulled KV admits no more prompts (back-pressure).
* **Decode instance**: admission pulls the KV (charged there from then on), the transfer takes
  `transfer_time(prompt)` (transfers do not contend: each is emulated, as in the paper), then the request
  decodes with continuous batching.
* **Vanilla (colocated)**: vLLM's default prefill-first schedule over whole prompts.
* **Flips**: every `watch_interval_s` the watcher sees an `InstanceView` per instance; a decision drains
  the instance (a prefill instance gets no new arrivals and finishes its queue until every held KV is
  pulled; a decode instance gets no new dispatches and finishes its queue and batch), then after
  `flip_cost_s` it serves the other role. Requests already queued elsewhere are not migrated. Under the
  `advise` flip policy the watcher is told, every `flip_window_s`, which split a `SplitAdvisor` found best
  for the requests that arrived in the last window and have finished (a nested simulation of them, flips
  off), as the daemon tells it from its status table.

Routing and dispatch read loads at decision time (as if load reports were instant). `check_kv=True`
checks after every event and every planning round that each instance's used KV is the sum of its
requests' and within capacity, and that every request whose KV exists is charged to exactly one instance.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tetri.costmodel import DEFAULT_PROFILE, CostModel, Profile, load_profile
from tetri.scheduling.cacheindex import CacheEvents, CacheIndex
from tetri.scheduling.dispatch import DecodeLoad, dispatch
from tetri.scheduling.flip import FlipDecision, InstanceView, SplitAdvice, TransitionWatcher, flip_refusal
from tetri.scheduling.instance import HEAVY_DECODE, InstanceScheduler, IterationPlan, Outcome, Phase, SchedRequest
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import OraclePredictor, make_predictor
from tetri.scheduling.prefix import keys_from_hash_ids
from tetri.scheduling.routing import InstanceLoad, cache_aware, choose_path, load_key, round_robin

from .records import FlipRecord, InstanceRecord, RejectedRecord, RequestRecord, RunResult
from .slo import DEFAULT_SLO, SloSet
from .trace import Seen
from .workloads import Request


class Advisor(Protocol):
    """The `advise` flip policy's model (`tetri.des.flipadvisor.SplitAdvisor`): the split the requests seen
    in the last window wanted."""

    def advise(self, seen: Sequence[Seen], policies: PolicySet, prefill: int, decode: int) -> SplitAdvice | None: ...


MODES = ("tetri", "vanilla")

# Event kinds (the heap orders by time, then by a sequence number, so ties are deterministic).
_ARRIVE, _DONE, _LOADED, _WATCH, _FLIPPED = range(5)
_CHARGED = (Phase.PREFILLING, Phase.LOADING, Phase.RUNNING, Phase.HELD)
PlanHook = Callable[[str, float, IterationPlan], None]  # (instance id, model time, plan)


@dataclass(frozen=True)
class ClusterConfig:
    """What to simulate. `instances` GPUs in all (one instance = one GPU); TetriInfer mode splits them
    into `prefill_instances` prefill, `colocated_instances` colocated (a hybrid cluster: the policy's
    `pd_route` chooses per request) and the rest decode; vanilla runs them all colocated."""

    mode: str = "tetri"
    profile: str | Profile = DEFAULT_PROFILE
    instances: int = 2
    prefill_instances: int = 1
    policy: PolicySet = field(default_factory=PolicySet)
    chunked: bool = True
    prefill_batch_tokens: int | None = None  # whole-prompt budget; None: max(max_model_len, profile's)
    watch_interval_s: float = 1.0
    flip_cost_s: float = 0.0  # assumed: a role change reuses the loaded weights
    plan_order: tuple[str, ...] = ()  # `plan` admission's order, loaded on every decode/colocated instance
    slo: SloSet = field(default=DEFAULT_SLO)  # what the `advise` flip policy scores splits against
    seed: int = 0
    colocated_instances: int = 0  # tetri mode: beside the prefill and decode instances
    prefix_caching: bool = True  # each instance's prefix cache (vLLM's default; requests with hash ids use it)
    # the `advise` flip policy's model (`flipadvisor.advising(config)` sets one): data, not built here
    advisor: Advisor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.instances < 1 or (self.mode == "tetri" and self.instances < 2):
            raise ValueError(f"{self.mode} needs more instances than {self.instances}")
        split = self.instances - self.colocated_instances  # prefill and decode instances
        if self.mode == "tetri" and not 1 <= self.prefill_instances < split:
            raise ValueError(f"need 1 ≤ prefill instances < {split}, got {self.prefill_instances}")
        if self.colocated_instances < 0 or (self.mode != "tetri" and self.colocated_instances):
            raise ValueError("colocated_instances: a number ≥ 0, beside prefill and decode instances (tetri mode)")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError("prefill_batch_tokens must be positive")
        if self.watch_interval_s <= 0 or self.flip_cost_s < 0:
            raise ValueError("watch interval must be positive and flip cost non-negative")


class FlipWatcher(Protocol):
    """What the simulator asks about flips: `TransitionWatcher`, or a scripted one in tests."""

    def observe(
        self, now: float, instances: Sequence[InstanceView], advice: SplitAdvice | None = None
    ) -> list[FlipDecision]: ...


class _Req:
    __slots__ = (
        "arrival",
        "cached",
        "d_inst",
        "decode_start",
        "finish",
        "first_token",
        "keys",
        "lo",
        "out",
        "p_inst",
        "predicted",
        "preempt",
        "prefill_start",
        "prompt",
        "sched",
        "seq",
    )

    def __init__(self, r: Request, seq: int, predicted: tuple[int, int] | None, block_size: int) -> None:
        self.seq = seq
        self.arrival = r.arrival
        self.prompt = r.prompt_len
        self.out = r.output_len
        self.predicted = predicted
        self.lo = predicted[0] if predicted is not None else None
        # a request without hash ids shares its prompt with none (its own blocks still cache: a preempted
        # request finds them again, as in vLLM)
        ids = r.hash_ids or tuple(((seq + 1) << 32) + j for j in range(-(-r.prompt_len // r.hash_block)))
        self.keys = keys_from_hash_ids(ids, r.hash_block, r.prompt_len, block_size)
        self.cached = 0  # prompt tokens its prefill found in the prefix cache
        self.sched = SchedRequest(
            r.request_id,
            r.prompt_len,
            r.max_tokens,
            predicted,
            output_len=r.output_len,
            arrival=r.arrival,
            block_keys=self.keys,
        )
        self.preempt = 0
        self.prefill_start: float | None = None
        self.first_token: float | None = None
        self.decode_start: float | None = None
        self.finish: float | None = None
        self.p_inst: _Instance | None = None
        self.d_inst: _Instance | None = None


class _Instance:
    __slots__ = (
        "busy_s",
        "counted",
        "d_iters",
        "epoch",
        "first",
        "idx",
        "iid",
        "inflight",
        "last",
        "m_iters",
        "news",
        "outstanding",
        "p_iters",
        "role",
        "roles",
        "sched",
        "seq",
        "starting",
        "state",
    )

    def __init__(self, iid: str, idx: int, role: str, sched: InstanceScheduler) -> None:
        self.iid = iid
        self.idx = idx
        self.role = role
        self.roles = [role]
        self.state = "active"
        self.sched = sched
        self.inflight: IterationPlan | None = None  # the iteration running now
        self.news = False  # something changed since it last planned: plan at the end of the instant
        self.outstanding = 0  # routed here, not yet done with this instance (the router's in-flight count)
        self.starting: list[_Req] = []  # loaded (or prefilled, colocated): their first decode step is next
        # padding, preemptions, recomputed tokens, prefix query and hit tokens of schedulers it had before flips
        self.counted = [0, 0, 0, 0, 0]
        self.epoch, self.seq = 0, -1  # its batches of cache events to the index (a flip: a new cache, epoch)
        self.busy_s = 0.0
        self.first: float | None = None
        self.last: float | None = None
        self.p_iters = 0
        self.d_iters = 0
        self.m_iters = 0


class _Sim:
    def __init__(
        self,
        workload: Sequence[Request],
        config: ClusterConfig,
        watcher: FlipWatcher | None,
        on_plan: PlanHook | None,
        check_kv: bool,
    ) -> None:
        self.cfg = config
        profile = config.profile if isinstance(config.profile, Profile) else load_profile(config.profile)
        self.profile = profile
        self.cost = CostModel(profile)
        self.policy = config.policy
        self.on_plan = on_plan
        self.check_kv = check_kv
        pol = self.policy
        if pol.predictor == "learned":
            raise ValueError("the simulator has no prompts to learn from: use predictor none or oracle")
        predictor = make_predictor(pol.predictor, pol.predictor_accuracy, pol.predictor_granularity, config.seed)
        self.rng = random.Random(config.seed)
        if config.mode == "tetri":
            n_p, n_c = config.prefill_instances, config.colocated_instances
            roles = ["prefill"] * n_p + ["decode"] * (config.instances - n_p - n_c) + ["colocated"] * n_c
        else:
            roles = ["colocated"] * config.instances
        # ids name no role (an instance flips and keeps its id), as the live workers' do
        self.instances = [_Instance(f"gpu{i}", i, r, self._scheduler(r)) for i, r in enumerate(roles)]
        self.cap = self.instances[0].sched.capacity
        self.by_id = {inst.iid: inst for inst in self.instances}
        # the control plane's prefix-cache index, fed each instance's cache events as the live daemon is
        # (here at once: routing reads it at decision time, as it reads loads)
        self.block = profile.block_size
        self.index = CacheIndex()
        for inst in self.instances:
            self.index.limit(inst.iid, self.block, self.cap // self.block)
        self.turns: Counter[str] = Counter()  # round-robin's turn per entry role
        self.watcher: FlipWatcher | None = watcher
        self.advisor: Advisor | None = None
        self.transitions: TransitionWatcher | None = None
        if self.watcher is None and pol.flip_policy != "off" and config.mode == "tetri":
            self.transitions = TransitionWatcher(pol.flip_policy, pol.flip_low, pol.flip_high, pol.flip_window_s)
            self.watcher = self.transitions
            if pol.flip_policy == "advise":
                if config.advisor is None:
                    raise ValueError("flip_policy advise needs ClusterConfig.advisor (flipadvisor.advising)")
                self.advisor = config.advisor
        self.reqs: dict[str, _Req] = {}
        ordered = sorted(enumerate(workload), key=lambda x: (x[1].arrival, x[0]))
        for seq, (_, r) in enumerate(ordered):
            self._validate(r)
            if r.request_id in self.reqs:
                raise ValueError(f"request id {r.request_id!r} appears twice")
            pred = predictor.predict((), r.request_id, r.output_len) if isinstance(predictor, OraclePredictor) else None
            self.reqs[r.request_id] = _Req(r, seq, pred, profile.block_size)
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.pending = 0  # events other than watcher ticks in the heap
        self.now = 0.0
        self.events = 0
        self.done = 0
        self.rejected: list[RejectedRecord] = []
        self.flips: list[FlipRecord] = []
        self._flip_open: dict[str, tuple[FlipDecision, str, float, float | None]] = {}
        self.undispatched: deque[_Req] = deque()
        self.newsy: list[_Instance] = []  # instances with news, to plan this instant
        self.releases: list[tuple[_Instance, str]] = []  # KV pulled in this round: freed on the prefill side after it
        for req in self.reqs.values():
            self._push(req.arrival, _ARRIVE, req)
        if self.watcher is not None and self.reqs:
            self._push(config.watch_interval_s, _WATCH, None)

    def _scheduler(self, role: str) -> InstanceScheduler:
        sched = InstanceScheduler(
            role,
            self.cost,
            self.policy,
            chunked=self.cfg.chunked,
            prefill_budget=self.cfg.prefill_batch_tokens,
            prefix_caching=self.cfg.prefix_caching,
        )
        if role != "prefill" and self.cfg.plan_order:
            sched.set_plan(self.cfg.plan_order)
        return sched

    def _validate(self, r: Request) -> None:
        m = self.profile.model.max_model_len
        if r.prompt_len < 1 or r.output_len < 1 or r.max_tokens < r.output_len:
            raise ValueError(f"request {r.request_id}: need prompt ≥ 1 and 1 ≤ output ≤ max_tokens")
        if r.prompt_len + r.max_tokens > m:
            raise ValueError(f"request {r.request_id}: prompt + max_tokens exceeds max_model_len {m}")
        if r.peak_kv > self.cap:
            raise ValueError(f"request {r.request_id}: peak KV {r.peak_kv} exceeds the capacity {self.cap}")

    # --- the event loop ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        if kind != _WATCH:
            self.pending += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def run(self) -> RunResult:
        heap = self.heap
        while heap:
            now = self.now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, kind, obj = heapq.heappop(heap)
                self.events += 1
                if kind != _WATCH:
                    self.pending -= 1
                if kind == _DONE:
                    assert isinstance(obj, _Instance)
                    self._iteration_done(obj)
                elif kind == _ARRIVE:
                    assert isinstance(obj, _Req)
                    self._arrive(obj)
                elif kind == _LOADED:
                    assert isinstance(obj, _Req)
                    self._loaded(obj)
                elif kind == _WATCH:
                    self._watch()
                else:
                    assert isinstance(obj, _Instance)
                    self._flipped(obj)
                if self.check_kv:
                    self._check_kv()
            self._plan_round()
        if self.done != len(self.reqs):
            raise RuntimeError(f"simulation ended with {len(self.reqs) - self.done} requests unfinished")
        return self._result()

    def _plan_round(self) -> None:
        """Idle instances with news plan, in rounds, until none has news (releases made by one round's
        pulls are applied after it, as the live prefill worker hears of a pull after the decode plans)."""
        while self.newsy:
            ready = sorted(self.newsy, key=lambda i: i.idx)
            self.newsy = []
            for inst in ready:
                inst.news = False
                self._start(inst)
            releases, self.releases = self.releases, []
            for p, rid in releases:
                p.sched.release(rid)
                self._news(p)
            if self.check_kv:
                self._check_kv()

    def _news(self, inst: _Instance) -> None:
        """Have the instance plan once the current instant's events are all applied."""
        if not inst.news:
            inst.news = True
            self.newsy.append(inst)

    def _start(self, inst: _Instance) -> None:
        """Plan the instance's next iteration if it is idle; start it if it runs anything."""
        if inst.inflight is not None or inst.state == "flipping":
            return
        plan = inst.sched.schedule(self.now)
        if plan is None:
            self._check_drained(inst)
            return
        now = self.now
        if self.on_plan is not None:
            self.on_plan(inst.iid, now, plan)
        for rid in plan.preempted:
            self.reqs[rid].preempt += 1
        for rid in plan.rejected:
            req = self.reqs[rid]
            inst.outstanding -= 1
            self.rejected.append(RejectedRecord(rid, req.arrival, now, inst.iid))
            self._finish(req)
        for rid in plan.pulled:
            req = self.reqs[rid]
            assert req.p_inst is not None
            self.releases.append((req.p_inst, rid))
            # what the decode instance's prefix cache holds of the prompt is not transferred
            self._push(now + self.cost.transfer_time(inst.sched.transfer_tokens(rid)), _LOADED, req)
        if not plan.pieces:
            self._check_drained(inst)  # its last requests may just have been turned away
            return
        if plan.kind != "decode":
            for piece in plan.pieces:  # a chunk's few pieces (mixed: the decodes' requests started long ago)
                req = self.reqs[piece.request_id]
                if req.prefill_start is None:
                    req.prefill_start = now
        if plan.kind != "prefill" and inst.starting:  # requests about to decode for the first time
            ids = {p.request_id for p in plan.pieces}
            for req in inst.starting:
                if req.sched.request_id in ids:
                    req.decode_start = now
            inst.starting = [r for r in inst.starting if r.decode_start is None and r.finish is None]
        inst.inflight = plan
        if inst.first is None:
            inst.first = now
        if plan.kind == "prefill":
            inst.p_iters += 1
        elif plan.kind == "decode":
            inst.d_iters += 1
        else:
            inst.m_iters += 1
        self._push(now + plan.duration, _DONE, inst)

    def _iteration_done(self, inst: _Instance) -> None:
        plan = inst.inflight
        assert plan is not None
        inst.inflight = None
        inst.busy_s += plan.duration
        inst.last = self.now
        self._outcome(inst, inst.sched.complete(plan), plan.kind != "decode")
        self._news(inst)

    def _outcome(self, inst: _Instance, out: Outcome, prefill: bool) -> None:
        now = self.now
        for rid, hit in out.cached:  # prompts done: how much of each its prefill found cached
            self.reqs[rid].cached = hit
        if prefill:  # first tokens come from prefills only (a prefill or mixed iteration)
            for rid, index in out.tokens:
                if index == 0:
                    req = self.reqs[rid]
                    req.first_token = now
                    if inst.role == "colocated":
                        inst.starting.append(req)  # decodes from its next step (unless it just finished)
        for rid in out.prefilled:  # prefill role: the prompt is done, its KV held here
            req = self.reqs[rid]
            inst.outstanding -= 1
            if req.out == 1:  # nothing to decode: the KV is not needed
                inst.sched.release(rid)
                self._finish(req)
            else:
                self._dispatch(req)
        for rid in out.finished:
            if inst.role == "colocated":
                inst.outstanding -= 1
            self._finish(self.reqs[rid])

    # --- arrivals, routing, dispatch -----------------------------------------------------------

    def _feed_index(self) -> None:
        """Each instance's cache events since the last feed, to the index (as its worker reports them)."""
        for inst in self.instances:
            stored, removed = inst.sched.drain_cache_events()
            if inst.seq < 0 or stored or removed:
                inst.seq += 1
                batch = CacheEvents(inst.epoch, inst.seq, inst.seq == 0, tuple(stored), tuple(removed), self.block)
                self.index.apply(inst.iid, batch)

    def _entry(self, role: str, req: _Req) -> tuple[_Instance, int] | None:
        """Where a request would start among the active instances in `role`, by the `routing` policy
        (`tetri.scheduling.routing`), and the prompt tokens that instance's prefix cache holds."""
        loads = [
            InstanceLoad(
                i.iid, kv_used_tokens=i.sched.kv_used, kv_capacity_tokens=i.sched.capacity, inflight=i.outstanding
            )
            for i in self.instances
            if i.role == role and i.state == "active"
        ]
        if not loads:
            return None
        pol = self.policy
        least = min(loads, key=load_key)
        hits: dict[str, int] = {}
        if req.keys:
            cand = [x.instance_id for x in loads] if pol.routing == "cache-aware" else None
            if cand is not None:
                hits = {iid: n * self.block for iid, n in self.index.match_keys(req.keys, self.block, cand).items()}
        if pol.routing == "round-robin":
            chosen = round_robin([x.instance_id for x in loads], self.turns[role])
        elif pol.routing == "cache-aware" and hits:
            chosen = cache_aware(
                least, [(x, hits[x.instance_id]) for x in loads if x.instance_id in hits], pol.cache_slack
            ).instance_id
        else:
            chosen = least.instance_id
        assert chosen is not None
        if req.keys and pol.routing != "cache-aware":  # what it holds still counts for the P/D choice
            hits = {iid: n * self.block for iid, n in self.index.match_keys(req.keys, self.block, [chosen]).items()}
        return self.by_id[chosen], hits.get(chosen, 0)

    def _arrive(self, req: _Req) -> None:
        if req.keys:
            self._feed_index()
        colocated = self._entry("colocated", req)
        prefill = self._entry("prefill", req)
        entry = colocated or prefill
        decoding = any(i.role == "decode" and i.state == "active" for i in self.instances)
        if colocated is not None and prefill is not None and decoding:  # both paths open: the request's (routing.py)
            pol = self.policy
            path = choose_path(
                pol.pd_route,
                req.prompt - colocated[1],  # what the colocated entry would compute
                req.predicted,
                self._backlog(colocated[0]),
                self._backlog(prefill[0]),
                pol.pd_prompt_tokens,
                pol.pd_output_tokens,
                pol.pd_backlog_slack,
            )
            entry = colocated if path == "colocated" else prefill
        if entry is None:  # cannot happen: a flip never leaves the cluster unserved (flip_refusal)
            raise RuntimeError("no active instance to route to")
        inst = entry[0]
        self.turns[inst.role] += 1
        req.p_inst = inst
        inst.outstanding += 1
        inst.sched.add(req.sched)
        self._news(inst)

    @staticmethod
    def _backlog(inst: _Instance) -> InstanceLoad:
        u = inst.sched.usage()
        return InstanceLoad(inst.iid, u.waiting, u.running, inflight=inst.outstanding)

    def _dispatch(self, req: _Req) -> None:
        targets = [i for i in self.instances if i.role == "decode" and i.state == "active"]
        loads = []
        for i in targets:
            u = i.sched.usage()
            loads.append(
                DecodeLoad(i.iid, u.kv_used_tokens, u.kv_capacity_tokens, u.heavy, u.light, u.predicted_growth_tokens)
            )
        chosen = dispatch(self.policy.dispatch, loads, req.lo, self.rng, HEAVY_DECODE)
        if chosen is None:  # every decode instance is draining: the KV stays held until a flip ends
            self.undispatched.append(req)
            return
        d = self.by_id[chosen]
        req.d_inst = d
        d.sched.add(req.sched, produced=1)  # queued with its KV still on the prefill instance
        self._news(d)

    def _loaded(self, req: _Req) -> None:
        p, d = req.p_inst, req.d_inst
        assert p is not None and d is not None
        p.last = self.now if p.last is None else max(p.last, self.now)  # the transfer out of it ended
        if d.sched.loaded(req.sched.request_id):
            d.starting.append(req)
            self._news(d)

    def _finish(self, req: _Req) -> None:
        assert req.finish is None, f"request {req.sched.request_id} finished twice"
        req.finish = self.now
        self.done += 1

    def _check_kv(self) -> None:
        """KV conservation: per instance, used = Σ held ≤ capacity; every request that has arrived and not
        finished is on some instance and charged to at most one, and to exactly one unless it is only
        waiting (for its prefill's KV admission, or preempted)."""
        for inst in self.instances:
            inst.sched.check()
        for rid, req in self.reqs.items():
            if req.p_inst is None or req.finish is not None:
                continue
            phases = [(i.iid, i.sched.phase(rid)) for i in self.instances if rid in i.sched]
            charged = [iid for iid, ph in phases if ph in _CHARGED]
            if not phases:
                raise AssertionError(f"request {rid} is on no instance")
            if len(charged) > 1:
                raise AssertionError(f"request {rid} charged to {', '.join(charged)}")
            if not charged and any(ph is not Phase.WAITING for _, ph in phases):
                raise AssertionError(f"request {rid} has KV charged nowhere ({phases})")

    # --- instance flips ------------------------------------------------------------------------

    def _view(self, inst: _Instance) -> InstanceView:
        u = inst.sched.usage()
        queued = inst.outstanding if inst.role == "prefill" else u.waiting
        return InstanceView(inst.iid, inst.role, inst.state, u.kv_used_tokens / u.kv_capacity_tokens, queued)

    def _watch(self) -> None:
        assert self.watcher is not None
        advice = None
        if self.advisor is not None and self.transitions is not None and self.transitions.advice_due(self.now):
            active = [i.role for i in self.instances if i.state == "active"]
            recent = self._seen_since(self.now - self.policy.flip_window_s)
            advice = self.advisor.advise(recent, self.policy, active.count("prefill"), active.count("decode"))
        for decision in self.watcher.observe(self.now, [self._view(i) for i in self.instances], advice):
            self._begin_flip(decision)
        if self.done < len(self.reqs) and (self.pending or self._flip_open):
            self._push(self.now + self.cfg.watch_interval_s, _WATCH, None)

    def _seen_since(self, since: float) -> list[Seen]:
        """The requests that arrived at or after `since` (and by now), as the live daemon's status table
        shows them to the advisor (`Store.window_requests`): the answer's length once finished, the
        predictor's range before (tokens produced so far are written at the end, there as here)."""
        return [
            Seen(
                r.sched.request_id,
                r.arrival,
                r.prompt,
                r.sched.max_tokens,
                r.out if r.finish is not None else 0,
                r.finish is not None,
                r.predicted[1] if r.predicted is not None else None,
            )
            for r in self.reqs.values()
            if since <= r.arrival <= self.now
        ]

    def _begin_flip(self, decision: FlipDecision) -> None:
        inst = self.by_id.get(decision.instance_id)
        if inst is None:
            return
        active = Counter(i.role for i in self.instances if i.state == "active")
        draining = sum(1 for i in self.instances if i.role == "prefill" and i.state in ("draining", "flipping"))
        if flip_refusal(inst.iid, inst.role, inst.state, decision.to_role, active, draining) is not None:
            return
        inst.state = "draining"
        self._flip_open[inst.iid] = (decision, inst.role, self.now, None)
        self._check_drained(inst)

    def _check_drained(self, inst: _Instance) -> None:
        if inst.state != "draining" or inst.inflight is not None or len(inst.sched):
            return
        decision, role, started, _ = self._flip_open[inst.iid]
        self._flip_open[inst.iid] = (decision, role, started, self.now)
        inst.state = "flipping"
        self._push(self.now + self.cfg.flip_cost_s, _FLIPPED, inst)

    def _flipped(self, inst: _Instance) -> None:
        decision, role, started, drained = self._flip_open.pop(inst.iid)
        assert drained is not None
        old = inst.sched
        u = old.usage()
        inst.counted = [
            inst.counted[0] + old.padding_tokens,
            inst.counted[1] + old.preemptions,
            inst.counted[2] + old.recomputed_tokens,
            inst.counted[3] + u.prefix_query_tokens,
            inst.counted[4] + u.prefix_hit_tokens,
        ]
        inst.role = decision.to_role
        inst.roles.append(inst.role)
        inst.state = "active"
        inst.sched = self._scheduler(inst.role)
        inst.epoch, inst.seq = inst.epoch + 1, -1  # a new engine, an empty cache: the next feed says so
        self.flips.append(FlipRecord(inst.iid, role, inst.role, decision.reason, started, drained, self.now))
        waiting, self.undispatched = self.undispatched, deque()
        for req in waiting:  # those still without an active decode instance wait for the next flip
            self._dispatch(req)

    # --- result --------------------------------------------------------------------------------

    def _total(self, which: int) -> int:
        attr = ("padding_tokens", "preemptions", "recomputed_tokens")[which]
        return sum(i.counted[which] + getattr(i.sched, attr) for i in self.instances)

    def _result(self) -> RunResult:
        records = []
        gone = {x.request_id for x in self.rejected}
        for r in sorted(self.reqs.values(), key=lambda x: x.seq):
            if r.sched.request_id in gone:
                continue
            assert r.prefill_start is not None and r.first_token is not None and r.finish is not None
            assert r.p_inst is not None
            records.append(
                RequestRecord(
                    request_id=r.sched.request_id,
                    arrival=r.arrival,
                    prompt_len=r.prompt,
                    output_len=r.out,
                    prefill_start=r.prefill_start,
                    first_token=r.first_token,
                    decode_start=r.decode_start,
                    finish=r.finish,
                    prefill_instance=r.p_inst.iid,
                    decode_instance=r.d_inst.iid if r.d_inst is not None else (r.p_inst.iid if r.out > 1 else None),
                    preemptions=r.preempt,
                    predicted=r.predicted,
                    cached_tokens=r.cached,
                )
            )
        instances = []
        for i in self.instances:
            u = i.sched.usage()
            q, h = i.counted[3] + u.prefix_query_tokens, i.counted[4] + u.prefix_hit_tokens
            instances.append(
                InstanceRecord(i.iid, tuple(i.roles), i.busy_s, i.first, i.last, i.p_iters, i.d_iters, i.m_iters, q, h)
            )
        return RunResult(
            requests=records,
            instances=instances,
            flips=list(self.flips),
            preemptions=self._total(1),
            padding_tokens=self._total(0),
            recomputed_tokens=self._total(2),
            makespan=max((r.finish for r in self.reqs.values() if r.finish is not None), default=0.0),
            events=self.events,
            gpus=len(self.instances),
            rejected=sorted(self.rejected, key=lambda x: self.reqs[x.request_id].seq),
        )


def simulate(
    workload: Sequence[Request],
    config: ClusterConfig,
    *,
    watcher: FlipWatcher | None = None,
    on_plan: PlanHook | None = None,
    check_kv: bool = False,
) -> RunResult:
    """Run `workload` on the cluster `config` describes; deterministic for `config.seed`.

    `watcher` overrides the flip watcher the policy set implies (TransitionWatcher when `flip_policy` is
    not "off"); `on_plan(instance id, time, plan)` sees every plan an instance makes; `check_kv` checks
    the KV invariants at every instant (AssertionError when one breaks). Raises ValueError for a request
    that can never run (too long for the model or the KV)."""
    return _Sim(workload, config, watcher, on_plan, check_kv).run()
