"""VllmEngine: the `Engine` interface over vLLM's v1 `AsyncLLM`, in the worker process.

* prefill role: prompts wait in our prefill queue (`FixedBatchPrefill`: fcfs / sjf / ljf within
  PrefillSchedBatch groups) and are handed to vLLM in that order while the prompt tokens in vLLM stay
  within ChunkSize; each runs with ``max_tokens=1`` and the KV connector as producer. The first token
  and the connector's transfer parameters make the `PrefillOutput`.
* decode role: ``load_kv`` checks the KV is there (HostKVConnector: the hand-over's folder is complete,
  waiting up to ``kv_wait_s``; a missing one is an `EngineError` or a recompute, per ``on_missing_kv``);
  ``decode`` waits for our admission policy (`tetri.scheduling.admission.admit` over this engine's KV
  capacity, blocks × block size; the instance scheduler's "remaining" rule), then continues
  ``prompt + [first token]`` with the connector as consumer, streaming tokens. vLLM reports how many
  prompt tokens it did not compute (``num_cached_tokens``): those its own prefix cache held and those the
  connector loaded, which loads only the blocks the cache lacks; the connector says how many were local,
  so `kv_loaded` is exactly what the hand-over brought.
* colocated role: vLLM as is (the vanilla baseline): one engine, both phases, its own scheduler. Started
  with ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy``), it takes `queue_order` srpt:
  each request goes in with the srpt key as its priority (`srpt_work`: lower first), fcfs gives every
  request the same (vLLM then orders by arrival). vLLM fixes a priority when the request is added, so
  aging does not apply; `ttft_target_s`, `ttft_miss` and `token_budget` are the sim engine's only.

vLLM's automatic prefix caching is on in every role (vLLM's default): a prompt whose leading blocks an
engine holds computes only the rest (`cached_tokens`: vLLM's ``num_cached_tokens`` of a colocated or
prefill request). The engine publishes its KV events (``kv_events_config``, an IPC endpoint of this
worker's); `kvevents` keeps a mirror of its cache in Tetri's block keys, which the worker reports to the
control plane (`cache_keys`, `cache_delta`); its steps' statistics count the prefix cache's lookups and hits.

Requests run through vLLM's engine core directly (`core`): one loop reads each step's outputs and hands
every request's new tokens to its sink (`generate_to`, `decode_to`), without vLLM's output processor.

ChunkSize is vLLM's ``max_num_batched_tokens`` (chunked prefill on), fixed when the engine starts.
Sampling is the request's (`EngineRequest.sampling`: greedy unless the daemon says otherwise); a seeded
request continued here (migrated, or a decode engine's after the prefill engine's first token) has its
generator started as far on as the tokens sampled before, so it samples what one undisturbed run would
(`seeded`). With
``kv_both`` the connector both produces and consumes, so a flip changes the role without restarting vLLM
(`set_role`). A prefill or decode engine's idle processes do not busy-wait (`plugin`, `idle_spin_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetri.scheduling.admission import Running, Waiting, admit, predicted_growth, remaining, srpt_work
from tetri.scheduling.instance import is_heavy
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefill import FixedBatchPrefill, PrefillItem
from workers.engines.base import (
    Engine,
    EngineError,
    EngineRequest,
    EngineUsage,
    KVHandle,
    PrefillOutput,
    TokenSink,
    tokens_of,
)

from . import connectors, kvevents, plugin, seeded
from .core import CoreEnd, CoreLoop, CoreStats
from .kvmirror import KVMirror

ROLES = ("prefill", "decode", "colocated")
TOKENS_PER_S_WINDOW_S = 2.0
IDLE_SPIN_S = 0.005  # prefill/decode engines: spin this long after a message, then nap (`plugin`)

# vLLM logs to stdout by default; a worker's stdout carries its ready line to a parent that may stop
# reading it, so vLLM (and the engine processes it spawns) log to stderr instead
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def parse_cpus(spec: str | None) -> set[int]:
    """ "0", "2-5,8" → {0}, {2, 3, 4, 5, 8}; None or "" → set() (no restriction)."""
    cpus: set[int] = set()
    for part in (spec or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _model_max_len(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return int(cfg.get("max_position_embeddings") or 2048)


@dataclass(frozen=True)
class VllmOptions:
    model: str  # a local Hugging Face model directory
    connector: str = "HostKVConnector"
    kv_store: str = "/dev/shm/tetri-kv"  # HostKVConnector's shared storage path (a tmpfs on one host)
    kv_lease_s: float = 60.0  # HostKVConnector: a hand-over no decode engine loaded within this is removed
    kv_both: bool = False  # one connector role for both phases: flips keep the engine
    on_missing_kv: str = "error"  # error | recompute
    kv_wait_s: float = 5.0
    chunk_size: int = 512  # max_num_batched_tokens
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    load_format: str = "auto"  # auto | dummy (random weights, as vLLM's --load-format dummy)
    enforce_eager: bool = True
    dtype: str = "auto"  # weights and KV: auto (the model's), float32, bfloat16, float16
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs | priority (colocated: queue_order srpt applies)
    connector_extra: tuple[tuple[str, Any], ...] = ()
    # how long the engine's idle processes busy-wait for the next message before they park (`plugin`);
    # None: IDLE_SPIN_S for a prefill engine (one step per prompt: it would otherwise spin a second after
    # each on cores others need) and for a decode engine without cores of its own; vLLM's own (1 s) for a
    # decode engine with `engine_cpus` (a step after another: parking between them costs each a wake-up)
    # and for a colocated one
    idle_spin_s: float | None = None
    # the CPU cores the engine's processes run on (`parse_cpus`: "0", "2-5,8"); None: anywhere
    engine_cpus: str | None = None


@dataclass
class _Decode:
    req: EngineRequest
    produced: int = 0
    admitted: asyncio.Event | None = None


class _Counted:
    """A decode's sink, counting its tokens (its admission's "remaining")."""

    __slots__ = ("d", "sink")

    def __init__(self, sink: TokenSink, d: _Decode) -> None:
        self.sink, self.d = sink, d

    def extend(self, tokens: list[int], /) -> None:
        self.d.produced += len(tokens)
        self.sink.extend(tokens)


class VllmEngine(Engine):
    def __init__(self, options: VllmOptions, role: str, instance_id: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        if options.on_missing_kv not in ("error", "recompute"):
            raise ValueError("on_missing_kv must be error or recompute")
        self.options = options
        self.role = role
        self.instance_id = instance_id
        self.model_name = os.path.basename(os.path.normpath(options.model))
        self.max_model_len = options.max_model_len or 0
        self.vocab_size = 0  # known once started
        self.policies = PolicySet()
        self.kv_capacity = 0
        self.block_size = options.block_size or 0
        self._llm: Any = None
        self._core: CoreLoop | None = None  # reads the engine core's outputs (`core`)
        self._batched = options.chunk_size  # vLLM's max_num_batched_tokens (set when the engine starts)
        self._active = 0  # requests inside vLLM now (its own stats update only when it runs a step)
        self._stopped = False
        self._stats = CoreStats(on_tokens=self._count)
        self._prefill_queue = FixedBatchPrefill()
        self._prefill_waiters: dict[str, asyncio.Future[None]] = {}
        self._prefill_inflight: dict[str, int] = {}
        self._seq = itertools.count()
        self._decodes: dict[str, _Decode] = {}
        self._decode_waiting: list[str] = []
        self._plan: list[str] = []
        self._loaded: dict[str, int] = {}
        self._params: dict[str, dict[str, str]] = {}  # request id → the KV handle's transfer parameters
        self._recent: deque[tuple[float, int]] = deque()
        self._stored: deque[tuple[float, str]] = deque()  # HostKV hand-overs written here: (time, key)
        self._cached: dict[str, int] = {}  # request id -> prompt tokens vLLM's prefix cache held (asked once)
        self._mirror = KVMirror()  # its prefix cache in Tetri's block keys, from its KV events
        self._events_at = kvevents.endpoints(instance_id.replace("/", "_")[:24] + "-" + uuid.uuid4().hex[:6])
        self._events: kvevents.KVEventSubscriber | None = None
        self._events_task: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------------
    def _engine_args(self) -> Any:
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        o = self.options
        kv = connectors.transfer_config(o.connector, self.role, o.kv_both, o.kv_store, dict(o.connector_extra))
        host_kv = kv is not None and o.connector == connectors.HOST_KV
        if host_kv:
            os.makedirs(o.kv_store, exist_ok=True)
        batched = o.chunk_size
        if host_kv and kv is not None and kv["kv_role"] != "kv_consumer":
            # HostKVConnector stores a prompt's KV in the step that first schedules it: a prompt split over
            # iterations would be stored short. So a storing engine fits any prompt in one iteration, and
            # ChunkSize bounds what this worker hands to vLLM at once.
            batched = max(o.chunk_size, o.max_model_len or _model_max_len(o.model))
        self._batched = batched
        kwargs: dict[str, Any] = {
            "model": o.model,
            "skip_tokenizer_init": True,
            "enforce_eager": o.enforce_eager,
            "max_num_batched_tokens": batched,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,  # vLLM's default: a shared prefix is computed once
            "kv_events_config": KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self._events_at.publish,
                replay_endpoint=self._events_at.replay,
            ),
            "max_num_seqs": o.max_num_seqs,
            "gpu_memory_utilization": o.gpu_memory_utilization,
            "tensor_parallel_size": o.tensor_parallel_size,
            "load_format": o.load_format,
            "disable_log_stats": False,
            "dtype": o.dtype,
            "scheduling_policy": o.scheduling_policy,
            "kv_transfer_config": KVTransferConfig(**kv) if kv else None,
        }
        if o.max_model_len:
            kwargs["max_model_len"] = o.max_model_len
        if o.block_size:
            kwargs["block_size"] = o.block_size
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self._engine_args()
        cpus = parse_cpus(self.options.engine_cpus)
        spin = self.options.idle_spin_s
        if spin is None and (self.role == "prefill" or (self.role == "decode" and not cpus)):
            spin = IDLE_SPIN_S
        # the engine's processes inherit this process's environment (the plugin's, the OpenMP binding)
        os.environ[plugin.ENGINE] = "1"
        if spin is None:
            os.environ.pop(plugin.ENV, None)
        else:
            os.environ[plugin.ENV] = repr(spin)
        if cpus:
            os.environ.setdefault(OMP_BIND, ",".join(map(str, sorted(cpus))))

        def create() -> Any:
            # the engine's processes inherit the affinity of the thread that starts them
            saved = os.sched_getaffinity(0)
            if cpus:
                os.sched_setaffinity(0, cpus)
            try:
                return AsyncLLM.from_engine_args(args)
            finally:
                os.sched_setaffinity(0, saved)

        self._llm = await asyncio.to_thread(create)
        self._core = CoreLoop(self._llm, self._stats)
        await self._core.start()
        cfg = self._llm.vllm_config
        self.max_model_len = int(cfg.model_config.max_model_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        self.block_size = int(cfg.cache_config.block_size)
        blocks = int(cfg.cache_config.num_gpu_blocks or 0)
        self.kv_capacity = blocks * self.block_size
        self._mirror.max_blocks = 2 * blocks if blocks else self._mirror.max_blocks
        self._events = kvevents.KVEventSubscriber(self._events_at, self._mirror)
        self._events_task = asyncio.get_running_loop().create_task(self._events.run(), name="vllm-kv-events")

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        core, self._core = self._core, None
        self._stopped = True
        if core is not None:
            await core.stop(f"engine {self.instance_id} stopped")
        await kvevents.stop(self._events_task, self._events)
        self._events_task, self._events = None, None
        for fut in self._prefill_waiters.values():
            if not fut.done():
                fut.set_exception(EngineError(f"engine {self.instance_id} stopped"))
        for d in self._decodes.values():  # decodes waiting for admission end with EngineError
            if d.admitted is not None:
                d.admitted.set()
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        self._events_at.remove()  # the engine's IPC sockets (it bound them, and leaves them behind)

    def set_role(self, role: str) -> bool:
        """Flip in place when the connector plays both roles; False when the engine must be rebuilt."""
        if not self.options.kv_both or role == "colocated" or self.role == "colocated":
            return False
        self.role = role
        return True

    # --- policies ------------------------------------------------------------------------------------
    def configure(self, policies: PolicySet | None = None, **_: Any) -> None:
        if policies is not None:
            self.policies = policies
            self._prefill_queue.configure(policies.prefill_policy, policies.prefill_sched_batch)
            self._pump_prefill()
            self._admit_decodes()

    def set_plan(self, order: list[str]) -> None:
        self._plan = [rid for rid in dict.fromkeys(order) if rid not in self._decodes or self._waiting(rid)]
        self._admit_decodes()

    # --- prefill ---------------------------------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> PrefillOutput:
        self._check_role("prefill", "prefill")
        self._validate(req)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._prefill_waiters[req.request_id] = fut
        self._prefill_queue.add(PrefillItem(req.request_id, req.prompt_len, next(self._seq)))
        self._pump_prefill()
        try:
            await fut  # our prefill order hands the prompt to vLLM
            if self._llm is None:
                raise EngineError(f"engine {self.instance_id} stopped")
            key = uuid.uuid4().hex  # this hand-over's own (HostKV: its file's name)
            sp = self._sampling(req, 1, connectors.prefill_params(self.options.connector, key), req.resumed_tokens)
            got: list[int] = []
            end = await self._run(req, list(req.prompt_token_ids), sp, got)
            self._note_cached(req.request_id, end.cached)
            if not got:
                raise EngineError(f"request {req.request_id}: vLLM returned no token")
            first = got[0]
        finally:
            self._prefill_waiters.pop(req.request_id, None)
            self._prefill_queue.remove(req.request_id)
            self._prefill_inflight.pop(req.request_id, None)
            self._pump_prefill()
        n = req.prompt_len  # the whole prompt's KV is handed over
        if self.options.connector == connectors.HOST_KV:
            self._lease(key)
            if not connectors.complete(self.options.kv_store, key):
                n = 0  # the connector could not write it (it logs why): the decode side computes the prompt
        params = connectors.handoff_params(self.options.connector, key, end.kv_params)
        kv = KVHandle(req.request_id, n, n * self._kv_bytes_per_token(), self.instance_id, params)
        return PrefillOutput(first, kv)

    def _lease(self, key: str) -> None:
        """Remember a stored hand-over and remove those older than ``kv_lease_s`` that no decode engine
        loaded (a decode engine removes what it loads): a hand-over that failed leaves nothing behind."""
        now = time.monotonic()
        self._stored.append((now, key))
        while self._stored and now - self._stored[0][0] > self.options.kv_lease_s:
            _, old = self._stored.popleft()
            with contextlib.suppress(FileNotFoundError):
                os.remove(connectors.kv_file(self.options.kv_store, old))

    def _pump_prefill(self) -> None:
        """Hand queued prompts to vLLM in policy order while their tokens fit ChunkSize."""
        # a hot-swapped ChunkSize applies up to vLLM's own per-iteration limit, fixed at start
        budget = max(1, min(self.policies.chunk_size, self._batched))
        busy = bool(self._prefill_inflight)
        room = budget - sum(self._prefill_inflight.values())
        if room <= 0 and busy:
            return
        # a prompt larger than ChunkSize goes alone; otherwise the prompts handed over together fit it
        for item in self._prefill_queue.next_batch(max(1, room), at_least_one=not busy):
            fut = self._prefill_waiters.get(item.request_id)
            if fut is None or fut.done():
                continue
            self._prefill_inflight[item.request_id] = item.prompt_len
            fut.set_result(None)

    # --- decode ----------------------------------------------------------------------------------------
    async def load_kv(self, req: EngineRequest, kv: KVHandle) -> None:
        self._check_role("load_kv", "decode")
        self._validate(req)
        self._params[req.request_id] = dict(kv.params)
        key = kv.params.get(connectors.KEY)
        if self.options.connector != connectors.HOST_KV or not key or kv.num_tokens == 0:
            return  # NIXL / NCCL pull the KV while vLLM schedules the request; or nothing to load
        store = self.options.kv_store
        deadline = time.monotonic() + self.options.kv_wait_s
        delay = 0.001
        while not connectors.complete(store, key):  # written before the first token left the prefill side
            if time.monotonic() > deadline:
                self._params.pop(req.request_id, None)
                if self.options.on_missing_kv == "recompute":
                    return
                raise EngineError(
                    f"request {req.request_id}: its KV never arrived from {kv.source_instance_id} "
                    f"(no {connectors.kv_file(store, key)} after {self.options.kv_wait_s:g}s)"
                )
            await asyncio.sleep(delay)
            delay = min(0.05, delay * 2)

    def decode(self, req: EngineRequest, first_token: int) -> AsyncIterator[int]:
        return tokens_of(lambda sink: self.decode_to(req, first_token, sink))

    async def decode_to(self, req: EngineRequest, first_token: int, sink: TokenSink) -> None:
        self._check_role("decode", "decode")
        d = _Decode(req, admitted=asyncio.Event())
        self._decodes[req.request_id] = d
        self._decode_waiting.append(req.request_id)
        self._admit_decodes()
        try:
            assert d.admitted is not None
            await d.admitted.wait()
            if self._llm is None:
                raise EngineError(f"engine {self.instance_id} stopped")
            if req.max_tokens <= 1:
                return
            prompt = [*req.prompt_token_ids, first_token]
            params = connectors.decode_params(self._params.pop(req.request_id, {}))
            # the prefill engine sampled output token `resumed_tokens` (the first token here)
            sp = self._sampling(req, req.max_tokens - 1, params or None, req.resumed_tokens + 1)
            end = await self._run(req, prompt, sp, _Counted(sink, d))
            # vLLM's cached tokens of a decode: its prefix cache's and the connector's; HostKV says how many
            # were local (NIXL: the prefill side's hits; loaded unknown)
            if end.cached is not None and self.options.connector == connectors.HOST_KV:
                local = (end.kv_params or {}).get(connectors.LOCAL, 0)
                self._loaded[req.request_id] = max(0, end.cached - int(local or 0))
        finally:
            self._decodes.pop(req.request_id, None)
            self._params.pop(req.request_id, None)
            with contextlib.suppress(ValueError):
                self._decode_waiting.remove(req.request_id)
            self._admit_decodes()

    def _waiting(self, rid: str) -> bool:
        return rid in self._decode_waiting

    def _admit_decodes(self) -> None:
        """Our decode admission in front of vLLM: the same policy call and the same "remaining" rule as
        the instance scheduler (`tetri.scheduling.admission`), over this engine's KV capacity. A request
        holds its prompt and the tokens fed so far (the prefill's first token is fed by the first step)."""
        if self.role != "decode" or not self._decode_waiting:
            return
        point = self.policies.reserve_point
        running = [
            Running(rid, d.req.prompt_len + d.produced, self._remaining(d, point))
            for rid, d in self._decodes.items()
            if rid not in self._decode_waiting
        ]
        waiting = [
            Waiting(rid, self._decodes[rid].req.prompt_len, self._remaining(self._decodes[rid], point))
            for rid in self._decode_waiting
        ]
        policy = self.policies.decode_admission
        cap = self.kv_capacity or (1 << 30)
        order = None
        if policy == "plan":  # as the instance scheduler: planned ones here in plan order, then the others
            queued = set(self._decode_waiting)
            planned = [rid for rid in self._plan if rid in queued]
            order = [*planned, *(rid for rid in self._decode_waiting if rid not in set(planned))]
        chosen = admit(policy, running, waiting, cap, self.options.max_num_seqs, plan_order=order)
        for rid in chosen:
            self._decode_waiting.remove(rid)
            if rid in self._plan:
                self._plan.remove(rid)
            ev = self._decodes[rid].admitted
            if ev is not None:
                ev.set()

    @staticmethod
    def _remaining(d: _Decode, point: str) -> int:
        return remaining(d.req.predicted_output, d.req.max_tokens, 1 + d.produced, point)

    def _note_cached(self, request_id: str, cached: int | None) -> None:
        """vLLM's count of the prompt tokens it did not compute (its prefix cache's: no connector loads here)."""
        if request_id not in self._cached and cached is not None:
            self._cached[request_id] = cached
            if len(self._cached) > 65_536:  # asked by no one
                del self._cached[next(iter(self._cached))]

    def cached_tokens(self, request_id: str) -> int | None:
        return self._cached.pop(request_id, None)

    def cache_keys(self) -> list[int]:
        return self._mirror.keys()

    def cache_delta(self) -> tuple[list[int], list[int]]:
        return self._mirror.delta()

    def kv_loaded(self, request_id: str) -> int | None:
        """Prompt tokens of a decode whose KV vLLM loaded through the connector (None: not known)."""
        return self._loaded.pop(request_id, None)

    # --- colocated -------------------------------------------------------------------------------------
    def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        return tokens_of(lambda sink: self.generate_to(req, sink))

    async def generate_to(self, req: EngineRequest, sink: TokenSink) -> None:
        self._check_role("generate", "colocated")
        self._validate(req)
        sp = self._sampling(req, req.max_tokens, None, req.resumed_tokens)
        end = await self._run(req, list(req.prompt_token_ids), sp, sink, self._priority(req))
        self._note_cached(req.request_id, end.cached)

    async def _run(self, req: EngineRequest, prompt: list[int], sp: Any, sink: TokenSink, priority: int = 0) -> CoreEnd:
        """One request through vLLM's engine core (`core`); an end other than stop or length is an EngineError."""
        if self._core is None:
            raise EngineError(f"engine {self.instance_id} is not running")
        self._active += 1
        try:
            end = await self._core.run(req.request_id, prompt, sp, sink, priority)
        finally:
            self._active -= 1
        if end.reason == "abort":
            raise EngineError("aborted")
        if end.reason == "error":
            raise EngineError(f"request {req.request_id}: vLLM ended it with an error")
        return end

    def _priority(self, req: EngineRequest) -> int:
        """vLLM's priority for a colocated request (lower first): srpt's key in hundredths, when vLLM runs
        its priority policy and `queue_order` is srpt; otherwise 0 (vLLM orders equal priorities by arrival)."""
        if self.options.scheduling_policy != "priority" or self.policies.queue_order != "srpt":
            return 0
        pred = req.predicted_output
        left = remaining(pred, req.max_tokens, 1, self.policies.reserve_point) if pred is not None else None
        return round(100 * srpt_work(len(req.prompt_token_ids), self._batched, left))

    # --- the rest of the interface ----------------------------------------------------------------------
    async def release_kv(self, request_id: str) -> None:
        # HostKV: the decode engine removes what it loads, the lease what it never loads (`_lease`).
        # NIXL/NCCL: vLLM frees the producer's blocks when the consumer pulls them, or after its own timeout
        # when a hand-over never happens (not tested here: no GPU)
        return

    async def abort(self, request_id: str) -> None:
        fut = self._prefill_waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(EngineError("aborted"))
        self._prefill_queue.remove(request_id)
        self._params.pop(request_id, None)
        self._loaded.pop(request_id, None)
        self._cached.pop(request_id, None)
        if request_id in self._plan:
            self._plan.remove(request_id)
        if self._core is not None:
            await self._core.abort(request_id)

    def usage(self) -> EngineUsage:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
            self._recent.popleft()
        tps = sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW_S
        queued = len(self._prefill_waiters) - len(self._prefill_inflight) + len(self._decode_waiting)
        heavy = sum(1 for d in self._decodes.values() if is_heavy(d.req.predicted_output))
        point = self.policies.reserve_point
        growth = sum(
            predicted_growth(d.req.predicted_output, d.req.max_tokens, 1 + d.produced, point)
            for d in self._decodes.values()
        )
        return EngineUsage(
            kv_capacity_tokens=self.kv_capacity,
            kv_used_tokens=round(self._stats.kv_cache_usage * self.kv_capacity),
            running=self._active,
            waiting=max(0, queued),
            tokens_per_s=tps,
            preemptions=self._stats.preemptions,
            heavy=heavy,
            light=len(self._decodes) - heavy,
            predicted_growth_tokens=growth,
            prefix_query_tokens=self._stats.prefix_queries,
            prefix_hit_tokens=self._stats.prefix_hits,
        )

    # --- helpers -----------------------------------------------------------------------------------------
    def _sampling(self, req: EngineRequest, max_tokens: int, kv_params: dict[str, Any] | None, drawn: int) -> Any:
        """vLLM's SamplingParams for the request (the daemon resolved the defaults and the EOS ids: vLLM has
        no tokenizer here, so `stop_token_ids` carry the model's EOS unless `ignore_eos`). `drawn`: the
        request's output tokens sampled before this engine's first (a migrated request's resumed tokens; a
        decode engine's also the prefill engine's first token): a seeded request's generator starts that
        many draws on (`seeded`), so it samples what one undisturbed run on one engine would."""
        from vllm import SamplingParams

        s = req.sampling
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )
        extra: dict[str, Any] = {}
        if kv_params:
            extra["kv_transfer_params"] = kv_params
        if drawn > 0 and s.seed is not None and s.temperature > 0:
            extra[seeded.DRAWS] = drawn
        if extra:
            sp.extra_args = extra
        return sp

    def _kv_bytes_per_token(self) -> int:
        if self._llm is None:
            return 0
        m = self._llm.vllm_config.model_config
        hf = m.hf_config
        layers = int(getattr(hf, "num_hidden_layers", 0))
        kv_heads = int(getattr(hf, "num_key_value_heads", getattr(hf, "num_attention_heads", 0)))
        head_dim = int(getattr(hf, "head_dim", 0) or hf.hidden_size // hf.num_attention_heads)
        return 2 * layers * kv_heads * head_dim * int(m.dtype.itemsize)

    def _count(self, n: int) -> None:
        self._recent.append((time.monotonic(), n))

    def _check_role(self, method: str, role: str) -> None:
        if self.role != role:
            raise EngineError(f"{method}: instance {self.instance_id} is a {self.role} instance")
        if self._llm is None:
            raise EngineError(f"engine {self.instance_id} is not running")

    def _validate(self, req: EngineRequest) -> None:
        if req.prompt_len + req.max_tokens > self.max_model_len:
            raise EngineError(
                f"request {req.request_id}: prompt {req.prompt_len} + max_tokens {req.max_tokens} tokens "
                f"exceeds the context of {self.max_model_len}"
            )
