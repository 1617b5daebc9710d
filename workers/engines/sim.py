"""SimEngine: an `Engine` that computes nothing and takes the time the roofline cost model says.

One asyncio task runs the batching loop. Each iteration is planned synchronously (admission,
preemption, chunking), its duration comes from `CostModel`, the loop sleeps that long on the injected
`Clock`, then delivers the iteration's results. Roles (docs/sim-engine.md has the details):

* ``prefill``: FCFS chunked prefill. A prompt is admitted when its KV fits in the free cache; an
  iteration takes up to ``max_batched_tokens`` prompt tokens (a long prompt spans iterations, short
  ones share one). The KV stays held after the prefill until ``release_kv`` or ``abort``.
* ``decode``: ``load_kv`` waits the emulated transfer time; ``decode`` queues the request for
  continuous batching with vLLM's greedy admission and recompute-style preemption of the most
  recently admitted request when the running batch outgrows the cache.
* ``colocated``: vLLM's default prefill-first schedule: a prefill iteration whenever a waiting prompt
  fits, otherwise one decode step over the running batch.

Tokens are a deterministic function of (prompt, output index), `sim_token`, so any instance produces
the same text for the same prompt.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from workers.clock import Clock
from workers.engines.base import Engine, EngineError, EngineRequest, EngineUsage, KVHandle, PrefillOutput
from workers.engines.costmodel import CostModel, Profile

ROLES = ("prefill", "decode", "colocated")
TOKENS_PER_S_WINDOW_S = 1.0  # model seconds over which usage().tokens_per_s counts tokens


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


class _State(enum.Enum):
    LOADING = "loading"  # decode role: KV transfer in progress
    LOADED = "loaded"  # decode role: KV here, decode() not called yet
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    HELD = "held"  # prefill role: prefill done, KV held until release_kv
    DONE = "done"


class _Seq:
    __slots__ = (
        "error",
        "filled",
        "future",
        "key",
        "kv",
        "max_tokens",
        "n_out",
        "prompt_len",
        "queue",
        "recompute",
        "req",
        "rid",
        "state",
        "target",
    )

    def __init__(self, req: EngineRequest, state: _State) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt_len = req.prompt_len
        self.max_tokens = req.max_tokens
        self.key = _prompt_key(req.prompt_token_ids)
        self.state = state
        self.n_out = 0  # output tokens emitted so far (token indices 0 … n_out − 1)
        self.kv = 0  # KV tokens this request holds or has reserved
        self.target = 0  # tokens its current prefill covers (prompt + n_out at admission)
        self.filled = 0  # tokens of `target` prefilled so far
        self.recompute = False  # decode role: preempted, its KV must be recomputed on re-admission
        self.queue: asyncio.Queue[int | EngineError | None] | None = None
        self.future: asyncio.Future[PrefillOutput] | None = None
        self.error: EngineError | None = None


@dataclass(frozen=True)
class IterationStats:
    """One engine iteration, passed to `SimEngine.on_iteration` when it is planned."""

    index: int  # 1-based, equals `SimEngine.iterations` for this iteration
    kind: str  # "prefill" or "decode"
    start: float  # model time the iteration starts
    duration: float  # model seconds
    kv_used_tokens: int  # KV in use (held or reserved) while it runs
    requests: tuple[tuple[str, int], ...]  # (request id, tokens): prefill chunk sizes; decode 1 each


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
        self.max_batched_tokens = max_batched_tokens if max_batched_tokens is not None else profile.max_batched_tokens
        self.max_num_seqs = profile.max_num_seqs
        self.kv_capacity = self.cost.kv_capacity_tokens()
        self._clock = clock

        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._prefilling: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # in admission order: the last is preempted first
        self._used = 0  # KV tokens held or reserved, Σ seq.kv
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_sum = 0

        # Public counters (monotonic over the engine's life).
        self.iterations = 0
        self.prefill_iterations = 0
        self.decode_iterations = 0
        self.preemptions = 0
        self.tokens_emitted = 0  # output tokens produced (prefill role: first tokens)
        self.prompt_tokens_processed = 0  # prefill chunk tokens, recomputation included
        self.recomputed_tokens = 0  # KV tokens recomputed after preemption
        self.busy_time = 0.0  # model seconds spent in iterations
        self.on_iteration: Callable[[IterationStats], None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"sim-engine-{self.instance_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # the loop's own failure was already reported to every request
                pass
        self._fail_all(EngineError(f"engine {self.instance_id} stopped"))

    # --- Engine API ----------------------------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillOutput:
        self._check_role("prefill", "prefill")
        self._validate(req, req.prompt_len)
        seq = self._admit_new(req, _State.WAITING)
        future: asyncio.Future[PrefillOutput] = asyncio.get_running_loop().create_future()
        seq.future = future
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._drop(seq, EngineError(f"request {seq.rid} cancelled"), quiet=True)
            raise

    async def load_kv(self, req: EngineRequest, kv: KVHandle) -> None:
        self._check_role("load_kv", "decode")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        if kv.num_tokens != req.prompt_len:
            raise EngineError(
                f"request {req.request_id}: KV handle has {kv.num_tokens} tokens, the prompt has {req.prompt_len}"
            )
        seq = self._admit_new(req, _State.LOADING)
        try:
            await self._clock.sleep(self.cost.transfer_time(kv.num_tokens))
        except asyncio.CancelledError:
            self._drop(seq, EngineError(f"request {seq.rid} cancelled"), quiet=True)
            raise
        if seq.state is _State.DONE:
            raise seq.error or EngineError(f"request {seq.rid} aborted")
        seq.state = _State.LOADED

    async def decode(self, req: EngineRequest, first_token: int) -> AsyncIterator[int]:
        self._check_role("decode", "decode")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.state is not _State.LOADED:
            raise EngineError(f"request {req.request_id}: no KV loaded on {self.instance_id} (call load_kv first)")
        if req.max_tokens == 1:
            self._release(seq)
            return
        if req.prompt_token_ids != seq.req.prompt_token_ids:
            raise EngineError(f"request {req.request_id}: prompt differs from the one whose KV was loaded")
        seq.req = req
        seq.max_tokens = req.max_tokens
        seq.n_out = 1  # token 0 came from the prefill instance
        seq.queue = asyncio.Queue()
        seq.state = _State.WAITING
        self._waiting.append(seq)
        self._wake.set()
        try:
            while (token := await self._next_token(seq)) is not None:
                yield token
        finally:
            self._abandon(seq)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self._check_role("generate", "colocated")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        seq = self._admit_new(req, _State.WAITING)
        seq.queue = asyncio.Queue()
        self._waiting.append(seq)
        self._wake.set()
        try:
            while (token := await self._next_token(seq)) is not None:
                yield token
        finally:
            self._abandon(seq)

    async def release_kv(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and seq.state is _State.HELD:
            self._release(seq)

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._drop(seq, EngineError(f"request {request_id} aborted"), quiet=True)

    def usage(self) -> EngineUsage:
        return EngineUsage(
            kv_capacity_tokens=self.kv_capacity,
            kv_used_tokens=self._used,
            running=len(self._running) + len(self._prefilling),
            waiting=len(self._waiting),
            tokens_per_s=self._tokens_per_s(),
            preemptions=self.preemptions,
        )

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

    def _admit_new(self, req: EngineRequest, state: _State) -> _Seq:
        if req.request_id in self._seqs:
            raise EngineError(f"request {req.request_id} is already active on {self.instance_id}")
        seq = _Seq(req, state)
        self._seqs[seq.rid] = seq
        return seq

    async def _next_token(self, seq: _Seq) -> int | None:
        """The request's next token; None when its stream has ended; raises the error that ended it."""
        assert seq.queue is not None
        item = await seq.queue.get()
        if isinstance(item, EngineError):
            raise item
        return item

    def _abandon(self, seq: _Seq) -> None:
        """A token stream's consumer went away (closed or cancelled) before the end: abort the request."""
        if seq.state is not _State.DONE:
            self._drop(seq, EngineError(f"request {seq.rid} cancelled"), quiet=True)

    def _release(self, seq: _Seq) -> None:
        """Normal end: free the KV, forget the request, end its token stream. Containers are the caller's."""
        self._used -= seq.kv
        seq.kv = 0
        seq.state = _State.DONE
        if self._seqs.get(seq.rid) is seq:
            del self._seqs[seq.rid]
        if seq.queue is not None:
            seq.queue.put_nowait(None)
        self._wake.set()

    def _drop(self, seq: _Seq, error: EngineError, *, quiet: bool) -> None:
        """Remove a request wherever it is. quiet: its token stream just ends (abort), else raises `error`."""
        state = seq.state
        if state is _State.DONE:
            return
        if state is _State.WAITING:
            self._waiting.remove(seq)
        elif state is _State.PREFILLING:
            self._prefilling.remove(seq)
        elif state is _State.RUNNING:
            self._running.remove(seq)
        self._used -= seq.kv
        seq.kv = 0
        seq.state = _State.DONE
        seq.error = error
        if self._seqs.get(seq.rid) is seq:
            del self._seqs[seq.rid]
        if seq.queue is not None:
            seq.queue.put_nowait(None if quiet else error)
        if seq.future is not None and not seq.future.done():
            seq.future.set_exception(error)
        self._wake.set()

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
        try:
            while True:
                plan = self._plan()
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                kind, batch, duration = plan
                self.iterations += 1
                if kind == "prefill":
                    self.prefill_iterations += 1
                else:
                    self.decode_iterations += 1
                if self.on_iteration is not None:
                    self.on_iteration(
                        IterationStats(
                            index=self.iterations,
                            kind=kind,
                            start=self._clock.now(),
                            duration=duration,
                            kv_used_tokens=self._used,
                            requests=tuple((seq.rid, n) for seq, n, _ in batch),
                        )
                    )
                await self._clock.sleep(duration)
                self.busy_time += duration
                if kind == "prefill":
                    self._finish_prefill(batch)
                else:
                    self._finish_decode(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail_all(EngineError(f"engine {self.instance_id} failed: {exc!r}"))
            raise

    def _plan(self) -> tuple[str, list[tuple[_Seq, int, int]], float] | None:
        if self.role == "prefill":
            return self._plan_prefill()
        if self.role == "decode":
            return self._plan_decode(admit=True)
        return self._plan_prefill() or self._plan_decode(admit=False)

    def _plan_prefill(self) -> tuple[str, list[tuple[_Seq, int, int]], float] | None:
        """Chunks (seq, tokens, context) for one prefill iteration: in-progress prompts first, then FCFS
        admission of waiting prompts whose whole KV fits, within the token budget."""
        budget = self.max_batched_tokens
        batch: list[tuple[_Seq, int, int]] = []
        for seq in self._prefilling:
            if budget == 0:
                break
            n = min(budget, seq.target - seq.filled)
            batch.append((seq, n, seq.filled))
            budget -= n
        while budget > 0 and self._waiting:
            seq = self._waiting[0]
            need = seq.prompt_len + seq.n_out  # the prompt, plus output so far when recomputing
            if self._used + need > self.kv_capacity:
                break
            if len(self._running) + len(self._prefilling) >= self.max_num_seqs:
                break
            self._waiting.popleft()
            seq.state = _State.PREFILLING
            seq.target = need
            seq.filled = 0
            seq.kv = need
            self._used += need
            if seq.n_out > 0:
                self.recomputed_tokens += need
            self._prefilling.append(seq)
            n = min(budget, need)
            batch.append((seq, n, 0))
            budget -= n
        if not batch:
            return None
        duration = self.cost.prefill_batch_time((n, context) for _, n, context in batch)
        return "prefill", batch, duration

    def _plan_decode(self, *, admit: bool) -> tuple[str, list[tuple[_Seq, int, int]], float] | None:
        """One decode step over the running batch. Each running request feeds its last token, which
        needs one more KV slot: preempt the most recently admitted while the step would overflow the
        cache, then (decode role) admit waiting requests FCFS while their KV and the step's fit."""
        running = self._running
        while running and self._used + len(running) > self.kv_capacity:
            self._preempt(running.pop())
        extra = 0.0
        if admit:
            while self._waiting and len(running) < self.max_num_seqs:
                seq = self._waiting[0]
                cached = seq.prompt_len + seq.n_out - 1  # prompt + output tokens fed so far
                if self._used + len(running) + cached + 1 > self.kv_capacity:
                    break
                self._waiting.popleft()
                seq.state = _State.RUNNING
                seq.kv = cached
                self._used += cached
                running.append(seq)
                if seq.recompute:  # recompute-style preemption: rebuild its KV within this iteration
                    seq.recompute = False
                    self.recomputed_tokens += cached
                    self.prompt_tokens_processed += cached
                    extra += self.cost.prefill_flops(cached) / self.cost.effective_flops
        if not running:
            return None
        batch: list[tuple[_Seq, int, int]] = []
        for seq in running:
            seq.kv += 1  # the slot of the token this step feeds
            batch.append((seq, 1, 0))
        self._used += len(running)
        duration = self.cost.decode_step_time(len(batch), self._used) + extra
        return "decode", batch, duration

    def _preempt(self, seq: _Seq) -> None:
        self._used -= seq.kv
        seq.kv = 0
        seq.state = _State.WAITING
        seq.recompute = True
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def _emit(self, seq: _Seq) -> int:
        token = _token(seq.key, seq.n_out, self.vocab_size)
        seq.n_out += 1
        return token

    def _finish_prefill(self, batch: list[tuple[_Seq, int, int]]) -> None:
        emitted = 0
        for seq, n, _ in batch:
            if seq.state is not _State.PREFILLING:  # aborted during the iteration
                continue
            seq.filled += n
            self.prompt_tokens_processed += n
            if seq.filled < seq.target:
                continue
            if self._prefilling[0] is seq:
                self._prefilling.popleft()
            else:
                self._prefilling.remove(seq)
            token = self._emit(seq)
            emitted += 1
            if self.role == "prefill":
                seq.state = _State.HELD
                future = seq.future
                if future is not None and not future.done():
                    kv = KVHandle(
                        request_id=seq.rid,
                        num_tokens=seq.prompt_len,
                        num_bytes=self.cost.kv_bytes(seq.prompt_len),
                        source_instance_id=self.instance_id,
                        params={},
                    )
                    future.set_result(PrefillOutput(first_token=token, kv=kv))
                continue
            assert seq.queue is not None
            seq.queue.put_nowait(token)
            if seq.n_out >= seq.max_tokens:
                self._release(seq)
            else:
                seq.state = _State.RUNNING
                self._running.append(seq)
        self._emitted(emitted)

    def _finish_decode(self, batch: list[tuple[_Seq, int, int]]) -> None:
        emitted = 0
        finished = False
        for seq, _, _ in batch:
            if seq.state is not _State.RUNNING:  # aborted during the iteration
                continue
            token = self._emit(seq)
            emitted += 1
            assert seq.queue is not None
            seq.queue.put_nowait(token)
            if seq.n_out >= seq.max_tokens:
                self._release(seq)
                finished = True
        if finished:
            self._running = [seq for seq in self._running if seq.state is _State.RUNNING]
        self._emitted(emitted)
