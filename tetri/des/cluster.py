"""The discrete-event cluster simulator: TetriInfer (disaggregated) or vanilla vLLM (colocated) on the
roofline cost model, on a virtual clock.

A heap of events (arrival, iteration done, KV transfer done, watcher tick, flip done) ordered by
(time, sequence number); no asyncio, no sleeping, no wall clock; deterministic for a seed. Every
scheduling decision is made by the objects the live system uses (`tetri.scheduling`): `least_loaded`
routes arrivals, `ChunkedPrefill` / `order_prefill` order and chunk prompts, the predictor gives each
request its range, `dispatch` picks a decode instance, `admit` admits into the decode batch and a
`TransitionWatcher` decides flips. Time comes only from `CostModel`. The iteration rules mirror the
live sim engine (`workers/engines/sim.py`, docs/sim-engine.md):

* **Prefill instance** (TetriInfer): KV admission first — a prompt enters the scheduler when its whole
  KV fits in the free cache (FIFO, the head blocks), and its KV stays held until its transfer to the
  decode instance ends. The scheduler is one `ChunkedPrefill` (ChunkSize, fcfs/sjf/ljf within
  PrefillSchedBatch); an iteration runs one chunk and takes `prefill_batch_time` of its pieces (a later
  piece of a long prompt attends to the part already prefilled), the padding extending the last piece.
  With `chunked=False` (the ablation) whole prompts are batched in the same order, unpadded, up to
  `prefill_batch_tokens` (at least one).
* On a prompt's last chunk: first token (TTFT), `dispatch` to a decode instance, KV transfer of
  `transfer_time(prompt)` (transfers do not contend: each is emulated, as in the paper), then the
  decode instance's FCFS queue.
* **Decode instance**: continuous batching. Before each step: preempt the most recently admitted while
  the step would overflow the KV cache (recompute-style: it re-queues at the front; when re-admitted its
  context is recomputed within that step, which pays the prefill FLOPs of that context); then `admit`
  with the decode policy (remaining = predicted lower end − tokens produced, or max_tokens − produced
  without a predictor); then one token per running request, `decode_step_time(batch, KV)`.
* **Vanilla (colocated)**: vLLM's default prefill-first schedule: if `admit` (greedy) lets waiting
  prompts in, a prefill iteration over them, whole and unpadded, up to `prefill_batch_tokens` (a
  preempted request re-prefills its prompt and output so far); otherwise one decode step over the
  running batch with the preemption above.
* **Flips**: every `watch_interval_s` the watcher sees an `InstanceView` per instance; a decision drains
  the instance (a prefill instance gets no new arrivals and finishes its queue and transfers; a decode
  instance gets no new dispatches and finishes its queue and batch), then after `flip_cost_s` it serves
  the other role. Requests already queued elsewhere are not migrated.

Routing and dispatch read loads at decision time (as if load reports were instant). Per-event work is
proportional to the batch or the number of instances, never to the number of requests.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from tetri.costmodel import CostModel, Profile, load_profile
from tetri.scheduling.admission import Running, Waiting, admit
from tetri.scheduling.dispatch import DecodeLoad, dispatch
from tetri.scheduling.flip import FlipDecision, InstanceView, TransitionWatcher
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import OraclePredictor, make_predictor
from tetri.scheduling.prefill import ChunkedPrefill, FixedBatchPrefill, PrefillItem
from tetri.scheduling.routing import InstanceLoad, least_loaded

from .workloads import LIGHT_OUTPUT_MAX, Request

MODES = ("tetri", "vanilla")
HEAVY_DECODE_THRESHOLD = LIGHT_OUTPUT_MAX  # dispatch's heavy/light split: predicted output > 128 tokens

# Event kinds (the heap orders by time, then by a sequence number, so ties are deterministic).
_ARRIVE, _DONE, _XFER, _WATCH, _FLIPPED = range(5)
_Plan = tuple[str, list[Any], float]  # an iteration: kind, what it carries, duration


@dataclass(frozen=True)
class ClusterConfig:
    """What to simulate. `instances` GPUs in all (one instance = one GPU); TetriInfer mode splits them
    into `prefill_instances` prefill and the rest decode; vanilla runs them all colocated."""

    mode: str = "tetri"
    profile: str | Profile = "opt-13b-v100"
    instances: int = 2
    prefill_instances: int = 1
    policy: PolicySet = field(default_factory=PolicySet)
    chunked: bool = True
    prefill_batch_tokens: int | None = None  # whole-prompt budget; None: max(max_model_len, profile's)
    watch_interval_s: float = 1.0
    flip_cost_s: float = 0.0  # assumed: a role change reuses the loaded weights
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.instances < 1 or (self.mode == "tetri" and self.instances < 2):
            raise ValueError(f"{self.mode} needs more instances than {self.instances}")
        if self.mode == "tetri" and not 1 <= self.prefill_instances < self.instances:
            raise ValueError(f"need 1 ≤ prefill instances < {self.instances}, got {self.prefill_instances}")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError("prefill_batch_tokens must be positive")
        if self.watch_interval_s <= 0 or self.flip_cost_s < 0:
            raise ValueError("watch interval must be positive and flip cost non-negative")


class FlipWatcher(Protocol):
    """What the simulator asks about flips: `TransitionWatcher`, or a scripted one in tests."""

    def observe(self, now: float, instances: Sequence[InstanceView]) -> list[FlipDecision]: ...


@dataclass(frozen=True)
class RequestRecord:
    """One request's life. Times are seconds of model time; `decode_start` is the start of its first
    decode step (None if its only token came from the prefill)."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    prefill_start: float
    first_token: float
    decode_start: float | None
    finish: float
    prefill_instance: str
    decode_instance: str | None
    preemptions: int
    predicted: tuple[int, int] | None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def jct(self) -> float:
        return self.finish - self.arrival

    @property
    def prefill_wait(self) -> float:
        return self.prefill_start - self.arrival


@dataclass(frozen=True)
class InstanceRecord:
    """One instance (= one GPU): roles held in order, seconds spent in iterations, and the span from
    its first activity (start of its first iteration) to its last (end of its last iteration, or of the
    last KV transfer out of it)."""

    instance_id: str
    roles: tuple[str, ...]
    busy_s: float
    first_activity: float | None
    last_activity: float | None
    prefill_iterations: int
    decode_iterations: int

    @property
    def span_s(self) -> float:
        if self.first_activity is None or self.last_activity is None:
            return 0.0
        return self.last_activity - self.first_activity


@dataclass(frozen=True)
class FlipRecord:
    instance_id: str
    from_role: str
    to_role: str
    reason: str
    started: float  # the watcher's decision: drain begins
    drained: float  # no work left on it
    done: float  # serving the new role


@dataclass(frozen=True)
class RunResult:
    """What a run produced: per request, per instance, flips and totals. A live runner produces the same."""

    requests: list[RequestRecord]
    instances: list[InstanceRecord]
    flips: list[FlipRecord]
    preemptions: int
    padding_tokens: int  # chunk padding: prefill compute spent on no token
    recomputed_tokens: int  # KV rebuilt after preemptions
    makespan: float
    events: int


class _Req:
    __slots__ = (
        "arrival",
        "d_inst",
        "decode_start",
        "finish",
        "first_token",
        "heavy",
        "kv",
        "lo",
        "max_tokens",
        "n_out",
        "out",
        "p_inst",
        "predicted",
        "preempt",
        "prefill_start",
        "prompt",
        "recompute",
        "rid",
        "seq",
    )

    def __init__(self, r: Request, seq: int, predicted: tuple[int, int] | None) -> None:
        self.rid = r.request_id
        self.seq = seq
        self.arrival = r.arrival
        self.prompt = r.prompt_len
        self.out = r.output_len
        self.max_tokens = r.max_tokens
        self.predicted = predicted
        self.lo = predicted[0] if predicted is not None else None
        self.heavy = self.lo is not None and self.lo > HEAVY_DECODE_THRESHOLD
        self.n_out = 0  # output tokens produced (the first comes from the prefill)
        self.kv = 0  # KV tokens held on its current instance
        self.recompute = False
        self.preempt = 0
        self.prefill_start: float | None = None
        self.first_token: float | None = None
        self.decode_start: float | None = None
        self.finish: float | None = None
        self.p_inst: _Instance | None = None
        self.d_inst: _Instance | None = None

    def remaining(self, prefill_pending: bool = False) -> int:
        """Predicted tokens still to produce (≥ 1), what admission reserves for. `prefill_pending`: a
        colocated request not decoding yet, whose next token comes from its prefill and takes no slot."""
        target = self.max_tokens if self.lo is None else self.lo
        return max(1, target - self.n_out - (1 if prefill_pending else 0))

    def predicted_left(self) -> int:
        """Predicted growth still ahead for the dispatcher's load (0 without a prediction)."""
        return 0 if self.lo is None else max(0, self.lo - self.n_out)


class _Instance:
    __slots__ = (
        "busy",
        "busy_s",
        "cap",
        "chunker",
        "d_iters",
        "dirty",
        "first",
        "growth",
        "heavy",
        "idx",
        "iid",
        "incoming",
        "inflight",
        "kv_held",
        "last",
        "light",
        "outstanding",
        "p_iters",
        "padding_done",
        "prefilling",
        "role",
        "roles",
        "running",
        "state",
        "used",
        "waiting",
    )

    def __init__(self, iid: str, idx: int, role: str, cap: int) -> None:
        self.iid = iid
        self.idx = idx
        self.role = role
        self.roles = [role]
        self.state = "active"
        self.cap = cap
        self.busy = False
        self.dirty = False  # queued to look for work at the end of the current instant
        self.inflight: _Plan | None = None
        # prefill role
        self.chunker: ChunkedPrefill | FixedBatchPrefill | None = None
        self.prefilling = 0  # prompts whose KV is reserved and whose prefill is not done
        self.kv_held = 0  # KV reserved for prompts in the scheduler, and prefilled KV not yet transferred
        self.outstanding = 0  # routed here, not yet done with this instance (router's in-flight count)
        self.padding_done = 0  # padding of chunkers this instance had before a flip
        # decode and colocated roles
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []  # admission order: the last is preempted first
        self.used = 0  # KV tokens held by running requests
        self.incoming = 0  # dispatched here, KV still in transfer
        self.heavy = 0  # requests here (incoming, queued, running) predicted heavy
        self.light = 0
        self.growth = 0  # Σ predicted tokens still to produce, for dispatch
        # stats
        self.busy_s = 0.0
        self.first: float | None = None
        self.last: float | None = None
        self.p_iters = 0
        self.d_iters = 0


class _Sim:
    def __init__(self, workload: Sequence[Request], config: ClusterConfig, watcher: FlipWatcher | None) -> None:
        self.cfg = config
        profile = config.profile if isinstance(config.profile, Profile) else load_profile(config.profile)
        self.profile = profile
        self.cost = CostModel(profile)
        self.cap = self.cost.kv_capacity_tokens()
        self.max_seqs = profile.max_num_seqs
        self.policy = config.policy
        self.batch_tokens = config.prefill_batch_tokens or max(profile.model.max_model_len, profile.max_batched_tokens)
        pol = self.policy
        if pol.predictor == "learned":
            raise ValueError("the simulator has no prompts to learn from: use predictor none or oracle")
        predictor = make_predictor(pol.predictor, pol.predictor_accuracy, pol.predictor_granularity, config.seed)
        self.rng = random.Random(config.seed)
        if config.mode == "tetri":
            n_p = config.prefill_instances
            roles = ["prefill"] * n_p + ["decode"] * (config.instances - n_p)
        else:
            roles = ["colocated"] * config.instances
        self.instances = [_Instance(f"{r[0]}{i}", i, r, self.cap) for i, r in enumerate(roles)]
        for inst in self.instances:
            if inst.role == "prefill":
                inst.chunker = self._new_chunker()
        self.by_id = {inst.iid: inst for inst in self.instances}
        self.watcher: FlipWatcher | None = watcher
        if self.watcher is None and pol.flip_policy != "off" and config.mode == "tetri":
            self.watcher = TransitionWatcher(pol.flip_policy, pol.flip_low, pol.flip_high, pol.flip_window_s)
        # requests, validated
        self.reqs: dict[str, _Req] = {}
        ordered = sorted(enumerate(workload), key=lambda x: (x[1].arrival, x[0]))
        for seq, (_, r) in enumerate(ordered):
            self._validate(r)
            if r.request_id in self.reqs:
                raise ValueError(f"request id {r.request_id!r} appears twice")
            pred = predictor.predict((), r.request_id, r.output_len) if isinstance(predictor, OraclePredictor) else None
            self.reqs[r.request_id] = _Req(r, seq, pred)
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.pending = 0  # events other than watcher ticks in the heap
        self.dirty: list[_Instance] = []
        self.now = 0.0
        self.events = 0
        self.done = 0
        self.preemptions = 0
        self.recomputed = 0
        self.flips: list[FlipRecord] = []
        self._flip_open: dict[str, tuple[FlipDecision, str, float, float | None]] = {}
        self.undispatched: deque[_Req] = deque()
        for req in self.reqs.values():
            self._push(req.arrival, _ARRIVE, req)
        if self.watcher is not None and self.reqs:
            self._push(config.watch_interval_s, _WATCH, None)

    def _new_chunker(self) -> ChunkedPrefill | FixedBatchPrefill:
        p = self.policy
        if self.cfg.chunked:
            return ChunkedPrefill(p.chunk_size, p.prefill_policy, p.prefill_sched_batch, pad=True)
        return FixedBatchPrefill(p.prefill_policy, p.prefill_sched_batch)

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
            # Every event of one instant is handled before any idle instance plans its next iteration, so
            # requests arriving together (a burst) are scheduled together.
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
                elif kind == _XFER:
                    assert isinstance(obj, _Req)
                    self._transfer_done(obj)
                elif kind == _WATCH:
                    self._watch()
                else:
                    assert isinstance(obj, _Instance)
                    self._flipped(obj)
            dirty, self.dirty = self.dirty, []
            for inst in sorted(dirty, key=lambda i: i.idx) if len(dirty) > 1 else dirty:
                inst.dirty = False
                self._start(inst)
        if self.done != len(self.reqs):
            raise RuntimeError(f"simulation ended with {len(self.reqs) - self.done} requests unfinished")
        return self._result()

    def _kick(self, inst: _Instance) -> None:
        """Have the instance look for work once the current instant's events are all handled."""
        if not inst.dirty:
            inst.dirty = True
            self.dirty.append(inst)

    def _start(self, inst: _Instance) -> None:
        """Start the instance's next iteration if it is idle and has work."""
        if inst.busy or inst.state == "flipping":
            return
        plan: _Plan | None
        if inst.role == "prefill":
            plan = self._plan_prefill(inst)
        elif inst.role == "decode":
            plan = self._plan_decode(inst, admit_waiting=True)
        else:
            plan = self._plan_colocated(inst)
        if plan is None:
            self._check_drained(inst)
            return
        kind, payload, duration = plan
        inst.busy = True
        inst.inflight = (kind, payload, duration)
        if inst.first is None:
            inst.first = self.now
        if kind == "prefill":
            inst.p_iters += 1
        else:
            inst.d_iters += 1
        self._push(self.now + duration, _DONE, inst)

    def _iteration_done(self, inst: _Instance) -> None:
        assert inst.inflight is not None
        kind, payload, duration = inst.inflight
        inst.busy = False
        inst.inflight = None
        inst.busy_s += duration
        inst.last = self.now
        if kind == "prefill" and inst.role == "prefill":
            self._prefill_done(inst, payload)
        elif kind == "prefill":
            self._colocated_prefill_done(inst, payload)
        else:
            self._decode_done(inst)
        self._kick(inst)

    # --- arrivals and routing ------------------------------------------------------------------

    def _arrive(self, req: _Req) -> None:
        role = "prefill" if self.cfg.mode == "tetri" else "colocated"
        targets = [i for i in self.instances if i.role == role and i.state == "active"]
        loads = [
            InstanceLoad(i.iid, kv_used_tokens=i.kv_held + i.used, kv_capacity_tokens=i.cap, inflight=i.outstanding)
            for i in targets
        ]
        chosen = least_loaded(loads)
        if chosen is None:  # cannot happen: the last instance of a role never flips
            raise RuntimeError("no active instance to route to")
        inst = self.by_id[chosen]
        req.p_inst = inst
        inst.outstanding += 1
        inst.waiting.append(req)
        self._kick(inst)

    # --- prefill instances ---------------------------------------------------------------------

    def _plan_prefill(self, inst: _Instance) -> _Plan | None:
        """KV admission first (FIFO: a prompt enters the scheduler when its whole KV fits in the free
        cache; the head blocks those behind it), then the scheduler's next iteration: a padded ChunkSize
        chunk from `ChunkedPrefill`, or (chunked off) whole prompts up to the token budget."""
        chunker = inst.chunker
        assert chunker is not None
        waiting = inst.waiting
        while waiting and inst.prefilling < self.max_seqs and inst.kv_held + waiting[0].prompt <= inst.cap:
            req = waiting.popleft()
            inst.kv_held += req.prompt
            inst.prefilling += 1
            chunker.add(PrefillItem(req.rid, req.prompt, req.seq))
        if not len(chunker):
            return None
        now = self.now
        if isinstance(chunker, ChunkedPrefill):
            got = chunker.next_chunk()
            assert got is not None
            chunk, completed = got
            costs: list[tuple[int, int]] = []
            for rid, first, n in chunk.pieces:
                if first == 0:
                    self.reqs[rid].prefill_start = now
                costs.append((n, first))
            # Padding costs compute: it extends the last piece up to ChunkSize (as the live engine).
            costs[-1] = (costs[-1][0] + chunk.padding, costs[-1][1])
            return "prefill", completed, self.cost.prefill_batch_time(costs)
        items = chunker.next_batch(self.batch_tokens)
        completed = [it.request_id for it in items]
        for rid in completed:
            self.reqs[rid].prefill_start = now
        return "prefill", completed, self.cost.prefill_batch_time((it.prompt_len, 0) for it in items)

    def _prefill_done(self, inst: _Instance, completed: list[str]) -> None:
        for rid in completed:
            req = self.reqs[rid]
            req.first_token = self.now
            req.n_out = 1
            inst.outstanding -= 1
            inst.prefilling -= 1
            if req.out == 1:
                inst.kv_held -= req.prompt
                self._finish(req)
                continue
            self._dispatch(req)

    def _dispatch(self, req: _Req) -> None:
        targets = [i for i in self.instances if i.role == "decode" and i.state == "active"]
        loads = [DecodeLoad(i.iid, i.used, i.cap, i.heavy, i.light, i.growth) for i in targets]
        chosen = dispatch(self.policy.dispatch, loads, req.lo, self.rng, HEAVY_DECODE_THRESHOLD)
        if chosen is None:  # every decode instance is draining: wait for a flip to finish
            self.undispatched.append(req)
            return
        d = self.by_id[chosen]
        req.d_inst = d
        d.incoming += 1
        if req.heavy:
            d.heavy += 1
        else:
            d.light += 1
        d.growth += req.predicted_left()
        self._push(self.now + self.cost.transfer_time(req.prompt), _XFER, req)

    def _transfer_done(self, req: _Req) -> None:
        p, d = req.p_inst, req.d_inst
        assert p is not None and d is not None
        p.kv_held -= req.prompt
        p.last = self.now if p.last is None else max(p.last, self.now)
        d.incoming -= 1
        d.waiting.append(req)
        self._kick(d)
        self._kick(p)

    # --- decode instances ----------------------------------------------------------------------

    def _preempt_overflow(self, inst: _Instance) -> None:
        running = inst.running
        while running and inst.used + len(running) > inst.cap:
            req = running.pop()
            inst.used -= req.kv
            req.kv = 0
            req.recompute = inst.role == "decode"
            req.preempt += 1
            self.preemptions += 1
            inst.waiting.appendleft(req)

    def _plan_decode(self, inst: _Instance, admit_waiting: bool) -> _Plan | None:
        self._preempt_overflow(inst)
        running = inst.running
        extra = 0.0
        if admit_waiting and inst.waiting and len(running) < self.max_seqs:
            head = inst.waiting[0]
            if inst.used + len(running) + head.prompt + head.n_out <= inst.cap:  # the head fits now
                extra = self._admit(inst)
        if not running:
            return None
        now = self.now
        for req in running:
            req.kv += 1  # the slot of the token this step feeds
            if req.decode_start is None:
                req.decode_start = now
        inst.used += len(running)
        return "decode", [], self.cost.decode_step_time(len(running), inst.used) + extra

    def _admit(self, inst: _Instance) -> float:
        """Admit with the decode policy; returns the recomputation time admitted requests add."""
        running = inst.running
        free = inst.cap - inst.used - len(running)
        room = self.max_seqs - len(running)
        prefix: list[_Req] = []
        need = 0
        # Only the requests that could fit now are shown to `admit` (it stops at the first misfit), so
        # the work is bounded by the batch, not by the queue.
        for w in islice(inst.waiting, room):
            need += w.prompt + w.n_out  # context (prompt + tokens fed so far) + the step's slot
            if need > free:
                break
            prefix.append(w)
        if not prefix:
            return 0.0
        ids = admit(
            self.policy.decode_admission,
            [Running(r.rid, r.kv, r.remaining()) for r in running],
            [Waiting(w.rid, w.prompt + w.n_out - 1, w.remaining()) for w in prefix],
            inst.cap,
            self.max_seqs,
        )
        extra = 0.0
        for rid in ids:
            req = inst.waiting.popleft()
            assert req.rid == rid, "admission must take a prefix of the FCFS queue"
            cached = req.prompt + req.n_out - 1
            req.kv = cached
            inst.used += cached
            running.append(req)
            if req.recompute:  # rebuild its KV within this step (as the live sim engine does)
                req.recompute = False
                self.recomputed += cached
                extra += self.cost.prefill_flops(cached) / self.cost.effective_flops
        return extra

    def _decode_done(self, inst: _Instance) -> None:
        finished = False
        track = inst.role == "decode"  # the dispatcher's predicted growth
        for req in inst.running:
            req.n_out += 1
            if track and req.lo is not None and req.lo >= req.n_out:
                inst.growth -= 1
            if req.n_out >= req.out:
                finished = True
        if finished:
            keep: list[_Req] = []
            for req in inst.running:
                if req.n_out >= req.out:
                    inst.used -= req.kv
                    req.kv = 0
                    if inst.role == "decode":
                        if req.heavy:
                            inst.heavy -= 1
                        else:
                            inst.light -= 1
                        inst.growth -= req.predicted_left()
                    else:
                        inst.outstanding -= 1
                    self._finish(req)
                else:
                    keep.append(req)
            inst.running = keep

    # --- colocated instances (vanilla vLLM) ----------------------------------------------------

    def _plan_colocated(self, inst: _Instance) -> _Plan | None:
        """vLLM's prefill-first iteration: the waiting prompts the admission policy (greedy for vanilla)
        lets in, whole, up to the token budget (at least one); if none, a decode step."""
        batch: list[_Req] = []
        if inst.waiting and len(inst.running) < self.max_seqs:
            head = inst.waiting[0]
            if inst.used + len(inst.running) + head.prompt + head.n_out + 1 <= inst.cap:  # the head fits now
                batch = self._admit_colocated(inst)
        if batch:
            return "prefill", batch, self.cost.prefill_batch_time((r.kv, 0) for r in batch)
        plan = self._plan_decode(inst, admit_waiting=False)
        return None if plan is None else ("decode", [], plan[2])

    def _admit_colocated(self, inst: _Instance) -> list[_Req]:
        running = inst.running
        free = inst.cap - inst.used - len(running)
        prefix: list[_Req] = []
        need = 0
        for w in islice(inst.waiting, self.max_seqs - len(running)):
            need += w.prompt + w.n_out + 1  # its prefill (prompt, plus output so far if recomputing) + a slot
            if need > free:
                break
            prefix.append(w)
        if not prefix:
            return []
        ids = admit(
            self.policy.decode_admission,
            [Running(r.rid, r.kv, r.remaining()) for r in running],
            [Waiting(w.rid, w.prompt + w.n_out, w.remaining(prefill_pending=True)) for w in prefix],
            inst.cap,
            self.max_seqs,
        )
        batch: list[_Req] = []
        total = 0
        for rid in ids:
            req = inst.waiting[0]
            assert req.rid == rid, "admission must take a prefix of the FCFS queue"
            need = req.prompt + req.n_out
            if batch and total + need > self.batch_tokens:
                break
            inst.waiting.popleft()
            req.kv = need
            inst.used += need
            total += need
            if req.n_out > 0:
                self.recomputed += need
            if req.prefill_start is None:
                req.prefill_start = self.now
            batch.append(req)
        return batch

    def _colocated_prefill_done(self, inst: _Instance, batch: list[_Req]) -> None:
        for req in batch:
            req.n_out += 1
            if req.first_token is None:
                req.first_token = self.now
            if req.n_out >= req.out:
                inst.used -= req.kv
                req.kv = 0
                inst.outstanding -= 1
                self._finish(req)
            else:
                inst.running.append(req)

    def _finish(self, req: _Req) -> None:
        assert req.finish is None, f"request {req.rid} finished twice"
        req.finish = self.now
        self.done += 1

    # --- instance flips ------------------------------------------------------------------------

    def _view(self, inst: _Instance) -> InstanceView:
        if inst.role == "prefill":
            return InstanceView(inst.iid, inst.role, inst.state, inst.kv_held / inst.cap, inst.outstanding)
        return InstanceView(inst.iid, inst.role, inst.state, inst.used / inst.cap, len(inst.waiting) + inst.incoming)

    def _watch(self) -> None:
        assert self.watcher is not None
        for decision in self.watcher.observe(self.now, [self._view(i) for i in self.instances]):
            self._begin_flip(decision)
        if self.done < len(self.reqs) and (self.pending or self._flip_open):
            self._push(self.now + self.cfg.watch_interval_s, _WATCH, None)

    def _begin_flip(self, decision: FlipDecision) -> None:
        inst = self.by_id.get(decision.instance_id)
        if inst is None or inst.state != "active" or inst.role == decision.to_role:
            return
        if inst.role not in ("prefill", "decode") or decision.to_role not in ("prefill", "decode"):
            return
        others = [i for i in self.instances if i is not inst and i.role == inst.role and i.state == "active"]
        if not others:
            return  # never the last active instance of a role
        inst.state = "draining"
        self._flip_open[inst.iid] = (decision, inst.role, self.now, None)
        self._check_drained(inst)

    def _check_drained(self, inst: _Instance) -> None:
        if inst.state != "draining" or inst.busy:
            return
        if inst.role == "prefill":
            empty = inst.chunker is not None and len(inst.chunker) == 0 and inst.kv_held == 0
        else:
            empty = not inst.running and not inst.waiting and inst.incoming == 0
        if not empty:
            return
        decision, role, started, _ = self._flip_open[inst.iid]
        self._flip_open[inst.iid] = (decision, role, started, self.now)
        inst.state = "flipping"
        self._push(self.now + self.cfg.flip_cost_s, _FLIPPED, inst)

    def _flipped(self, inst: _Instance) -> None:
        decision, role, started, drained = self._flip_open.pop(inst.iid)
        assert drained is not None
        if inst.chunker is not None:
            inst.padding_done += inst.chunker.wasted_tokens
        inst.role = decision.to_role
        inst.roles.append(inst.role)
        inst.state = "active"
        inst.chunker = self._new_chunker() if inst.role == "prefill" else None
        inst.heavy = inst.light = inst.growth = 0
        self.flips.append(FlipRecord(inst.iid, role, inst.role, decision.reason, started, drained, self.now))
        while self.undispatched:
            self._dispatch(self.undispatched.popleft())

    # --- result --------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        records = []
        for r in sorted(self.reqs.values(), key=lambda x: x.seq):
            assert r.prefill_start is not None and r.first_token is not None and r.finish is not None
            assert r.p_inst is not None
            records.append(
                RequestRecord(
                    request_id=r.rid,
                    arrival=r.arrival,
                    prompt_len=r.prompt,
                    output_len=r.n_out,
                    prefill_start=r.prefill_start,
                    first_token=r.first_token,
                    decode_start=r.decode_start,
                    finish=r.finish,
                    prefill_instance=r.p_inst.iid,
                    decode_instance=r.d_inst.iid if r.d_inst is not None else (r.p_inst.iid if r.out > 1 else None),
                    preemptions=r.preempt,
                    predicted=r.predicted,
                )
            )
        instances = [
            InstanceRecord(i.iid, tuple(i.roles), i.busy_s, i.first, i.last, i.p_iters, i.d_iters)
            for i in self.instances
        ]
        padding = sum(
            i.padding_done + (i.chunker.wasted_tokens if i.chunker is not None else 0) for i in self.instances
        )
        return RunResult(
            requests=records,
            instances=instances,
            flips=list(self.flips),
            preemptions=self.preemptions,
            padding_tokens=padding,
            recomputed_tokens=self.recomputed,
            makespan=max((r.finish for r in records), default=0.0),
            events=self.events,
        )


def simulate(workload: Sequence[Request], config: ClusterConfig, *, watcher: FlipWatcher | None = None) -> RunResult:
    """Run `workload` on the cluster `config` describes; deterministic for `config.seed`.

    `watcher` overrides the flip watcher the policy set implies (TransitionWatcher when `flip_policy` is
    not "off"). Raises ValueError for a request that can never run (too long for the model or the KV)."""
    return _Sim(workload, config, watcher).run()
