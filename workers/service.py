"""The Worker gRPC service over an `Engine`: prefill with KV hand-over, decode, colocated.

A thin shell: the engine computes, `tetri.scheduling.routing` chooses the decode instance, this module
moves messages. Tokens are coalesced: a call's tokens produced since its previous answer go together, and
every call's go out in one `ServeDown` per engine step, packed (`Tokens`: a plain list of ids; only a
call's end is a `TokenChunk`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from tetri.gcheap import freeze_startup_heap
from tetri.loopqueue import LoopQueue
from tetri.proto import pb, rpc
from tetri.proto.peers import Peers
from tetri.proto.serve import Answer, AnswerQueue, ServeStreams, StreamBroken
from tetri.sampling import GREEDY, Sampling
from tetri.scheduling.dispatch import DecodeLoad, DispatchView
from tetri.scheduling.flip import flip_refusal
from tetri.scheduling.instance import HEAVY_DECODE
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import LengthPredictor, make_predictor

from .engines.base import Engine, EngineError, EngineRequest, KVHandle, Rejected

log = logging.getLogger(__name__)
_DONE = object()
_CANCELLED = StreamBroken("CANCELLED", "the request was cancelled here")  # a hand-over stopped by our Cancel


ACCEPT_ATTEMPTS = 3  # decode instances tried before a hand-over fails
TARGET_WAIT_S = 3.0  # how long a hand-over waits for a decode instance to appear in the broadcast view


@dataclass
class DecodeView:
    """The decode load the daemon last broadcast (`instances`), and what this instance dispatches on: the
    same loads plus what it sent since (`tetri.scheduling.dispatch.DispatchView`)."""

    instances: dict[str, tuple[str, DecodeLoad]] = field(default_factory=dict)  # id -> (address, load)
    view: DispatchView = field(default_factory=DispatchView)
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def update(self, decodes: list[tuple[str, str, DecodeLoad]]) -> None:
        """A new broadcast: (address, state, load) of each decode instance of this instance's model; only
        active ones are candidates."""
        self.instances = {load.instance_id: (address, load) for address, state, load in decodes if state == "active"}
        self.view = DispatchView(load for _, load in self.instances.values())
        self.updated.set()
        self.updated = asyncio.Event()

    def choose(
        self, policy: str = "least-kv", predicted_lo: int | None = None, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, str] | None:
        pick = self.view.choose(policy, predicted_lo, self.rng, exclude, HEAVY_DECODE)
        return None if pick is None else (pick, self.instances[pick][0])


def decode_loads(msg: pb.DecodeLoadBroadcast, model: str | None = None) -> list[tuple[str, str, DecodeLoad]]:
    """The daemon's broadcast of `model`'s decode instances (None: all), as `DecodeView.update` takes it
    (the edge: protobuf stops here)."""
    return [
        (
            d.address,
            d.load.state,
            DecodeLoad(
                d.instance_id,
                d.load.kv_used_tokens,
                d.load.kv_capacity_tokens,
                d.load.heavy,
                d.load.light,
                d.load.predicted_growth_tokens,
            ),
        )
        for d in msg.instances
        if model is None or d.model == model
    ]


@dataclass
class _DecodeJob:
    req: EngineRequest
    queue: LoopQueue[object]
    task: asyncio.Task[None] | None = None
    produced: int = 1  # the first token came from the prefill instance
    kv_tokens: int = 0  # prompt tokens in the handed-over KV


async def _pump(source: AsyncIterator[int], queue: LoopQueue[object]) -> None:
    try:
        async for tok in source:
            queue.put_nowait(tok)
        queue.put_nowait(_DONE)
    except EngineError as e:
        queue.put_nowait(e)
    except asyncio.CancelledError:
        queue.put_nowait(EngineError("aborted"))
        raise


Tokens = list[int]  # a call's tokens since its previous answer; the call goes on
Reply = Tokens | pb.TokenChunk  # what a Generate or Attach call yields: tokens, then its end


async def _chunks(rid: str, queue: LoopQueue[object], produced: int, limit: int) -> AsyncIterator[Reply]:
    """Read a token queue and yield the tokens coalesced; the last chunk says why it ended."""
    while True:
        item = await queue.get()
        toks: list[int] = []
        end: object | None = None
        while True:
            if item is _DONE or isinstance(item, EngineError):
                end = item
                break
            toks.append(int(item))  # type: ignore[call-overload]
            if queue.empty():
                break
            item = queue.get_nowait()
        produced += len(toks)
        if end is None:
            yield toks
            continue
        if isinstance(end, EngineError):
            reason = "rejected" if isinstance(end, Rejected) else "abort" if str(end) == "aborted" else "error"
            yield pb.TokenChunk(request_id=rid, token_ids=toks, finished=True, finish_reason=reason, error=str(end))
        else:
            yield pb.TokenChunk(
                request_id=rid, token_ids=toks, finished=True, finish_reason="length" if produced >= limit else "stop"
            )
        return


def _sampling(r: pb.GenerateRequest) -> Sampling:
    if not r.HasField("sampling"):
        return GREEDY
    s = r.sampling
    return Sampling(
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def _error_chunk(rid: str, error: str) -> pb.TokenChunk:
    """The last chunk of a request that failed: finish_reason "error" and a one-line reason."""
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="error", error=error)


def _refused_chunk(rid: str, reason: str) -> pb.TokenChunk:
    """The only chunk of a request this instance will not start (draining, flipping, another role now):
    nothing was done, so the caller can send it elsewhere."""
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="refused", error=reason)


class WorkerService(rpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        role: str,
        instance_id: str,
        peers: Peers,
        token: str | None = None,
        engine_factory: Callable[[str], Engine] | None = None,
    ) -> None:
        self.engine = engine
        self.role = role
        self.instance_id = instance_id
        self.peers = peers
        self.token = token
        self.engine_factory = engine_factory  # builds an engine for another role (instance flip)
        self.decode_view = DecodeView(rng=random.Random(instance_id))
        self.jobs: dict[str, _DecodeJob] = {}  # decode: accepted requests
        self.generating: dict[str, LoopQueue[object]] = {}  # colocated: streams in progress
        # prefill: requests waiting for a decode instance to take their KV -> the Accept call's answer queue
        self.handing_over: dict[str, LoopQueue[Answer | StreamBroken]] = {}
        self.serving = ServeStreams(peers)  # prefill: this worker's Serve streams to decode workers
        self.prefilling = 0  # prefill: generate calls in progress
        self.state = "active"
        self.policies = PolicySet()
        self.policy_version = 0
        self.predictor: LengthPredictor | None = None
        self.plan_loaded = False  # decode: admitting in the order of a Sorted-F plan (SetPlan)
        # the prefix cache's events on the report stream (`cache_events`): the stream's epoch, the last
        # batch's number, and whether the next batch must be the engine's whole cache
        self._cache_epoch, self._cache_seq, self._cache_reset = 0, -1, True

    # --- policies (hot-swap) -------------------------------------------------------------------------
    def on_broadcast(self, msg: pb.DecodeLoadBroadcast) -> None:
        """The daemon's broadcast: decode load for the dispatcher, and the policies when they changed."""
        self.decode_view.update(decode_loads(msg, self.engine.model_name))
        if msg.policy_version != self.policy_version and msg.policies_json:
            self.apply_policies(PolicySet(**json.loads(msg.policies_json)), msg.policy_version)

    def apply_policies(self, policies: PolicySet, version: int = 0) -> None:
        old = self.policies
        self.policies, self.policy_version = policies, version
        if (policies.predictor, policies.predictor_accuracy, policies.predictor_granularity) != (
            old.predictor,
            old.predictor_accuracy,
            old.predictor_granularity,
        ) or (self.predictor is None and policies.predictor != "none"):
            self.predictor = make_predictor(
                policies.predictor, policies.predictor_accuracy, policies.predictor_granularity, seed=0
            )
        configure = getattr(self.engine, "configure", None)
        if configure is not None:  # a loaded Sorted-F plan keeps this instance on `plan` admission
            configure(policies.changed(decode_admission="plan") if self.plan_loaded else policies)

    @staticmethod
    def _req(r: pb.GenerateRequest) -> EngineRequest:
        pred = (r.predicted_lo, r.predicted_hi) if r.predicted_lo > 0 else None
        sampling = _sampling(r)
        return EngineRequest(r.request_id, tuple(r.prompt_token_ids), r.max_tokens, pred, r.resumed_tokens, sampling)

    # --- the Serve stream: the daemon's calls, and a prefill worker's hand-overs ------------------------
    async def Serve(
        self, request_iterator: AsyncIterator[pb.ServeUps], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ServeDown]:
        """Every call one caller makes on this worker, multiplexed (`tetri.proto.serve`): each
        `generate`/`attach` runs as its own task, whose chunks (tagged with the call) go out coalesced, one
        message for all chunks and replies ready; an `accept` is answered by one `AcceptReply`; `close`
        cancels a call (as a client leaving a stream would); the stream ending cancels them all."""
        out: LoopQueue[tuple[int, Tokens] | pb.TokenChunk | pb.AcceptReply | None] = LoopQueue()
        loop = asyncio.get_running_loop()  # once: looking it up costs a system call on 3.11 (tetri.loopqueue)
        calls: dict[int, asyncio.Task[None]] = {}

        async def answer(call: int, request: pb.AcceptRequest) -> None:
            try:
                reply = await self._accept(request)
            except Exception as e:  # a fault in this call ends it alone, with the reason
                log.exception("call %d (accept of %s) failed", call, request.request.request_id)
                reply = pb.AcceptReply(accepted=False, reason=f"worker {self.instance_id}: {type(e).__name__}: {e}")
            finally:
                calls.pop(call, None)
            reply.call = call
            out.put_nowait(reply)

        async def run(call: int, chunks: AsyncIterator[Reply], rid: str) -> None:
            try:
                async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                    async for chunk in chunks:
                        if isinstance(chunk, list):
                            out.put_nowait((call, chunk))
                        else:
                            chunk.call = call
                            out.put_nowait(chunk)
            except Exception as e:  # a fault in this call ends it alone, with the reason
                log.exception("call %d (request %s) failed", call, rid)
                chunk = _error_chunk(rid, f"worker {self.instance_id}: {type(e).__name__}: {e}")
                chunk.call = call
                out.put_nowait(chunk)
            finally:
                calls.pop(call, None)

        def start(up: pb.ServeUp) -> None:
            op = up.WhichOneof("op")
            if op == "generate":
                calls[up.call] = loop.create_task(run(up.call, self.generate(up.generate), up.generate.request_id))
            elif op == "attach":
                calls[up.call] = loop.create_task(run(up.call, self.attach(up.attach), up.attach.request_id))
            elif op == "accept":
                calls[up.call] = loop.create_task(answer(up.call, up.accept))
            else:  # close
                task = calls.get(up.call)
                if task is not None:
                    task.cancel()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    for up in message.ups:
                        start(up)
            finally:
                out.put_nowait(None)  # the caller closed the stream

        reader = asyncio.create_task(read())
        try:
            while True:
                first = await out.get()
                if first is None:
                    return
                batch, end = [first], False
                await asyncio.sleep(0)  # the other calls woken by this engine step add theirs: one message
                while not out.empty():
                    item = out.get_nowait()
                    if item is None:
                        end = True
                        break
                    batch.append(item)
                token_calls: list[int] = []
                counts: list[int] = []
                tokens: list[int] = []
                chunks: list[pb.TokenChunk] = []
                replies: list[pb.AcceptReply] = []
                for item in batch:
                    if type(item) is tuple:
                        token_calls.append(item[0])
                        counts.append(len(item[1]))
                        tokens += item[1]
                    elif isinstance(item, pb.TokenChunk):
                        chunks.append(item)
                    else:
                        replies.append(item)  # type: ignore[arg-type]
                yield pb.ServeDown(
                    chunks=chunks, replies=replies, token_calls=token_calls, token_counts=counts, tokens=tokens
                )
                if end:
                    return
        finally:
            reader.cancel()
            running = list(calls.values())
            for task in running:
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[Reply]:
        """A Generate call: colocated, every token; prefill, the first token then the hand-off chunk."""
        req = self._req(request)
        if self.state != "active":
            yield _refused_chunk(req.request_id, f"instance {self.instance_id} is {self.state}")
            return
        if self.role == "colocated":
            queue: LoopQueue[object] = LoopQueue()
            self.generating[req.request_id] = queue
            pump = asyncio.create_task(_pump(self.engine.generate(req), queue))
            try:
                async for chunk in _chunks(req.request_id, queue, 0, req.max_tokens):
                    if type(chunk) is not list:  # its end: how much of its prompt the prefix cache held
                        chunk.cached_tokens = self._cached(req.request_id)  # type: ignore[union-attr]
                    yield chunk
            finally:
                self.generating.pop(req.request_id, None)
                if not pump.done():  # the caller left (a client, or a daemon that moved the request)
                    log.info("request %s: its caller left; aborted", req.request_id)
                    pump.cancel()
                    await self.engine.abort(req.request_id)
            return
        if self.role != "prefill":
            yield _refused_chunk(req.request_id, f"instance {self.instance_id} is a {self.role} instance")
            return
        self.prefilling += 1
        try:
            async for chunk in self._prefill(request, req):
                yield chunk
        finally:
            self.prefilling -= 1

    async def _prefill(self, request: pb.GenerateRequest, req: EngineRequest) -> AsyncIterator[Reply]:
        rid = req.request_id
        if self.predictor is not None and not request.predicted_lo:
            # the length predictor runs beside the prefill (TetriInfer §3.3.2); the sim engine's
            # "true" output length is max_tokens, which the oracle predictor is allowed to see
            lo, hi = self.predictor.predict(request.prompt_token_ids, rid, true_output=request.max_tokens)
            predicted = pb.GenerateRequest()
            predicted.CopyFrom(request)
            predicted.predicted_lo, predicted.predicted_hi = lo, hi
            request = predicted
        try:
            out = await self.engine.prefill(req)
        except Rejected as e:  # waited past the TTFT target (`ttft_miss` reject): the daemon answers 429
            yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="rejected", error=str(e))
            return
        except EngineError as e:
            yield _error_chunk(rid, str(e))
            return
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        cached = self._cached(rid)
        if req.max_tokens <= 1 or out.first_token in req.sampling.stop_token_ids:
            await self.engine.release_kv(rid)
            reason = "length" if out.first_token not in req.sampling.stop_token_ids else "stop"
            yield pb.TokenChunk(
                request_id=rid, token_ids=[out.first_token], finished=True, finish_reason=reason, cached_tokens=cached
            )
            return
        try:  # from here the prompt's KV is held here until the hand-over ends, however it ends
            async for chunk in self._hand_over(request, rid, out.first_token, out.kv):
                if type(chunk) is not list:
                    chunk.cached_tokens = cached  # type: ignore[union-attr]
                yield chunk
        finally:
            await self.engine.release_kv(rid)

    async def _hand_over(
        self, request: pb.GenerateRequest, rid: str, first_token: int, kv: KVHandle
    ) -> AsyncIterator[Reply]:
        """The first token, then a decode instance takes the KV (its Accept is answered once its admission
        pulled it), then the hand-off chunk; or the reason none did. `Cancel` meanwhile ends it with
        "abort"."""
        yield [first_token]
        accept = pb.AcceptRequest(
            request=request,
            first_token=first_token,
            kv=pb.KVHandle(
                request_id=rid,
                num_tokens=kv.num_tokens,
                num_bytes=kv.num_bytes,
                source_instance_id=kv.source_instance_id,
                params=kv.params,
            ),
        )
        refused: list[str] = []
        last_reason = ""
        for _ in range(ACCEPT_ATTEMPTS):  # a refusal (draining, flipping, gone) tries another instance
            target = await self._target(request, frozenset(refused))
            if target is None:
                break
            decode_id, address = target
            # an Accept call on this worker's Serve stream to the decode worker, answered once the decode
            # instance has taken the KV (its admission pulled it), which may wait behind its queue: no
            # deadline. Leaving the call unanswered drops the request there too.
            stream = self.serving.to(address)
            answers = AnswerQueue()
            call = stream.open(answers, accept=accept)
            self.handing_over[rid] = answers
            got: object = None
            try:
                got = await answers.get()
            finally:
                self.handing_over.pop(rid, None)
                stream.leave(call, finished=isinstance(got, pb.AcceptReply))
            if got is _CANCELLED:  # our Cancel RPC
                yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="abort", error="aborted")
                return
            if isinstance(got, StreamBroken):
                reply = pb.AcceptReply(accepted=False, reason=f"decode instance {decode_id} unreachable: {got.code}")
            else:
                assert isinstance(got, pb.AcceptReply)
                reply = got
            if reply.accepted:
                yield pb.TokenChunk(
                    request_id=rid, handoff=pb.Handoff(decode_instance_id=decode_id, decode_address=address)
                )
                return
            refused.append(decode_id)
            last_reason = reply.reason
        error = last_reason if refused else "no healthy decode instance to hand over to"
        yield _error_chunk(rid, error)

    async def _target(self, request: pb.GenerateRequest, exclude: frozenset[str]) -> tuple[str, str] | None:
        """The decode instance to hand over to (the pinned one, or the dispatcher's pick), or None. The view
        is the daemon's last broadcast, which lags its registry (a decode instance that just registered,
        or one whose reports are late on a busy host): without a candidate, later broadcasts are awaited
        for up to `TARGET_WAIT_S` (one was not always enough: a broadcast already on its way is stale)."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            if request.decode_instance_id:
                hit = self.decode_view.instances.get(request.decode_instance_id)
                target = (
                    (request.decode_instance_id, hit[0]) if hit and request.decode_instance_id not in exclude else None
                )
            else:
                target = self.decode_view.choose(self.policies.dispatch, request.predicted_lo or None, exclude)
            left = deadline - time.monotonic()
            if target is not None or left <= 0:
                return target
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.decode_view.updated.wait(), timeout=left)

    async def _accept(self, request: pb.AcceptRequest) -> pb.AcceptReply:
        """An Accept call (decode): take over a prefilled request; answered once the engine has taken its
        KV (or why not). Cancelled (the prefill side left the call), the request is dropped here."""
        if self.role != "decode":
            return pb.AcceptReply(accepted=False, reason=f"instance {self.instance_id} is a {self.role} instance")
        if self.state != "active":
            return pb.AcceptReply(accepted=False, reason=f"instance {self.instance_id} is {self.state}")
        req = self._req(request.request)
        if req.request_id in self.jobs:
            return pb.AcceptReply(accepted=False, reason=f"request {req.request_id} already here")
        kv = KVHandle(
            request.kv.request_id,
            request.kv.num_tokens,
            request.kv.num_bytes,
            request.kv.source_instance_id,
            dict(request.kv.params),
        )
        job = _DecodeJob(req, LoopQueue(), kv_tokens=kv.num_tokens)
        taken: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        job.task = asyncio.create_task(self._decode(job, kv, request.first_token, taken))
        self.jobs[req.request_id] = job
        try:
            error = await taken  # the engine took the KV (None) or could not (why)
        except asyncio.CancelledError:  # the prefill side gave up on the hand-over: drop it here too
            self.jobs.pop(req.request_id, None)
            job.task.cancel()
            await self.engine.abort(req.request_id)
            raise
        if error is not None:
            self.jobs.pop(req.request_id, None)
            return pb.AcceptReply(accepted=False, reason=error)
        return pb.AcceptReply(accepted=True)

    async def _decode(self, job: _DecodeJob, kv: KVHandle, first_token: int, taken: asyncio.Future[str | None]) -> None:
        try:
            await self.engine.load_kv(job.req, kv)
        except EngineError as e:
            if not taken.done():
                taken.set_result(str(e))
            job.queue.put_nowait(e)
            return
        except asyncio.CancelledError:  # cancelled before the KV was taken or while it arrives: end both waits
            if not taken.done():
                taken.set_result(f"request {job.req.request_id} cancelled")
            job.queue.put_nowait(EngineError("aborted"))
            raise
        if not taken.done():
            taken.set_result(None)
        await _pump(self._counted(job, self.engine.decode(job.req, first_token)), job.queue)

    @staticmethod
    async def _counted(job: _DecodeJob, tokens: AsyncIterator[int]) -> AsyncIterator[int]:
        async for tok in tokens:
            job.produced += 1
            yield tok

    async def attach(self, request: pb.AttachRequest) -> AsyncIterator[Reply]:
        """An Attach call (decode): the tokens after the first, buffered since Accept."""
        rid = request.request_id
        job = self.jobs.get(rid)
        if job is None:
            yield _error_chunk(rid, f"unknown request {rid}")
            return
        finished = False
        try:
            async for chunk in _chunks(rid, job.queue, 1, job.req.max_tokens):
                if type(chunk) is not list:
                    finished = True
                    chunk.kv_loaded_tokens = self._kv_loaded(rid, job)  # type: ignore[union-attr]
                yield chunk
        finally:
            self.jobs.pop(rid, None)
            if not finished and job.task is not None and not job.task.done():  # the caller left
                log.info("request %s: its caller left; aborted", rid)
                job.task.cancel()
                await self.engine.abort(rid)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelReply:
        rid = request.request_id
        job = self.jobs.pop(rid, None)
        if job is not None and job.task is not None:
            job.task.cancel()
        stream = self.generating.get(rid)
        if stream is not None:  # the colocated stream ends with "abort", not as a short "stop"
            stream.put_nowait(EngineError("aborted"))
        handover = self.handing_over.pop(rid, None)
        if handover is not None:  # prefilled, waiting for a decode instance to pull the KV: stop that
            handover.put_nowait(_CANCELLED)
        await self.engine.abort(rid)
        return pb.CancelReply(found=job is not None or stream is not None or handover is not None)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        return pb.InfoReply(
            instance_id=self.instance_id,
            role=self.role,
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            load=self.load_report(0.0),
        )

    async def Flip(self, request: pb.FlipRequest, context: grpc.aio.ServicerContext) -> pb.FlipReply:
        """Instance flip (TetriInfer §3.5): stop taking new work, drain what is queued and running,
        then change role on a fresh engine. Peers stop sending here as soon as the daemon's broadcast
        says draining; a hand-over that still arrives is refused and the prefill tries elsewhere."""
        to = request.to_role
        refusal = flip_refusal(self.instance_id, self.role, self.state, to, None)  # the daemon counts instances
        if refusal is not None:
            return pb.FlipReply(ok=False, reason=refusal.reason)
        if self.engine_factory is None:
            return pb.FlipReply(ok=False, reason="this worker cannot build an engine for another role")
        self.state = "draining"
        while self.prefilling or self.jobs or self.generating or self._engine_busy():
            await asyncio.sleep(0.01)
        drained = asyncio.get_running_loop().time()
        self.state = "flipping"
        set_role = getattr(self.engine, "set_role", None)
        if set_role is not None and set_role(to):  # the engine plays both roles (vLLM with kv_both)
            self.role = to
            self.apply_policies(self.policies, self.policy_version)
        else:
            old = self.engine
            new = self.engine_factory(to)
            await new.start()
            freeze_startup_heap()  # the new engine's heap too
            self.engine, self.role = new, to
            self._cache_reset = True  # a new engine, a new (empty) prefix cache: the next batch says so
            self.apply_policies(self.policies, self.policy_version)
            await old.stop()
        self.state = "active"
        return pb.FlipReply(ok=True, drained_at=drained)

    async def SetPlan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext) -> pb.PlanReply:
        """Load (or clear) a Sorted-F plan: this decode instance admits in the plan's order while the
        plan's future fits its KV capacity (M = the engine's capacity)."""
        set_plan = getattr(self.engine, "set_plan", None)
        if self.role != "decode":
            return pb.PlanReply(ok=False, reason=f"instance {self.instance_id} is a {self.role} instance")
        if set_plan is None:
            return pb.PlanReply(ok=False, reason="this engine has no plan admission")
        self.plan_loaded = not request.clear
        set_plan([] if request.clear else list(request.order))
        self.apply_policies(self.policies, self.policy_version)
        return pb.PlanReply(ok=True)

    def _kv_loaded(self, rid: str, job: _DecodeJob) -> int:
        """Prompt tokens this decode took from the hand-over rather than recomputing; -1 when unknown."""
        loaded = getattr(self.engine, "kv_loaded", None)
        if loaded is not None:
            n = loaded(rid)
            return -1 if n is None else int(n)
        return job.kv_tokens  # the sim engine loads the whole handle

    def _engine_busy(self) -> bool:
        u = self.engine.usage()
        return bool(u.running or u.waiting)

    def _cached(self, rid: str) -> int:
        """Prompt tokens of the request its prefill found in the prefix cache; -1 when unknown."""
        n = self.engine.cached_tokens(rid)
        return -1 if n is None else int(n)

    def cache_stream(self, epoch: int) -> None:
        """A new report stream (a new connection to the daemon): its first batch is the whole cache."""
        self._cache_epoch, self._cache_seq, self._cache_reset = epoch, -1, True

    def cache_events(self) -> pb.CacheEvents | None:
        """The next batch of prefix-cache events for the report stream: the engine's whole cache when the
        stream is new or the engine is (a flip built another), else what changed since the last batch
        (None: nothing)."""
        engine = self.engine
        if self._cache_reset:
            engine.cache_delta()  # what the whole cache says already
            stored, removed, reset = engine.cache_keys(), list[int](), True
        else:
            stored, removed = engine.cache_delta()
            reset = False
            if not stored and not removed:
                return None
        self._cache_reset = False
        self._cache_seq += 1
        return pb.CacheEvents(
            epoch=self._cache_epoch,
            seq=self._cache_seq,
            reset=reset,
            stored=stored,
            removed=removed,
            block_size=engine.block_size,
        )

    def load_report(self, now: float, cache: bool = False) -> pb.LoadReport:
        """This instance's load; with `cache` (the report stream's), the prefix cache's next batch of events."""
        u = self.engine.usage()
        report = pb.LoadReport(
            instance_id=self.instance_id,
            role=self.role,
            state=self.state,
            queued=u.waiting,
            running=u.running,
            kv_used_tokens=u.kv_used_tokens,
            kv_capacity_tokens=u.kv_capacity_tokens,
            tokens_per_s=u.tokens_per_s,
            preemptions=u.preemptions,
            timestamp=now,
            heavy=u.heavy,
            light=u.light,
            predicted_growth_tokens=u.predicted_growth_tokens,
            held_kv_tokens=u.held_tokens,
            policy_version=self.policy_version,
            prefix_query_tokens=u.prefix_query_tokens,
            prefix_hit_tokens=u.prefix_hit_tokens,
        )
        events = self.cache_events() if cache else None
        if events is not None:
            report.cache.CopyFrom(events)
        return report

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
                with contextlib.suppress(BaseException):
                    await job.task
        self.jobs.clear()
        await self.serving.close()
