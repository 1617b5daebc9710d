"""SimEngine: an `Engine` that computes nothing and takes the time the roofline cost model says.

A shell around `tetri.scheduling.instance.InstanceScheduler`, which owns every rule of an iteration
(queues, KV accounting, chunking, admission, preemption): one asyncio task loops schedule → sleep the
plan's duration on the injected `Clock` → complete → deliver tokens. The discrete-event simulator is the
same scheduler inside an event heap, so the two produce the same iterations for the same inputs
(tests/des/test_parity.py). Roles (docs/sim-engine.md has the details):

* ``prefill``: KV admission, then TetriInfer's chunked prefill (or, ``chunked=False``, whole prompts up
  to ``max_batched_tokens``). A prompt's KV stays held until ``release_kv`` (the decode instance pulled
  it) or ``abort``.
* ``decode``: ``load_kv`` queues the request with its KV still remote and returns when admission pulls
  it (from then on the KV is charged here and the prefill side may free it); the engine then waits the
  emulated transfer time before the request joins the running batch. ``decode`` streams its tokens.
* ``colocated``: vLLM's default prefill-first schedule over whole prompts.

Every role has a prefix cache (the scheduler's, `tetri.scheduling.prefixcache`): a prompt's full blocks
are keyed by their tokens (`tetri.scheduling.prefix.block_keys`), and the blocks a later prompt shares
are neither computed nor, on a decode instance that holds them, transferred. Its events go to the
control plane's index (`cache_delta`).

Before planning, the loop yields once to the clock (`sleep(0)`) so every event of the same instant
(arrivals, transfers, releases) is in before the iteration is planned — as in the simulator.

Tokens are a deterministic function of (prompt, output index), `sim_token`, so any instance produces
the same text for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tetri.clock import Clock
from tetri.costmodel import CostModel, Profile
from tetri.loopqueue import LoopQueue
from tetri.scheduling.instance import ROLES, InstanceScheduler, IterationPlan, Outcome, SchedRequest
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefix import block_keys
from workers.engines.base import (
    Engine,
    EngineError,
    EngineRequest,
    EngineUsage,
    KVHandle,
    PrefillOutput,
    Rejected,
)

TOKENS_PER_S_WINDOW_S = 1.0  # model seconds over which usage().tokens_per_s counts tokens
CACHED_KEPT = 65_536  # requests whose cached prompt tokens are kept until asked (`cached_tokens`)


def _prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"tetri-sim-token")
    h.update(",".join(map(str, prompt_token_ids)).encode())
    return h.digest()


def _token(key: bytes, index: int, vocab_size: int) -> int:
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") % vocab_size


def sim_token(prompt_token_ids: Sequence[int], index: int, vocab_size: int) -> int:
    """The sim engine's output token at `index` for this prompt (stable across processes and hosts)."""
    return _token(_prompt_key(prompt_token_ids), index, vocab_size)


class _Seq:
    """The engine's side of a request: how its caller is told (the scheduler holds its state)."""

    __slots__ = ("future", "key", "pulled", "queue", "req")

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        # a migrated request keys its tokens on the original prompt and continues its output indices
        self.key = _prompt_key(req.prompt_token_ids[: req.prompt_len - req.resumed_tokens])
        self.queue: LoopQueue[int | EngineError | None] | None = None  # decode/colocated: tokens
        self.future: asyncio.Future[PrefillOutput] | None = None  # prefill: first token + KV handle
        self.pulled: asyncio.Future[None] | None = None  # decode: admission pulled the KV


@dataclass(frozen=True)
class IterationStats:
    """One engine iteration, passed to `SimEngine.on_iteration` when it is planned."""

    index: int  # 1-based, equals `SimEngine.iterations` for this iteration
    kind: str  # "prefill", "decode" or "mixed" (vllm-v1: prefill chunks in the decode batch)
    start: float  # model time the iteration starts
    duration: float  # model seconds
    kv_used_tokens: int  # KV in use (held or reserved) while it runs
    requests: tuple[tuple[str, int], ...]  # (request id, tokens): prefill chunk sizes; decode 1 each
    padding: int = 0  # prefill role, chunked: padding tokens that filled the chunk up to ChunkSize
    plan: IterationPlan | None = None  # the scheduler's whole plan


class SimEngine(Engine):
    def __init__(
        self,
        profile: Profile,
        role: str,
        instance_id: str,
        clock: Clock,
        *,
        vocab_size: int | None = None,
        max_batched_tokens: int | None = None,
        policies: PolicySet | None = None,
        chunked: bool = True,
        prefix_caching: bool = True,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role '{role}'; known roles: {', '.join(ROLES)}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be positive, got {max_batched_tokens}")
        self.profile = profile
        self.cost = CostModel(profile)
        self.role = role
        self.instance_id = instance_id
        self.model_name = profile.model.name
        self.max_model_len = profile.model.max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else profile.model.vocab_size
        # The whole-prompt budget of a prefill iteration (chunked off, colocated); by default the
        # scheduler's (the simulator's too): max(max_model_len, the profile's max_batched_tokens).
        self.max_batched_tokens = max_batched_tokens if max_batched_tokens is not None else profile.max_batched_tokens
        # Policies: the default set uses the profile's token budget as ChunkSize.
        policies = policies if policies is not None else PolicySet(chunk_size=self.max_batched_tokens)
        self.sched = InstanceScheduler(
            role, self.cost, policies, chunked=chunked, prefill_budget=max_batched_tokens, prefix_caching=prefix_caching
        )
        self.block_size = profile.block_size
        self.kv_capacity = self.sched.capacity
        self.max_num_seqs = self.sched.max_num_seqs
        self._clock = clock
        self._seqs: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._transfers: set[asyncio.Task[None]] = set()
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_sum = 0
        self._cached: dict[str, int] = {}  # request id -> prompt tokens its prefill found cached (asked once)

        # Public counters (monotonic over the engine's life); the scheduler counts the rest.
        self.iterations = 0
        self.prefill_iterations = 0
        self.decode_iterations = 0
        self.mixed_iterations = 0  # vllm-v1: prefill chunks batched with decodes
        self.tokens_emitted = 0  # output tokens produced (prefill role: first tokens)
        self.busy_time = 0.0  # model seconds spent in iterations
        self.on_iteration: Callable[[IterationStats], None] | None = None
        self.on_plan: Callable[[float, IterationPlan], None] | None = None  # every plan, with its model time

    # --- what the scheduler counts ---------------------------------------------------------------

    @property
    def policies(self) -> PolicySet:
        return self.sched.policies

    @property
    def chunked(self) -> bool:
        return self.sched.chunked

    @property
    def preemptions(self) -> int:
        return self.sched.preemptions

    @property
    def prompt_tokens_processed(self) -> int:
        return self.sched.prompt_tokens_processed

    @property
    def recomputed_tokens(self) -> int:
        return self.sched.recomputed_tokens

    @property
    def wasted_prefill_tokens(self) -> int:
        return self.sched.padding_tokens

    @property
    def admitted_by_policy(self) -> int:
        return self.sched.admitted_by_policy

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"sim-engine-{self.instance_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        for t in list(self._transfers):
            t.cancel()
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # the loop's own failure was already reported to every request
                pass
        self._fail_all(EngineError(f"engine {self.instance_id} stopped"))

    # --- policies ------------------------------------------------------------------------------

    def configure(self, policies: PolicySet | None = None, *, chunked: bool | None = None) -> None:
        """Hot-swap the policies (and, optionally, chunked prefill on/off) from the next iteration."""
        self.sched.configure(policies, chunked=chunked)
        self._wake.set()

    def set_plan(self, order: Sequence[str]) -> None:
        """The planned admission order for the ``plan`` policy (`InstanceScheduler.set_plan`)."""
        self.sched.set_plan(order)
        self._wake.set()

    def policy_stats(self) -> dict[str, int]:
        return {
            "preemptions": self.preemptions,
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            "prefill_iterations": self.prefill_iterations,
            "decode_iterations": self.decode_iterations,
            "mixed_iterations": self.mixed_iterations,
            "admitted_by_policy": self.admitted_by_policy,
        }

    # --- Engine API ----------------------------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillOutput:
        self._check_role("prefill", "prefill")
        self._validate(req, req.prompt_len)
        seq = self._add(req)
        future: asyncio.Future[PrefillOutput] = asyncio.get_running_loop().create_future()
        seq.future = future
        try:
            return await future
        except asyncio.CancelledError:
            self._drop(seq, EngineError(f"request {seq.req.request_id} cancelled"), quiet=True)
            raise

    async def load_kv(self, req: EngineRequest, kv: KVHandle) -> None:
        self._check_role("load_kv", "decode")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        if kv.num_tokens != req.prompt_len:
            raise EngineError(
                f"request {req.request_id}: KV handle has {kv.num_tokens} tokens, the prompt has {req.prompt_len}"
            )
        if req.max_tokens <= 1:
            return  # nothing to decode: nothing to take over
        seq = self._add(req, produced=1)
        seq.queue = LoopQueue()
        seq.pulled = asyncio.get_running_loop().create_future()
        try:
            await seq.pulled
        except asyncio.CancelledError:
            self._drop(seq, EngineError(f"request {req.request_id} cancelled"), quiet=True)
            raise

    async def decode(self, req: EngineRequest, first_token: int) -> AsyncIterator[int]:
        self._check_role("decode", "decode")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        if req.max_tokens == 1:
            return
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.pulled is None or not seq.pulled.done():
            raise EngineError(f"request {req.request_id}: no KV loaded on {self.instance_id} (call load_kv first)")
        if req.prompt_token_ids != seq.req.prompt_token_ids:
            raise EngineError(f"request {req.request_id}: prompt differs from the one whose KV was loaded")
        async with contextlib.aclosing(self._stream(seq)) as tokens:  # closing us closes it at once
            async for token in tokens:
                yield token

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self._check_role("generate", "colocated")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        seq = self._add(req)
        seq.queue = LoopQueue()
        async with contextlib.aclosing(self._stream(seq)) as tokens:  # closing us closes it at once
            async for token in tokens:
                yield token

    async def _stream(self, seq: _Seq) -> AsyncGenerator[int, None]:
        """Yield a queued sequence's tokens as the loop produces them; closing early abandons it."""
        try:
            while (token := await self._next_token(seq)) is not None:
                yield token
        finally:
            if seq.req.request_id in self.sched and self._seqs.get(seq.req.request_id) is seq:
                self._drop(seq, EngineError(f"request {seq.req.request_id} cancelled"), quiet=True)

    async def release_kv(self, request_id: str) -> None:
        if self.sched.release(request_id):
            self._seqs.pop(request_id, None)
            self._wake.set()

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._drop(seq, EngineError(f"request {request_id} aborted"), quiet=True)

    def usage(self) -> EngineUsage:
        u = self.sched.usage()
        return EngineUsage(
            kv_capacity_tokens=u.kv_capacity_tokens,
            kv_used_tokens=u.kv_used_tokens,
            running=u.running,
            waiting=u.waiting,
            tokens_per_s=self._tokens_per_s(),
            preemptions=u.preemptions,
            held_tokens=u.held_tokens,
            heavy=u.heavy,
            light=u.light,
            predicted_growth_tokens=u.predicted_growth_tokens,
            prefix_query_tokens=u.prefix_query_tokens,
            prefix_hit_tokens=u.prefix_hit_tokens,
        )

    def cache_keys(self) -> list[int]:
        return self.sched.cache.keys() if self.sched.cache is not None else []

    def cache_delta(self) -> tuple[list[int], list[int]]:
        return self.sched.drain_cache_events()

    def cached_tokens(self, request_id: str) -> int | None:
        return self._cached.pop(request_id, None)

    # --- request bookkeeping -------------------------------------------------------------------

    def _check_role(self, method: str, role: str) -> None:
        if self.role != role:
            raise EngineError(f"{method}() needs a {role} instance; {self.instance_id} is {self.role}")

    def _validate(self, req: EngineRequest, kv_needed: int) -> None:
        rid = req.request_id
        if req.prompt_len == 0:
            raise EngineError(f"request {rid}: empty prompt")
        if req.max_tokens < 1:
            raise EngineError(f"request {rid}: max_tokens must be at least 1, got {req.max_tokens}")
        if req.prompt_len + req.max_tokens > self.max_model_len:
            raise EngineError(
                f"request {rid}: prompt {req.prompt_len} + max_tokens {req.max_tokens} tokens exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if kv_needed > self.kv_capacity:
            raise EngineError(
                f"request {rid}: needs {kv_needed} KV tokens, more than the {self.kv_capacity} {self.instance_id} holds"
            )
        if self._task is None or self._task.done():
            raise EngineError(f"engine {self.instance_id} is not running")

    def _add(self, req: EngineRequest, produced: int = 0) -> _Seq:
        if req.request_id in self._seqs:
            raise EngineError(f"request {req.request_id} is already active on {self.instance_id}")
        seq = _Seq(req)
        keys = block_keys(req.prompt_token_ids, self.block_size) if self.sched.cache is not None else ()
        self.sched.add(
            SchedRequest(
                req.request_id,
                req.prompt_len,
                req.max_tokens,
                req.predicted_output,
                arrival=self._clock.now(),
                resumed=req.resumed_tokens > 0,
                block_keys=tuple(keys),
            ),
            produced=produced,
        )
        self._seqs[req.request_id] = seq
        self._wake.set()
        return seq

    async def _next_token(self, seq: _Seq) -> int | None:
        """The request's next token; None when its stream has ended; raises the error that ended it."""
        assert seq.queue is not None
        item = await seq.queue.get()
        if isinstance(item, EngineError):
            raise item
        return item

    def _drop(self, seq: _Seq, error: EngineError, *, quiet: bool) -> None:
        """Remove a request wherever it is. quiet: its token stream just ends (abort), else raises `error`."""
        rid = seq.req.request_id
        self.sched.abort(rid)
        self._cached.pop(rid, None)
        if self._seqs.get(rid) is seq:
            del self._seqs[rid]
        if seq.queue is not None:
            seq.queue.put_nowait(None if quiet else error)
        for fut in (seq.future, seq.pulled):
            if fut is not None and not fut.done():
                fut.set_exception(error)
                fut.exception()  # a caller that went away must not leave "exception never retrieved"
        self._wake.set()

    def _rejected(self, rid: str) -> None:
        """The scheduler dropped a request that waited past its TTFT target: its stream ends with why."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        target = self.sched.policies.ttft_target_s
        error = Rejected(f"request {rid} waited past its {target:g} s TTFT target: rejected")
        if seq.queue is not None:
            seq.queue.put_nowait(error)
        if seq.future is not None and not seq.future.done():  # a prefill instance's prompt
            seq.future.set_exception(error)

    def _fail_all(self, error: EngineError) -> None:
        for seq in list(self._seqs.values()):
            self._drop(seq, error, quiet=False)

    def _emitted(self, count: int) -> None:
        if count == 0:
            return
        now = self._clock.now()
        self.tokens_emitted += count
        self._recent.append((now, count))
        self._recent_sum += count
        self._prune_recent(now)

    def _prune_recent(self, now: float) -> None:
        horizon = now - TOKENS_PER_S_WINDOW_S
        while self._recent and self._recent[0][0] <= horizon:
            self._recent_sum -= self._recent.popleft()[1]

    def _tokens_per_s(self) -> float:
        self._prune_recent(self._clock.now())
        return self._recent_sum / TOKENS_PER_S_WINDOW_S

    # --- the batching loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        # Model time at which the last iteration ended, while the engine has been busy since: back-to-back
        # iterations chain on it (not on the wall-late `now()`), so host jitter does not add up in model
        # time; None once the engine has waited idle.
        ended: float | None = None
        try:
            while True:
                await self._clock.sleep(0)  # let every event of this instant in before planning
                start = self._clock.now() if ended is None else ended
                plan = self.sched.schedule(start)
                if plan is not None:
                    if self.on_plan is not None:
                        self.on_plan(start, plan)
                    for rid in plan.pulled:
                        self._pulled(rid, start)
                    for rid in plan.rejected:
                        self._rejected(rid)
                if plan is None or not plan.pieces:
                    ended = None
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self.iterations += 1
                if plan.kind == "prefill":
                    self.prefill_iterations += 1
                elif plan.kind == "decode":
                    self.decode_iterations += 1
                else:
                    self.mixed_iterations += 1
                if self.on_iteration is not None:
                    self.on_iteration(
                        IterationStats(
                            index=self.iterations,
                            kind=plan.kind,
                            start=start,
                            duration=plan.duration,
                            kv_used_tokens=plan.kv_used,
                            requests=tuple((p.request_id, p.tokens) for p in plan.pieces),
                            padding=plan.padding,
                            plan=plan,
                        )
                    )
                ended = start + plan.duration
                await self._clock.sleep_until(ended)
                self.busy_time += plan.duration
                self._deliver(self.sched.complete(plan))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail_all(EngineError(f"engine {self.instance_id} failed: {exc!r}"))
            raise

    def _pulled(self, rid: str, at: float) -> None:
        """Admission pulled a remote request's KV at model time `at`: its caller may let the prefill side
        free it; the emulated transfer runs, then the request joins the running batch."""
        seq = self._seqs[rid]
        if seq.pulled is not None and not seq.pulled.done():
            seq.pulled.set_result(None)
        # what this instance's prefix cache holds of the prompt is not transferred
        task = asyncio.get_running_loop().create_task(
            self._transfer(rid, at + self.cost.transfer_time(self.sched.transfer_tokens(rid)))
        )
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _transfer(self, rid: str, done: float) -> None:
        await self._clock.sleep_until(done)
        if self.sched.loaded(rid):
            self._wake.set()

    def _deliver(self, outcome: Outcome) -> None:
        finished = set(outcome.finished)
        prefilled = set(outcome.prefilled)
        for rid, hit in outcome.cached:
            if rid in self._seqs:
                self._cached[rid] = hit
                if len(self._cached) > CACHED_KEPT:  # asked by no one (the engine driven without a worker)
                    del self._cached[next(iter(self._cached))]
        for rid, index in outcome.tokens:
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            token = _token(seq.key, index + seq.req.resumed_tokens, self.vocab_size)
            if rid in prefilled:
                if seq.future is not None and not seq.future.done():
                    n = seq.req.prompt_len
                    kv = KVHandle(rid, n, self.cost.kv_bytes(n), self.instance_id, {})
                    seq.future.set_result(PrefillOutput(first_token=token, kv=kv))
                continue
            assert seq.queue is not None
            seq.queue.put_nowait(token)
            if rid in finished:
                seq.queue.put_nowait(None)
                del self._seqs[rid]
        self._emitted(len(outcome.tokens))
        if finished or prefilled:
            self._wake.set()
