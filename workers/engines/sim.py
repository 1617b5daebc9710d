"""SimEngine: an `Engine` that computes nothing and takes the time the roofline cost model says.

One asyncio task runs the batching loop. Each iteration is planned synchronously (admission,
preemption, chunking), its duration comes from `CostModel`, the loop sleeps that long on the injected
`Clock`, then delivers the iteration's results. The scheduling decisions are the pure policy objects
of `tetri.scheduling` (the same ones the discrete-event simulator uses), configured by a `PolicySet`
that `configure` swaps at runtime. Roles (docs/sim-engine.md has the details):

* ``prefill``: TetriInfer's chunked prefill (`ChunkedPrefill`): fixed ChunkSize chunks, the last partial
  one padded, in fcfs / sjf / ljf order within PrefillSchedBatch groups. A prompt enters the chunker
  when its KV fits in the free cache. ``chunked=False`` is vLLM's fixed-batch prefill: whole prompts up
  to ``max_batched_tokens`` per iteration. The KV stays held until ``release_kv`` or ``abort``.
* ``decode``: ``load_kv`` waits the emulated transfer time; ``decode`` queues the request for
  continuous batching; each iteration `admit` (greedy / reserve-static / reserve-dynamic / plan) picks
  the newcomers, and a recompute-style preemption of the most recently admitted request is the safety
  net when the running batch outgrows the cache.
* ``colocated``: vLLM's default prefill-first schedule: a prefill iteration whenever `admit` lets a
  waiting prompt in (or one is part-way through), otherwise one decode step over the running batch.

Tokens are a deterministic function of (prompt, output index), `sim_token`, so any instance produces
the same text for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import itertools
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tetri.costmodel import CostModel, Profile
from tetri.scheduling.admission import Running, Waiting, admit
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefill import ChunkedPrefill, FixedBatchPrefill, PrefillItem
from workers.clock import Clock
from workers.engines.base import Engine, EngineError, EngineRequest, EngineUsage, KVHandle, PrefillOutput

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
        "arrival",
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
        self.recompute = False  # preempted and not yet re-admitted (decode role: its KV must be rebuilt)
        self.arrival = 0  # prefill role: arrival order, the tie-break of the prefill scheduling order
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
    padding: int = 0  # prefill role, chunked: padding tokens that filled the chunk up to ChunkSize


# One planned iteration: kind, (seq, tokens, context) entries, model seconds, padding tokens.
_Plan = tuple[str, list[tuple[_Seq, int, int]], float, int]


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

        # Policies: the default set uses the iteration token budget as ChunkSize.
        self.policies = policies if policies is not None else PolicySet(chunk_size=self.max_batched_tokens)
        self.chunked = bool(chunked)  # prefill role: TetriInfer's chunked prefill (False: whole prompts)
        p = self.policies
        self._chunker = ChunkedPrefill(
            chunk_size=p.chunk_size, policy=p.prefill_policy, sched_batch=p.prefill_sched_batch, pad=True
        )
        self._whole = FixedBatchPrefill(p.prefill_policy, p.prefill_sched_batch)
        self._chunked_applied = self.chunked  # the mode the queues are arranged for
        self._arrivals = 0
        self._plan_order: list[str] = []  # planned admission order (plan policy): ids not yet admitted
        self._plan_set: set[str] = set()

        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()  # prefill role: waiting for KV; others: for admission
        self._prefilling: dict[str, _Seq] = {}  # KV reserved, prefill in progress (insertion order)
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
        self.prompt_tokens_processed = 0  # prefill chunk tokens, recomputation included, padding not
        self.recomputed_tokens = 0  # KV tokens recomputed after preemption
        self.wasted_prefill_tokens = 0  # padding of partial chunks (prefill role, chunked)
        self.admitted_by_policy = 0  # admissions made by the decode-admission policy (re-admissions count)
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

    # --- policies ------------------------------------------------------------------------------

    def configure(self, policies: PolicySet | None = None, *, chunked: bool | None = None) -> None:
        """Hot-swap the policies (and, optionally, chunked prefill on/off). Takes effect from the next
        iteration; the iteration in flight, prompts part-way through their prefill and the running batch
        are not disturbed (prompts already ordered keep their order)."""
        if policies is not None:
            self._chunker.configure(policies.chunk_size, policies.prefill_policy, policies.prefill_sched_batch)
            self._whole.configure(policies.prefill_policy, policies.prefill_sched_batch)
            self.policies = policies
        if chunked is not None:
            self.chunked = bool(chunked)
        self._wake.set()

    def set_plan(self, order: Sequence[str]) -> None:
        """The planned admission order for the ``plan`` policy: request ids not yet admitted (ids already
        admitted are ignored; admitted, finished and aborted ids leave the plan). The plan waits for a
        planned id that has not arrived; waiting requests the plan does not name come after it."""
        admitted = (_State.PREFILLING, _State.RUNNING, _State.HELD)
        kept: list[str] = []
        for rid in dict.fromkeys(order):
            seq = self._seqs.get(rid)
            if seq is None or seq.state not in admitted:
                kept.append(rid)
        self._plan_order = kept
        self._plan_set = set(kept)
        self._wake.set()

    def policy_stats(self) -> dict[str, int]:
        return {
            "preemptions": self.preemptions,
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            "prefill_iterations": self.prefill_iterations,
            "decode_iterations": self.decode_iterations,
            "admitted_by_policy": self.admitted_by_policy,
        }

    # --- Engine API ----------------------------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillOutput:
        self._check_role("prefill", "prefill")
        self._validate(req, req.prompt_len)
        seq = self._admit_new(req, _State.WAITING)
        future: asyncio.Future[PrefillOutput] = asyncio.get_running_loop().create_future()
        seq.future = future
        self._arrivals += 1
        seq.arrival = self._arrivals
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
        async with contextlib.aclosing(self._stream(seq)) as tokens:  # closing us closes it at once
            async for token in tokens:
                yield token

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self._check_role("generate", "colocated")
        self._validate(req, req.prompt_len + req.max_tokens - 1)
        seq = self._admit_new(req, _State.WAITING)
        seq.queue = asyncio.Queue()
        self._waiting.append(seq)
        self._wake.set()
        async with contextlib.aclosing(self._stream(seq)) as tokens:  # closing us closes it at once
            async for token in tokens:
                yield token

    async def _stream(self, seq: _Seq) -> AsyncGenerator[int, None]:
        """Yield a queued sequence's tokens as the loop produces them; closing early abandons it."""
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
        self._unplan(seq.rid)
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
            del self._prefilling[seq.rid]
            if self.role == "prefill" and not self._chunker.remove(seq.rid):
                self._whole.remove(seq.rid)
        elif state is _State.RUNNING:
            self._running.remove(seq)
        self._used -= seq.kv
        seq.kv = 0
        seq.state = _State.DONE
        seq.error = error
        self._unplan(seq.rid)
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
                kind, batch, duration, padding = plan
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
                            padding=padding,
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

    def _plan(self) -> _Plan | None:
        if self.role == "prefill":
            return self._plan_prefill_role()
        if self.role == "decode":
            return self._plan_decode(admit=True)
        return self._plan_colocated_prefill() or self._plan_decode(admit=False)

    # --- prefill role ----------------------------------------------------------------------------

    def _sync_prefill_mode(self) -> None:
        """Apply a chunked on/off switch: move the prompts not started yet to the other queue. Prompts
        part-way through a chunked prefill stay in the chunker and finish there."""
        if self.chunked == self._chunked_applied:
            return
        self._chunked_applied = self.chunked
        if self.chunked:
            for item in self._whole.drain():
                self._chunker.add(item)
            return
        for seq in self._prefilling.values():
            if seq.filled == 0 and self._chunker.remove(seq.rid):
                self._whole.add(PrefillItem(seq.rid, seq.prompt_len, seq.arrival))

    def _plan_prefill_role(self) -> _Plan | None:
        """KV admission (FIFO: a prompt enters the scheduler when its whole KV fits in the free cache; the
        head blocks those behind it), then the scheduler's next iteration: a ChunkSize chunk (padded) from
        `ChunkedPrefill`, or, chunked off, whole prompts up to ``max_batched_tokens``."""
        self._sync_prefill_mode()
        while self._waiting and len(self._prefilling) < self.max_num_seqs:
            seq = self._waiting[0]
            if self._used + seq.prompt_len > self.kv_capacity:
                break
            self._waiting.popleft()
            seq.state = _State.PREFILLING
            seq.target = seq.prompt_len
            seq.filled = 0
            seq.kv = seq.prompt_len
            self._used += seq.prompt_len
            self._prefilling[seq.rid] = seq
            (self._chunker if self.chunked else self._whole).add(PrefillItem(seq.rid, seq.prompt_len, seq.arrival))
        if len(self._chunker):  # chunked; or chunked off with prompts it had started
            step = self._chunker.next_chunk()
            assert step is not None
            chunk, _ = step
            batch = [(self._prefilling[rid], n, first) for rid, first, n in chunk.pieces]
            # Padding costs compute: it extends the last piece up to ChunkSize.
            costs = [(n, first) for _, first, n in chunk.pieces]
            costs[-1] = (costs[-1][0] + chunk.padding, costs[-1][1])
            self.wasted_prefill_tokens += chunk.padding
            return "prefill", batch, self.cost.prefill_batch_time(costs), chunk.padding
        if len(self._whole):
            items = self._whole.next_batch(self.max_batched_tokens)
            batch = [(self._prefilling[x.request_id], x.prompt_len, 0) for x in items]
            return "prefill", batch, self.cost.prefill_batch_time((n, 0) for _, n, _ in batch), 0
        return None

    # --- colocated role: prefill-first ---------------------------------------------------------------

    def _plan_colocated_prefill(self) -> _Plan | None:
        """Chunks (seq, tokens, context) for one prefill iteration: in-progress prompts first, then the
        waiting prompts the admission policy lets in, in its order, within the token budget."""
        budget = self.max_batched_tokens
        batch: list[tuple[_Seq, int, int]] = []
        for seq in self._prefilling.values():
            if budget == 0:
                break
            n = min(budget, seq.target - seq.filled)
            batch.append((seq, n, seq.filled))
            budget -= n
        if budget > 0:
            for seq in self._policy_admissions():
                if budget == 0:
                    break
                self._take_waiting(seq)
                need = seq.prompt_len + seq.n_out  # the prompt, plus output so far when recomputing
                seq.state = _State.PREFILLING
                seq.target = need
                seq.filled = 0
                seq.kv = need
                seq.recompute = False
                self._used += need
                if seq.n_out > 0:
                    self.recomputed_tokens += need
                self._prefilling[seq.rid] = seq
                n = min(budget, need)
                batch.append((seq, n, 0))
                budget -= n
        if not batch:
            return None
        duration = self.cost.prefill_batch_time((n, context) for _, n, context in batch)
        return "prefill", batch, duration, 0

    # --- admission (decode and colocated roles) ------------------------------------------------------

    def _predicted_total(self, seq: _Seq) -> int:
        pred = seq.req.predicted_output
        return pred[0] if pred is not None else seq.max_tokens

    def _remaining(self, seq: _Seq) -> int:
        """Predicted tokens still to produce: each is one more KV slot (colocated: the token the prefill
        produces takes none, so a request not decoding yet needs one fewer)."""
        left = self._predicted_total(seq) - seq.n_out
        if self.role == "colocated" and seq.state is not _State.RUNNING:
            left -= 1
        return max(1, left)

    def _waiting_context(self, seq: _Seq) -> int:
        if self.role == "colocated":
            return seq.prompt_len + seq.n_out  # its prefill: the prompt, plus output so far when recomputing
        return seq.prompt_len + seq.n_out - 1  # decode: the prompt and the output tokens fed so far

    def _plan_candidates(self, room: int) -> list[str]:
        """The plan policy's order: preempted requests first, then the plan, then unplanned waiting ones."""
        planned = self._plan_set
        preempted = [s.rid for s in self._waiting if s.recompute and s.rid not in planned]
        rest = [s.rid for s in self._waiting if not s.recompute and s.rid not in planned]
        return [*preempted, *self._plan_order, *rest][:room]

    def _policy_admissions(self) -> list[_Seq]:
        """The waiting requests the decode-admission policy admits now, in order (still queued). Each
        would also fit in the next step's memory now."""
        room = self.max_num_seqs - len(self._running) - len(self._prefilling)
        if room <= 0 or not self._waiting:
            return []
        policy = self.policies.decode_admission
        order: list[str] | None = None
        if policy == "plan":
            order = self._plan_candidates(room)
            by_id = {s.rid: s for s in self._waiting}
            candidates = [by_id[rid] for rid in order if rid in by_id]
        else:
            candidates = list(itertools.islice(self._waiting, room))
        active = itertools.chain(self._prefilling.values(), self._running)
        running = [Running(s.rid, s.kv, self._remaining(s)) for s in active]
        waiting = [Waiting(s.rid, self._waiting_context(s), self._remaining(s)) for s in candidates]
        ids = admit(policy, running, waiting, self.kv_capacity, self.max_num_seqs, order)
        if not ids:
            return []
        chosen = {s.rid: s for s in candidates}
        # Guard: never admit what does not fit in the next step now (greedy and reserve already ensure it).
        step = self._used + len(running)
        out: list[_Seq] = []
        for rid in ids:
            seq = chosen[rid]
            step += self._waiting_context(seq) + 1
            if step > self.kv_capacity:
                break
            out.append(seq)
        return out

    def _take_waiting(self, seq: _Seq) -> None:
        """Move an admitted request out of the waiting queue (and the plan)."""
        if self._waiting and self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)
        self.admitted_by_policy += 1
        self._unplan(seq.rid)

    def _unplan(self, rid: str) -> None:
        if rid in self._plan_set:
            self._plan_set.discard(rid)
            self._plan_order.remove(rid)

    # --- decode ------------------------------------------------------------------------------------

    def _plan_decode(self, *, admit: bool) -> _Plan | None:
        """One decode step over the running batch. Each running request feeds its last token, which
        needs one more KV slot: preempt the most recently admitted while the step would overflow the
        cache, then (decode role) admit the waiting requests the admission policy picks."""
        running = self._running
        while running and self._used + len(running) > self.kv_capacity:
            self._preempt(running.pop())
        extra = 0.0
        if admit:
            for seq in self._policy_admissions():
                self._take_waiting(seq)
                cached = seq.prompt_len + seq.n_out - 1  # prompt + output tokens fed so far
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
        return "decode", batch, duration, 0

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
            del self._prefilling[seq.rid]
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
