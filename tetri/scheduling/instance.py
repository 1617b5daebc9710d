"""The instance scheduler: every rule of one iteration of one prefill, decode or colocated instance.

Shaped like vLLM v1's scheduler: `add` a request, `schedule()` the next iteration (an `IterationPlan`:
which pieces of which requests run, padding, recomputation, admissions, preemptions, KV pulls and how
long the iteration takes on the cost model), `complete(plan)` when it has run (an `Outcome`: tokens
produced, prompts prefilled, requests finished), `loaded`, `release`, `abort`, `usage()`. It owns the
queues, the KV accounting, chunking, admission (every policy, plan order included), preemption and
"remaining". The live sim engine (`workers/engines/sim.py`) is a loop of schedule → sleep → complete
→ deliver tokens; the discrete-event simulator (`tetri/des/cluster.py`) is an event heap around the
same calls; so a policy behaves the same live and simulated (tests/des/test_parity.py compares the
plans exactly). Pure: no clock, no asyncio, no I/O.

Roles (docs/sim-engine.md has the details and the figures):

* ``prefill``: KV admission first — a prompt enters the prefill scheduler when its whole KV fits in the
  free cache (FIFO: the head blocks those behind it); then TetriInfer's chunked prefill
  (`ChunkedPrefill`: ChunkSize chunks, the last partial one padded, fcfs / sjf / ljf within
  PrefillSchedBatch groups) or, chunked off, whole prompts up to ``prefill_budget`` (`FixedBatchPrefill`).
  A prefilled prompt's KV stays **held** here until `release` — the decode instance has pulled it (or
  the request needs no decode). Held KV counts against the cache, so an instance full of un-pulled KV
  admits no more prompts (back-pressure), and `usage().held_tokens` shows it.
* ``decode``: a request arrives with its KV still on the prefill instance (`add(…, produced=1)`: state
  REMOTE, charged nowhere here). Each iteration: preempt the most recently admitted while the step would
  overflow the cache (recompute-style: it re-queues at the front and, when re-admitted, rebuilds its
  context within that step); admit with the decode policy (greedy / reserve-static / reserve-dynamic /
  plan, in plan order among the requests that are here). An admitted REMOTE request is **pulled**
  (`plan.pulled`): its KV is charged here from that moment (the prefill instance may free it) and it
  joins the running batch when the shell says it has `loaded`. Then one token per running request.
* ``colocated``: one of the schedules of `tetri.scheduling.colocated` (`policies.colocated_schedule`).
  ``prefill-first`` (the default): if the admission policy lets waiting prompts in, a prefill iteration
  over them, whole and unpadded, up to ``prefill_budget`` (at least one; a preempted request re-prefills
  its prompt and output so far); otherwise one decode step. ``vllm-v0``: the same, each prompt of a batch
  padded to the batch's longest (the budget counts the padding). ``vllm-v1``: every running request's
  next token, then prompt chunks up to the token budget ``token_budget`` in the same (mixed) iteration.

KV is conserved: a request's KV is charged to exactly one instance from its prefill's KV admission until
it finishes or is dropped (the charge moves to the decode instance when it pulls), and `check()`
verifies that used KV equals the sum of what the requests here hold and never exceeds capacity.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tetri.costmodel import CostModel

from .admission import Running, Waiting, admit, predicted_growth, remaining, srpt_work
from .policyset import PolicySet
from .prefill import ChunkedPrefill, FixedBatchPrefill, PrefillItem
from .prefix import cacheable_blocks
from .prefixcache import PrefixCache

ROLES = ("prefill", "decode", "colocated")
HEAVY_DECODE = 128  # tokens: a request predicted to produce more is a heavy decode (ShareGPT's median answer)
URGENT = 0.5  # token_budget: the share of ttft_target_s a prompt waits before an iteration takes the full budget


class Phase(enum.IntEnum):
    """Where a request is on this instance (a finished or dropped request is forgotten)."""

    WAITING = 0  # prefill: waiting for KV admission; colocated/decode: waiting for admission (decode: preempted)
    REMOTE = 1  # decode: KV still on the prefill instance, waiting for admission
    PREFILLING = 2  # KV charged, prompt (or recomputation) in progress
    LOADING = 3  # decode: admitted, KV being pulled; charged here
    RUNNING = 4  # decoding
    HELD = 5  # prefill: prompt done, KV held until the decode instance pulls it


@dataclass(frozen=True)
class SchedRequest:
    """What the scheduler knows of a request. `output_len`: the tokens it will produce (the sim engine
    never stops early: max_tokens; the simulator: the workload's answer length, ≤ max_tokens)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    predicted: tuple[int, int] | None = None
    output_len: int | None = None
    arrival: float = 0.0  # model seconds it reached this instance (`ttft_target_s`)
    # colocated: a migrated request whose client already has part of its answer (the prompt carries the
    # tokens streamed): started, like a preempted one — it goes first and is never late or rejected
    resumed: bool = False
    # the keys of the prompt's full blocks at the engine's block size (`tetri.scheduling.prefix`): what the
    # prefix cache matches and stores; () leaves the request out of the cache
    block_keys: tuple[int, ...] = ()

    @property
    def stop_at(self) -> int:
        return self.max_tokens if self.output_len is None else self.output_len


class Piece(NamedTuple):
    """Part of one request's work in an iteration: `tokens` computed after `start` tokens of context
    (prefill: prompt positions start … start + tokens − 1; decode: 1 token over `start` of context).
    A named tuple: a decode step makes one per running request, so it must be cheap to build."""

    request_id: str
    start: int
    tokens: int


@dataclass(frozen=True)
class IterationPlan:
    """One iteration as planned. `pieces` empty: nothing runs (the plan only pulls KV)."""

    kind: str  # "prefill", "decode" or "mixed" (vllm-v1: decodes first, then prefill pieces)
    pieces: tuple[Piece, ...]
    duration: float  # model seconds on the cost model
    kv_used: int  # KV tokens in use (held or reserved) while it runs
    padding: int = 0  # chunked prefill: tokens padding the chunk up to ChunkSize
    recompute_tokens: int = 0  # context rebuilt within this iteration after preemptions
    admitted: tuple[str, ...] = ()  # admitted by the decode-admission policy (decode, colocated)
    preempted: tuple[str, ...] = ()  # preempted before it (most recently admitted first)
    pulled: tuple[str, ...] = ()  # decode: admitted requests whose KV is now pulled from the prefill instance
    rejected: tuple[str, ...] = ()  # colocated, `ttft_miss` reject: requests dropped (gone from here) before it


@dataclass(frozen=True)
class Outcome:
    """What a completed iteration produced."""

    tokens: tuple[tuple[str, int], ...]  # (request id, output token index)
    prefilled: tuple[str, ...] = ()  # prefill role: prompts done, first token produced, KV held
    finished: tuple[str, ...] = ()  # produced their last token; their KV is free
    # (request id, prompt tokens its prefill found in the prefix cache) for each prompt done here
    cached: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Usage:
    kv_capacity_tokens: int
    kv_used_tokens: int
    held_tokens: int  # prefill: KV of prefilled prompts not yet pulled by a decode instance
    running: int  # prefilling (prefill: a chunk of it has run), loading or decoding
    waiting: int  # not started: waiting for KV admission or, admitted, for its first chunk (prefill); for
    # admission (decode: remote or preempted; colocated)
    held: int  # prefill: prompts done, KV not yet pulled
    preemptions: int
    heavy: int  # requests here predicted heavy (> HEAVY_DECODE tokens), for dispatch
    light: int
    predicted_growth_tokens: int  # Σ predicted tokens still to produce (0 for requests without a prediction)
    # the prefix cache (counters over the scheduler's life, new requests only, as vLLM counts them): prompt
    # tokens looked up, and found cached
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cached_blocks: int = 0  # blocks in the prefix cache (pinned and free)


class _Req:
    __slots__ = (
        "filled",
        "growth",
        "heavy",
        "hit",
        "kv",
        "n_out",
        "phase",
        "queried",
        "recompute",
        "refs",
        "req",
        "rid",
        "seq",
        "since",
        "stop",
        "stored",
    )

    def __init__(self, req: SchedRequest, phase: Phase, produced: int, seq: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.stop = req.stop_at  # tokens after which it is finished
        self.phase = phase
        self.n_out = produced  # output tokens produced so far (token indices 0 … n_out − 1)
        self.kv = 0  # KV tokens of its context here (its own, and those of the cached blocks it references)
        self.filled = 0  # tokens of its current prefill done so far (the prefill covers `kv` tokens)
        self.refs: list[int] = []  # the prefix-cache blocks it references (pinned): its hits, then blocks it cached
        self.hit = 0  # prompt tokens its latest admission found cached (the prefill starts after them)
        self.stored = 0  # leading prompt blocks it has referenced or tried to cache
        self.queried = False  # counted in the cache's query and hit counters (once, as vLLM counts)
        self.recompute = False  # decode: preempted, its context must be rebuilt when re-admitted
        self.seq = seq  # arrival order here: the prefill order's tie-break
        self.heavy = False
        self.growth = 0  # this request's part of the instance's predicted growth
        self.since = 0  # admissions here before it arrived (srpt's aging)


def is_heavy(predicted: tuple[int, int] | None) -> bool:
    """Dispatch's heavy/light split (TetriInfer §3.3.4): predicted lower end above HEAVY_DECODE; a
    request without a prediction is light (nothing is known about it)."""
    return predicted is not None and predicted[0] > HEAVY_DECODE


class InstanceScheduler:
    def __init__(
        self,
        role: str,
        cost: CostModel,
        policies: PolicySet | None = None,
        *,
        chunked: bool = True,
        prefill_budget: int | None = None,
        kv_capacity: int | None = None,
        max_num_seqs: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role '{role}'; known roles: {', '.join(ROLES)}")
        self.role = role
        self.cost = cost
        profile = cost.profile
        self.capacity = kv_capacity if kv_capacity is not None else cost.kv_capacity_tokens()
        self.max_num_seqs = max_num_seqs if max_num_seqs is not None else profile.max_num_seqs
        self.prefill_budget = (
            prefill_budget
            if prefill_budget is not None
            else max(profile.model.max_model_len, profile.max_batched_tokens)
        )
        if self.prefill_budget < 1:
            raise ValueError("prefill budget must be positive")
        # vllm-v1's tokens per iteration (max_num_batched_tokens): prompts are chunked to fit, so it need
        # not hold a whole context
        self.token_budget = prefill_budget if prefill_budget is not None else profile.max_batched_tokens
        self.policies = policies if policies is not None else PolicySet()
        self.chunked = bool(chunked)
        p = self.policies
        self._chunker = ChunkedPrefill(p.chunk_size, p.prefill_policy, p.prefill_sched_batch, pad=True)
        self._whole = FixedBatchPrefill(p.prefill_policy, p.prefill_sched_batch)
        self._chunked_applied = self.chunked
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._prefilling: dict[str, _Req] = {}  # insertion order
        self._loading: dict[str, _Req] = {}
        self._running: list[_Req] = []  # admission order: the last is preempted first
        self._held = 0  # prefill: prompts held
        self._held_tokens = 0
        # KV in use: Σ (each request's kv less its referenced cache blocks) + the pinned cache blocks; cache
        # blocks no request references sit in the room left and are evicted as it shrinks (`PrefixCache`)
        self._used = 0
        self._context = 0  # Σ kv: the context every request's attention reads (shared blocks once each)
        self.block_size = profile.block_size
        self.cache = PrefixCache(profile.block_size) if prefix_caching else None
        self._arrivals = itertools.count(1)
        self._plan_order: list[str] = []
        self._plan_set: set[str] = set()
        self._by_work: list[tuple[float, int, _Req]] = []  # srpt: waiting requests not started, by their work
        self._admissions = 0  # requests taken from the waiting queue so far (srpt's aging clock)
        self._now: float | None = None  # the model time of the iteration being planned
        self._heavy = self._light = self._growth = 0
        # counters, monotonic over the scheduler's life
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.prompt_tokens_processed = 0  # prefill tokens computed, recomputation included, padding not
        self.padding_tokens = 0
        self.admitted_by_policy = 0

    # --- requests in -----------------------------------------------------------------------------

    def add(self, req: SchedRequest, *, produced: int = 0) -> None:
        """A new request: prefill and colocated roles queue its prompt; the decode role queues it with its
        KV still remote and `produced` tokens already made (1: the prefill's first token)."""
        if req.request_id in self._reqs:
            raise ValueError(f"request {req.request_id} is already on this instance")
        if self.role == "decode":
            if produced < 1:
                raise ValueError("a decode instance takes requests whose first token is produced")
            r = _Req(req, Phase.REMOTE, produced, next(self._arrivals))
        else:
            r = _Req(req, Phase.WAITING, 0, next(self._arrivals))
        self._reqs[req.request_id] = r
        if req.resumed and self.role == "colocated":  # the started are the queue's front (`_srpt`, `_budget`)
            self._waiting.appendleft(r)
        else:
            self._waiting.append(r)
        if self.role != "prefill":  # the srpt order's queue, kept whatever the order (it is hot-swapped)
            r.since = self._admissions
            heapq.heappush(self._by_work, (self._work(r), r.seq, r))
        if self.role == "decode":
            r.heavy = is_heavy(req.predicted)
            if r.heavy:
                self._heavy += 1
            else:
                self._light += 1
            self._set_growth(r)

    def loaded(self, request_id: str) -> bool:
        """Decode: a pulled request's KV has arrived; it decodes from the next iteration."""
        r = self._reqs.get(request_id)
        if r is None or r.phase is not Phase.LOADING:
            return False
        del self._loading[request_id]
        r.phase = Phase.RUNNING
        self._running.append(r)
        self._cache_blocks(r, r.req.prompt_len)  # the prompt blocks it loaded are cached here now
        return True

    def release(self, request_id: str) -> bool:
        """Prefill: a held prompt's KV was pulled by its decode instance (or is not needed): free it."""
        r = self._reqs.get(request_id)
        if r is None or r.phase is not Phase.HELD:
            return False
        self._forget(r)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its KV. False if it is not here."""
        r = self._reqs.get(request_id)
        if r is None:
            return False
        phase = r.phase
        if phase in (Phase.WAITING, Phase.REMOTE):
            self._waiting.remove(r)
        elif phase is Phase.PREFILLING:
            del self._prefilling[request_id]
            if self.role == "prefill" and not self._chunker.remove(request_id):
                self._whole.remove(request_id)
        elif phase is Phase.LOADING:
            del self._loading[request_id]
        elif phase is Phase.RUNNING:
            self._running.remove(r)
        self._forget(r)
        self._prune()
        return True

    # --- policies ------------------------------------------------------------------------------------

    def configure(self, policies: PolicySet | None = None, *, chunked: bool | None = None) -> None:
        """Hot-swap the policies (and chunked prefill on/off) from the next iteration; work already
        ordered keeps its order, prompts part-way through a chunked prefill finish in the chunker."""
        if policies is not None:
            self._chunker.configure(policies.chunk_size, policies.prefill_policy, policies.prefill_sched_batch)
            self._whole.configure(policies.prefill_policy, policies.prefill_sched_batch)
            point_changed = policies.reserve_point != self.policies.reserve_point
            self.policies = policies
            if point_changed and self.role == "decode":
                for r in self._reqs.values():
                    self._set_growth(r)
        if chunked is not None:
            self.chunked = bool(chunked)

    def set_plan(self, order: Sequence[str]) -> None:
        """The planned admission order for the ``plan`` policy: ids not yet admitted (admitted ids are
        ignored; admitted, finished and aborted ids leave the plan). Planned requests are admitted in plan
        order among those here (one that has not arrived takes its place when it comes); waiting requests
        the plan does not name come after them."""
        kept = [
            rid
            for rid in dict.fromkeys(order)
            if (r := self._reqs.get(rid)) is None or r.phase in (Phase.WAITING, Phase.REMOTE)
        ]
        self._plan_order = kept
        self._plan_set = set(kept)

    # --- state ---------------------------------------------------------------------------------------

    @property
    def plan_order(self) -> tuple[str, ...]:
        """The planned ids not admitted yet (the ``plan`` policy)."""
        return tuple(self._plan_order)

    def phase(self, request_id: str) -> Phase | None:
        r = self._reqs.get(request_id)
        return None if r is None else r.phase

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def kv_used(self) -> int:
        """KV tokens charged here (what `usage()` reports, without building it)."""
        return self._used

    def usage(self) -> Usage:
        # a prefill instance admits prompts to its prefill queue eagerly (KV permitting): those with no
        # chunk run yet wait as much as those waiting for KV (the router's backlog, the load report's queue)
        queued = sum(1 for r in self._prefilling.values() if r.filled == r.hit) if self.role == "prefill" else 0
        cache = self.cache
        return Usage(
            kv_capacity_tokens=self.capacity,
            kv_used_tokens=self._used,
            held_tokens=self._held_tokens,
            running=len(self._prefilling) - queued + len(self._loading) + len(self._running),
            waiting=len(self._waiting) + queued,
            held=self._held,
            preemptions=self.preemptions,
            heavy=self._heavy,
            light=self._light,
            predicted_growth_tokens=self._growth,
            prefix_query_tokens=cache.query_tokens if cache is not None else 0,
            prefix_hit_tokens=cache.hit_tokens if cache is not None else 0,
            cached_blocks=cache.pinned + cache.free if cache is not None else 0,
        )

    def check(self) -> None:
        """The KV invariants: used KV is the sum of what the requests here hold, and within capacity."""
        b = self.block_size
        cache = self.cache
        pinned = cache.pinned if cache is not None else 0
        free = cache.free if cache is not None else 0
        held = sum(r.kv - len(r.refs) * b for r in self._reqs.values()) + pinned * b
        if held != self._used:
            raise AssertionError(f"KV used {self._used} ≠ Σ held by requests and pinned cache blocks {held}")
        if not 0 <= self._used <= self.capacity:
            raise AssertionError(f"KV used {self._used} outside [0, {self.capacity}]")
        if self._used + free * b > self.capacity:
            raise AssertionError(f"KV used {self._used} + {free} free cache blocks exceed {self.capacity}")
        if self._context != sum(r.kv for r in self._reqs.values()):
            raise AssertionError("the context count drifted")
        refs: dict[int, int] = {}
        for r in self._reqs.values():
            for key in r.refs:
                refs[key] = refs.get(key, 0) + 1
        if cache is not None and refs != cache._refs:
            raise AssertionError("the requests' cache references and the pinned blocks differ")
        for r in self._reqs.values():
            charged = r.phase in (Phase.PREFILLING, Phase.LOADING, Phase.RUNNING, Phase.HELD)
            if charged != (r.kv > 0):
                raise AssertionError(f"request {r.req.request_id} in {r.phase.name} holds {r.kv} KV tokens")

    # --- one iteration -------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> IterationPlan | None:
        """Plan the next iteration (None: nothing to do until a request arrives, loads or is released).
        `now`: the model time it starts at, for `ttft_target_s` (the shell's clock, passed as data)."""
        self._now = now
        if self.role == "prefill":
            return self._schedule_prefill()
        if self.role == "decode":
            return self._schedule_decode(admit_waiting=True)
        return self._schedule_colocated()

    def complete(self, plan: IterationPlan) -> Outcome:
        """The planned iteration has run: advance its requests. Requests aborted meanwhile are skipped."""
        if plan.kind == "prefill":
            return self._complete_prefill(plan.pieces)
        if plan.kind == "decode":
            return self._complete_decode(plan.pieces)
        # mixed: the decode pieces are those of running requests, the rest prefill pieces
        reqs, running = self._reqs, Phase.RUNNING
        decode = [p for p in plan.pieces if (r := reqs.get(p.request_id)) is not None and r.phase is running]
        prefill = [p for p in plan.pieces if (r := reqs.get(p.request_id)) is not None and r.phase is not running]
        d, f = self._complete_decode(decode), self._complete_prefill(prefill)
        return Outcome(d.tokens + f.tokens, f.prefilled, d.finished + f.finished, f.cached)

    # --- prefill role ----------------------------------------------------------------------------------

    def _sync_prefill_mode(self) -> None:
        """Apply a chunked on/off switch: prompts not started move to the other queue; prompts part-way
        through a chunked prefill stay in the chunker and finish there."""
        if self.chunked == self._chunked_applied:
            return
        self._chunked_applied = self.chunked
        if self.chunked:
            for item in self._whole.drain():
                self._chunker.add(item)
            return
        for r in self._prefilling.values():
            if r.filled == r.hit and self._chunker.remove(r.req.request_id):
                self._whole.add(PrefillItem(r.req.request_id, r.req.prompt_len, r.seq, r.hit))

    def _schedule_prefill(self) -> IterationPlan | None:
        rejected = self._reject_late()
        return self._with_rejected(self._plan_prefill(), rejected)

    def _plan_prefill(self) -> IterationPlan | None:
        self._sync_prefill_mode()
        while self._waiting and len(self._prefilling) < self.max_num_seqs:
            r = self._waiting[0]
            prompt = r.req.prompt_len
            if self._used + self._need(r, prompt, prompt) > self.capacity:
                break  # back-pressure: the free cache (held KV included) cannot take the head's prompt
            self._waiting.popleft()
            r.phase = Phase.PREFILLING
            r.filled = self._charge(r, prompt, prompt)  # the prefill starts after the cached blocks
            self._prefilling[r.req.request_id] = r
            queue = self._chunker if self.chunked else self._whole
            queue.add(PrefillItem(r.req.request_id, prompt, r.seq, r.hit))
        if len(self._chunker):  # chunked; or chunked off with prompts it had started
            step = self._chunker.next_chunk()
            assert step is not None
            chunk, _ = step
            pieces = tuple(Piece(rid, first, n) for rid, first, n in chunk.pieces)
            # Padding costs compute: it extends the last piece up to ChunkSize.
            costs = [(p.tokens, p.start) for p in pieces]
            costs[-1] = (costs[-1][0] + chunk.padding, costs[-1][1])
            self.padding_tokens += chunk.padding
            return IterationPlan(
                "prefill", pieces, self.cost.prefill_batch_time(costs), self._used, padding=chunk.padding
            )
        if len(self._whole):
            items = self._whole.next_batch(self.prefill_budget)
            pieces = tuple(Piece(x.request_id, x.cached, x.prompt_len - x.cached) for x in items)
            return IterationPlan("prefill", pieces, self._prefill_time(pieces), self._used)
        return None

    def _complete_prefill(self, pieces: Sequence[Piece]) -> Outcome:
        tokens: list[tuple[str, int]] = []
        prefilled: list[str] = []
        finished: list[str] = []
        cached: list[tuple[str, int]] = []
        for piece in pieces:
            r = self._reqs.get(piece.request_id)
            if r is None or r.phase is not Phase.PREFILLING:  # aborted during the iteration
                continue
            r.filled += piece.tokens
            self.prompt_tokens_processed += piece.tokens
            self._cache_blocks(r, r.filled)
            if r.filled < r.kv:
                continue
            del self._prefilling[piece.request_id]
            if r.n_out == 0:
                cached.append((piece.request_id, r.hit))
            tokens.append((piece.request_id, r.n_out))
            r.n_out += 1
            if self.role == "prefill":
                r.phase = Phase.HELD
                self._held += 1
                self._held_tokens += r.kv
                prefilled.append(piece.request_id)
            elif r.n_out >= r.stop:
                self._forget(r)
                finished.append(piece.request_id)
            else:
                r.phase = Phase.RUNNING
                self._running.append(r)
        return Outcome(tuple(tokens), tuple(prefilled), tuple(finished), tuple(cached))

    # --- colocated role (tetri.scheduling.colocated) -----------------------------------------------------

    def _schedule_colocated(self) -> IterationPlan | None:
        rejected = self._reject_late()
        schedule = self.policies.colocated_schedule
        if schedule == "vllm-v1":
            plan = self._schedule_mixed()
        else:
            plan = self._schedule_prefill_first(padded=schedule == "vllm-v0")
        return self._with_rejected(plan, rejected)

    def _with_rejected(self, plan: IterationPlan | None, rejected: tuple[str, ...]) -> IterationPlan | None:
        """The plan with the requests `_reject_late` turned away (an empty one when there is nothing to run)."""
        if not rejected:
            return plan
        if plan is None:
            kind = "prefill" if self.role == "prefill" else "decode"
            return IterationPlan(kind, (), 0.0, self._used, rejected=rejected)
        return dataclasses.replace(plan, rejected=rejected)

    def _reject_late(self) -> tuple[str, ...]:
        """`ttft_miss` reject (with `ttft_target_s`): the requests not started that have waited past the
        target leave now, rather than wait behind those that can still meet theirs; the shell answers
        each 429 (the client may retry elsewhere) and records it rejected. The requests not started are in
        arrival order in the queue (after the preempted), so the late ones are the first of them. A prefill
        instance's prompts not started are also those admitted to its prefill queue with no chunk run yet
        (its KV admission is eager); there the prefill order, not arrival, decides, so each is looked at."""
        target, now = self.policies.ttft_target_s, self._now
        if self.policies.ttft_miss != "reject" or not target or now is None:
            return ()
        late: list[str] = []
        if self.role == "prefill":
            queued = [r for r in self._prefilling.values() if r.filled == r.hit and not r.req.resumed]
            late = [r.req.request_id for r in queued if now - r.req.arrival > target]
        for r in self._waiting:
            if self._started(r) or r.req.resumed:  # a migrated request's client has part of its answer
                continue
            if now - r.req.arrival <= target:
                break
            late.append(r.req.request_id)
        for rid in late:
            self.abort(rid)
        return tuple(late)

    def _start_prefill(self, r: _Req) -> int:
        """Admit a waiting request to its (re-)prefill, charging its whole context; returns that context."""
        need = r.req.prompt_len + r.n_out  # the prompt, plus output so far when recomputing
        self._take_waiting(r)
        r.phase = Phase.PREFILLING
        r.filled = self._charge(r, need, need)  # the prefill starts after the cached blocks
        if r.n_out > 0:
            self.recomputed_tokens += need - r.filled
        self._prefilling[r.req.request_id] = r
        return need

    def _schedule_prefill_first(self, *, padded: bool) -> IterationPlan | None:
        """prefill-first (`padded`: vllm-v0): a prefill iteration over admitted prompts, else a decode step.
        Prompts part-way through a vllm-v1 prefill (the schedule was just switched) finish first."""
        admitted: list[str] = []
        pieces = [Piece(r.rid, r.filled, r.kv - r.filled) for r in self._prefilling.values()]
        longest = max((p.tokens for p in pieces), default=0)
        total = sum(p.tokens for p in pieces)
        for r in self._policy_admissions():
            need = r.req.prompt_len + r.n_out
            work = need - self._lookup(r, need) * self.block_size  # what its prefill computes
            batch = max(longest, work) * (len(pieces) + 1) if padded else total + work
            if pieces and batch > self.prefill_budget:
                break
            self._start_prefill(r)
            pieces.append(Piece(r.req.request_id, r.filled, need - r.filled))
            admitted.append(r.req.request_id)
            longest, total = max(longest, work), total + work
        if not pieces:
            return self._schedule_decode(admit_waiting=False)
        ps = tuple(pieces)
        if not padded:
            return IterationPlan("prefill", ps, self._prefill_time(ps), self._used, admitted=tuple(admitted))
        padding = longest * len(ps) - total  # each prompt padded to the longest: computed, not kept
        self.padding_tokens += padding
        duration = self.cost.prefill_batch_time((longest, p.start) for p in ps)
        return IterationPlan("prefill", ps, duration, self._used, padding=padding, admitted=tuple(admitted))

    def _schedule_mixed(self) -> IterationPlan | None:
        """vllm-v1: each running request's next token, then prompt chunks (those under way first, then
        newly admitted ones) while the token budget lasts, in one iteration."""
        preempted = self._preempt_to_fit()
        left = self._budget() - len(self._running)
        chunks: list[Piece] = []
        for r in self._prefilling.values():
            if left <= 0:
                break
            take = min(r.kv - r.filled, left)
            chunks.append(Piece(r.rid, r.filled, take))
            left -= take
        admitted: list[str] = []
        if left > 0:
            for r in self._policy_admissions():
                self._start_prefill(r)
                take = min(r.kv - r.filled, left)
                chunks.append(Piece(r.rid, r.filled, take))
                admitted.append(r.rid)
                left -= take
                if left <= 0:
                    break
        pieces = self._feed_running()
        context = sum(r.kv for r in self._running)
        if not pieces and not chunks:
            if not preempted:
                return None
            return IterationPlan("decode", (), 0.0, self._used, preempted=tuple(preempted))
        kind = "mixed" if pieces and chunks else ("decode" if pieces else "prefill")
        duration = self.cost.mixed_batch_time(((p.tokens, p.start) for p in chunks), len(pieces), context)
        return IterationPlan(
            kind, (*pieces, *chunks), duration, self._used, admitted=tuple(admitted), preempted=tuple(preempted)
        )

    # --- decode ----------------------------------------------------------------------------------------

    def _preempt_to_fit(self) -> list[str]:
        """Preempt the most recently admitted running requests while the next step's KV (a slot for each
        running request's token) would not fit; their ids, in that order."""
        running = self._running
        preempted: list[str] = []
        while running and self._used + len(running) > self.capacity:
            r = running.pop()
            preempted.append(r.req.request_id)
            self._preempt(r)
        return preempted

    def _budget(self) -> int:
        """vllm-v1's tokens this iteration. `token_budget` (0: the engine's `token_budget`) caps it, so
        that fewer prompt tokens ride with the decodes: an iteration is shorter, TPOT lower, a prompt takes
        more iterations. With `ttft_target_s`, the cap lifts for an iteration once the oldest prompt not
        started yet (waiting, or part-way through its prefill) has waited `URGENT` of the target: the TTFT
        slack is spent on TPOT, never the TTFT itself."""
        small = self.policies.token_budget
        if not small or small >= self.token_budget:
            return self.token_budget
        small = max(small, len(self._running) + 1)  # the decodes, and at least a token of prompt
        target, now = self.policies.ttft_target_s, self._now
        if target and now is not None:
            # the waiting queue holds the preempted first, then the others in arrival order (srpt takes
            # from its middle, which keeps the order): its first request not started is its oldest
            first = next((r for r in self._waiting if not self._started(r)), None)
            oldest = [r.req.arrival for r in self._prefilling.values() if not self._started(r)]
            if first is not None:
                oldest.append(first.req.arrival)
            if oldest and now - min(oldest) >= URGENT * target:
                return self.token_budget
        return small

    def _feed_running(self) -> list[Piece]:
        """One token for each running request in this step: its piece, and the KV slot the token takes."""
        pieces = [Piece(r.rid, r.kv, 1) for r in self._running]
        for r in self._running:
            r.kv += 1
        self._used += len(self._running)
        self._context += len(self._running)
        self._evict()
        return pieces

    def _schedule_decode(self, *, admit_waiting: bool) -> IterationPlan | None:
        running = self._running
        preempted = self._preempt_to_fit()
        admitted: list[str] = []
        pulled: list[str] = []
        recompute = 0
        if admit_waiting:
            for r in self._policy_admissions():
                self._take_waiting(r)
                rid = r.req.request_id
                admitted.append(rid)
                cached = r.req.prompt_len + r.n_out - 1  # the prompt and the output tokens fed so far
                # the prompt blocks cached here are neither pulled nor recomputed (the step computes a token)
                hit = self._charge(r, cached, cached + 1)
                if r.phase is Phase.REMOTE:  # pull the rest of its KV: the charge moves here now
                    r.phase = Phase.LOADING
                    self._loading[rid] = r
                    pulled.append(rid)
                else:  # preempted: rebuild its context within this step (recompute-style)
                    r.phase = Phase.RUNNING
                    r.recompute = False
                    recompute += cached - hit
                    running.append(r)
            self.recomputed_tokens += recompute
            self.prompt_tokens_processed += recompute
        if not running:
            if not pulled and not preempted:
                return None
            return IterationPlan(
                "decode",
                (),
                0.0,
                self._used,
                admitted=tuple(admitted),
                preempted=tuple(preempted),
                pulled=tuple(pulled),
            )
        pieces = self._feed_running()
        duration = self.cost.decode_step_time(len(running), self._context)
        if recompute:
            duration += self.cost.prefill_flops(recompute) / self.cost.effective_flops
        return IterationPlan(
            "decode",
            tuple(pieces),
            duration,
            self._used,
            recompute_tokens=recompute,
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            pulled=tuple(pulled),
        )

    def _complete_decode(self, pieces: Sequence[Piece]) -> Outcome:
        tokens: list[tuple[str, int]] = []
        finished: list[_Req] = []
        reqs, running = self._reqs, Phase.RUNNING
        for rid, _, _ in pieces:
            r = reqs.get(rid)
            if r is None or r.phase is not running:  # aborted during the iteration
                continue
            tokens.append((rid, r.n_out))
            r.n_out += 1
            if r.growth:
                self._growth -= 1
                r.growth -= 1
            if r.n_out >= r.stop:
                finished.append(r)
        if finished:
            done = set(map(id, finished))
            self._running = [r for r in self._running if id(r) not in done]
            for r in finished:
                self._forget(r)
        return Outcome(tuple(tokens), (), tuple(r.req.request_id for r in finished))

    def _preempt(self, r: _Req) -> None:
        self._uncharge(r)  # its cached blocks stay cached (free): its re-admission may hit them
        r.phase = Phase.WAITING
        r.recompute = self.role == "decode"
        self._waiting.appendleft(r)
        self.preemptions += 1

    # --- admission (decode and colocated roles) -------------------------------------------------------

    def _remaining(self, r: _Req) -> int:
        """Predicted tokens still to produce (`admission.remaining`); colocated: the token a pending
        prefill produces takes no KV slot, so a request not decoding yet needs one fewer."""
        pending = self.role == "colocated" and r.phase is not Phase.RUNNING
        return remaining(r.req.predicted, r.req.max_tokens, r.n_out + pending, self.policies.reserve_point)

    def _waiting_context(self, r: _Req) -> int:
        if self.role == "colocated":
            return r.req.prompt_len + r.n_out  # its prefill: the prompt, plus output so far when recomputing
        return r.req.prompt_len + r.n_out - 1  # decode: the prompt and the output tokens fed so far

    def _work(self, r: _Req) -> float:
        """srpt's key (`srpt_work`): a colocated prompt shares each iteration's token budget; the output
        counts at the predicted range's reserve point."""
        budget = self.token_budget if self.role == "colocated" else None
        return srpt_work(r.req.prompt_len, budget, self._remaining(r) if r.req.predicted is not None else None)

    def _started(self, r: _Req) -> bool:
        """A preempted (or, colocated, resumed) request: it goes first, as in vLLM (its client has part of
        its answer)."""
        return r.recompute or (self.role == "colocated" and (r.n_out > 0 or r.req.resumed))

    def _srpt(self, room: int) -> list[_Req]:
        """srpt: the preempted first, then the requests that waited while `aging_admissions` others were
        admitted (oldest first: nothing starves), then the least predicted work first (arrival breaks
        ties). The preempted are at the queue's front and the aged are the oldest, so both are a prefix
        of the queue; the rest come off the heap, whose entries for requests no longer waiting are
        dropped as they surface."""
        out: list[_Req] = []
        aged_at = self._admissions - self.policies.aging_admissions
        for r in self._waiting:
            if len(out) >= room or not (self._started(r) or r.since <= aged_at):
                break
            out.append(r)
        taken = {id(r) for r in out}
        heap, back = self._by_work, []
        while heap and len(out) < room:
            entry = heapq.heappop(heap)
            r = entry[2]
            if not self._in_queue(r):
                continue  # admitted, preempted (it comes first now) or gone: its entry is dropped
            back.append(entry)
            if id(r) not in taken:
                out.append(r)
        for entry in back:
            heapq.heappush(heap, entry)
        return out

    def _late(self, r: _Req) -> bool:
        """`ttft_target_s` (colocated): a request not started that has waited longer than the target can no
        longer meet it: it goes after every request that still can — until it has waited while
        `aging_admissions` others were admitted, when it goes first again (so it does not starve)."""
        target, now = self.policies.ttft_target_s, self._now
        if not target or now is None or self._started(r) or now - r.req.arrival <= target:
            return False
        return r.since > self._admissions - self.policies.aging_admissions

    def _in_order(self, n: int) -> Iterable[_Req]:
        """The first `n` waiting requests in `queue_order`."""
        return self._srpt(n) if self.policies.queue_order == "srpt" else itertools.islice(self._waiting, n)

    def _candidates(self, room: int) -> Iterable[_Req]:
        if self.policies.decode_admission != "plan":
            deadline = self.role == "colocated" and self.policies.ttft_target_s > 0 and self._now is not None
            if not deadline:
                return self._in_order(room)
            # the requests that can still meet their TTFT first (in the queue's order), then the late ones
            # (oldest first): the late are looked at and set aside, so this costs their number an iteration
            late = [r for r in self._waiting if self._late(r)]
            on_time = [r for r in self._in_order(room + len(late)) if not self._late(r)][:room]
            return on_time + late[: room - len(on_time)]
        planned = self._plan_set
        by_id = {r.req.request_id: r for r in self._waiting}
        preempted = [r for r in self._waiting if r.recompute and r.req.request_id not in planned]
        rest = [r for r in self._waiting if not r.recompute and r.req.request_id not in planned]
        # Planned requests that are here, in plan order. The plan does not wait for one that has not
        # arrived: it may be queued behind prefill KV held for the requests waiting here, so waiting could
        # stall this instance (or, idle, deadlock it); it takes its place in the order when it comes.
        in_plan = [by_id[rid] for rid in self._plan_order if rid in by_id]
        return [*preempted, *in_plan, *rest][:room]

    def _policy_admissions(self) -> list[_Req]:
        """The waiting requests the decode-admission policy admits now, in order (still queued). Each also
        fits in the next step's memory now. Only the candidates that could fit now are shown to the
        policy (it stops at the first misfit), so the work is bounded by the batch, not the queue."""
        active = len(self._prefilling) + len(self._loading) + len(self._running)
        room = self.max_num_seqs - active
        if room <= 0 or not self._waiting:
            return []
        step = self._used + len(self._running)  # the next step's memory with what runs now
        fit: list[_Req] = []
        computes = 1 if self.role == "decode" else 0  # a decode admission's step computes the next token
        for r in self._candidates(room):
            context = self._waiting_context(r)
            step += self._need(r, context, context + computes) + 1
            if step > self.capacity:
                break
            fit.append(r)
        if not fit:
            return []
        policy = self.policies.decode_admission
        holding = itertools.chain(self._prefilling.values(), self._loading.values(), self._running)
        ids = admit(
            policy,
            [Running(r.req.request_id, r.kv, self._remaining(r)) for r in holding],
            [Waiting(r.req.request_id, self._waiting_context(r), self._remaining(r)) for r in fit],
            self.capacity,
            self.max_num_seqs,
            [r.req.request_id for r in fit] if policy == "plan" else None,
        )
        chosen = {r.req.request_id: r for r in fit}
        return [chosen[rid] for rid in ids]

    def _take_waiting(self, r: _Req) -> None:
        if self._waiting and self._waiting[0] is r:
            self._waiting.popleft()
        else:
            self._waiting.remove(r)
        self.admitted_by_policy += 1
        self._admissions += 1
        self._unplan(r.req.request_id)
        self._prune()

    def _prune(self) -> None:
        """srpt's heap drops the entries of requests no longer waiting as they surface; when they are most
        of it, it is rebuilt from those still waiting (so it stays within twice the queue)."""
        if len(self._by_work) > 2 * len(self._waiting) + 64:
            self._by_work = [e for e in self._by_work if self._in_queue(e[2])]
            heapq.heapify(self._by_work)

    def _in_queue(self, r: _Req) -> bool:
        """Waiting, not started, and still this request (not a finished one's old entry under its id)."""
        return r.phase in (Phase.WAITING, Phase.REMOTE) and not self._started(r) and self._reqs.get(r.rid) is r

    def _unplan(self, rid: str) -> None:
        if rid in self._plan_set:
            self._plan_set.discard(rid)
            self._plan_order.remove(rid)

    # --- the prefix cache ------------------------------------------------------------------------------

    def _lookup(self, r: _Req, computed: int) -> int:
        """`r`'s leading prompt blocks cached here that a computation of `computed` tokens may skip."""
        keys, cache = r.req.block_keys, self.cache
        if cache is None or not keys:
            return 0
        return cache.lookup(keys, min(len(keys), cacheable_blocks(computed, self.block_size)))

    def _need(self, r: _Req, context: int, computed: int) -> int:
        """The KV memory admitting `r` with `context` tokens takes now: less its hits already pinned here
        (shared at no cost; a free cached block takes its memory back)."""
        h = self._lookup(r, computed)
        if not h:
            return context
        assert self.cache is not None
        return context - self.cache.pinned_among(r.req.block_keys[:h]) * self.block_size

    def _charge(self, r: _Req, context: int, computed: int) -> int:
        """Charge `r`'s `context` tokens here; the cached blocks a computation of `computed` tokens may skip
        are referenced instead of computed (its hits). Returns the tokens hit."""
        b, cache = self.block_size, self.cache
        h = self._lookup(r, computed)
        revived = 0
        if h:
            assert cache is not None
            keys = r.req.block_keys[:h]
            revived = cache.acquire(keys)
            r.refs = list(keys)
        r.kv, r.hit, r.stored = context, h * b, h
        self._used += context - h * b + revived * b
        self._context += context
        if cache is not None:
            if not r.queried:  # a new request (vLLM counts a preempted one's lookups apart)
                r.queried = True
                cache.query_tokens += computed
                cache.hit_tokens += h * b
            self._evict()
        return h * b

    def _cache_blocks(self, r: _Req, upto: int) -> None:
        """`r`'s first `upto` tokens are computed (or loaded) here: its prompt's full blocks among them are
        cached, referenced by `r` (their memory moves from its own to the pinned blocks': used KV is the
        same); one cached already stays its own copy."""
        keys, cache = r.req.block_keys, self.cache
        if cache is None or not keys:
            return
        end = min(len(keys), upto // self.block_size)
        for j in range(r.stored, end):
            if cache.insert(keys[j]):
                r.refs.append(keys[j])
        r.stored = max(r.stored, end)

    def _uncharge(self, r: _Req) -> None:
        """`r` lets go of its KV here: its own, and its references to cached blocks (those no one else
        references stay cached, free)."""
        b = self.block_size
        self._used -= r.kv - len(r.refs) * b
        self._context -= r.kv
        if r.refs:
            assert self.cache is not None
            self._used -= self.cache.release(r.refs) * b
            r.refs = []
        r.kv = r.stored = 0

    def _evict(self) -> None:
        """Free cached blocks fit in the room the used KV leaves (the least recently freed go first)."""
        if self.cache is not None:
            self.cache.evict((self.capacity - self._used) // self.block_size)

    def transfer_tokens(self, request_id: str) -> int:
        """Decode: the prompt tokens a pulled request's hand-over brings (those not cached here)."""
        r = self._reqs[request_id]
        return r.req.prompt_len - r.hit

    def drain_cache_events(self) -> tuple[list[int], list[int]]:
        """The prefix cache's keys stored and removed since the last call (`PrefixCache.drain`)."""
        return self.cache.drain() if self.cache is not None else ([], [])

    # --- bookkeeping -----------------------------------------------------------------------------------

    def _set_growth(self, r: _Req) -> None:
        """This request's share of the predicted growth dispatch reads (none without a prediction)."""
        if self.role != "decode":
            return
        new = predicted_growth(r.req.predicted, r.req.max_tokens, r.n_out, self.policies.reserve_point)
        self._growth += new - r.growth
        r.growth = new

    def _forget(self, r: _Req) -> None:
        """The request leaves this instance (finished, released, dropped): free its KV and counts."""
        rid = r.req.request_id
        if r.phase is Phase.HELD:
            self._held -= 1
            self._held_tokens -= r.kv
        self._uncharge(r)
        if self.role == "decode":
            if r.heavy:
                self._heavy -= 1
            else:
                self._light -= 1
            self._growth -= r.growth
            r.growth = 0
        self._unplan(rid)
        del self._reqs[rid]

    def _prefill_time(self, pieces: Iterable[Piece]) -> float:
        return self.cost.prefill_batch_time((p.tokens, p.start) for p in pieces)
