"""The Worker gRPC service over an `Engine`: prefill with KV hand-over, decode, colocated.

A thin shell: the engine computes, `daemon.scheduling.routing` chooses the decode instance, this module
moves messages. Tokens are coalesced: a chunk carries every token produced since the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from daemon.scheduling.routing import InstanceLoad, least_kv_utilised

from .engines.base import Engine, EngineError, EngineRequest, KVHandle
from .peers import Peers
from .proto import pb, rpc

log = logging.getLogger(__name__)
_DONE = object()


@dataclass
class DecodeView:
    """The decode load the daemon last broadcast, plus what this instance sent since."""

    instances: dict[str, tuple[str, InstanceLoad]] = field(default_factory=dict)  # id -> (address, load)
    sent_since: dict[str, int] = field(default_factory=dict)
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def update(self, msg: pb.DecodeLoadBroadcast) -> None:
        self.instances = {
            d.instance_id: (
                d.address,
                InstanceLoad(
                    d.instance_id, d.load.queued, d.load.running, d.load.kv_used_tokens, d.load.kv_capacity_tokens
                ),
            )
            for d in msg.instances
            if d.load.state == "active"
        }
        self.sent_since.clear()
        self.updated.set()
        self.updated = asyncio.Event()

    def choose(self) -> tuple[str, str] | None:
        loads = [
            InstanceLoad(i, ld.queued, ld.running, ld.kv_used_tokens, ld.kv_capacity_tokens, self.sent_since.get(i, 0))
            for i, (_, ld) in self.instances.items()
        ]
        pick = least_kv_utilised(loads)
        if pick is None:
            return None
        self.sent_since[pick] = self.sent_since.get(pick, 0) + 1
        return pick, self.instances[pick][0]


@dataclass
class _DecodeJob:
    req: EngineRequest
    queue: asyncio.Queue[object]
    task: asyncio.Task[None] | None = None


async def _pump(source: AsyncIterator[int], queue: asyncio.Queue[object]) -> None:
    try:
        async for tok in source:
            queue.put_nowait(tok)
        queue.put_nowait(_DONE)
    except EngineError as e:
        queue.put_nowait(e)
    except asyncio.CancelledError:
        queue.put_nowait(EngineError("aborted"))
        raise


async def _chunks(rid: str, queue: asyncio.Queue[object], produced: int, limit: int) -> AsyncIterator[pb.TokenChunk]:
    """Read a token queue and yield coalesced chunks; the last chunk says why it ended."""
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
            yield pb.TokenChunk(request_id=rid, token_ids=toks)
            continue
        if isinstance(end, EngineError):
            reason = "abort" if str(end) == "aborted" else "error"
            yield pb.TokenChunk(request_id=rid, token_ids=toks, finished=True, finish_reason=reason, error=str(end))
        else:
            yield pb.TokenChunk(
                request_id=rid, token_ids=toks, finished=True, finish_reason="length" if produced >= limit else "stop"
            )
        return


class WorkerService(rpc.WorkerServicer):
    def __init__(self, engine: Engine, role: str, instance_id: str, peers: Peers, token: str | None = None) -> None:
        self.engine = engine
        self.role = role
        self.instance_id = instance_id
        self.peers = peers
        self.token = token
        self.decode_view = DecodeView()
        self.jobs: dict[str, _DecodeJob] = {}  # decode: accepted requests
        self.generating: dict[str, asyncio.Queue[object]] = {}  # colocated: streams in progress
        self.state = "active"

    @staticmethod
    def _req(r: pb.GenerateRequest) -> EngineRequest:
        return EngineRequest(r.request_id, tuple(r.prompt_token_ids), r.max_tokens)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenChunk]:
        req = self._req(request)
        if self.role == "colocated":
            queue: asyncio.Queue[object] = asyncio.Queue()
            self.generating[req.request_id] = queue
            pump = asyncio.create_task(_pump(self.engine.generate(req), queue))
            try:
                async for chunk in _chunks(req.request_id, queue, 0, req.max_tokens):
                    yield chunk
            finally:
                self.generating.pop(req.request_id, None)
                if not pump.done():
                    pump.cancel()
                    await self.engine.abort(req.request_id)
            return
        if self.role != "prefill":
            yield pb.TokenChunk(
                request_id=req.request_id,
                finished=True,
                finish_reason="error",
                error=f"instance {self.instance_id} is a {self.role} instance",
            )
            return
        async for chunk in self._prefill(request, req):
            yield chunk

    async def _prefill(self, request: pb.GenerateRequest, req: EngineRequest) -> AsyncIterator[pb.TokenChunk]:
        rid = req.request_id
        try:
            out = await self.engine.prefill(req)
        except EngineError as e:
            yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="error", error=str(e))
            return
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        if req.max_tokens <= 1:
            await self.engine.release_kv(rid)
            yield pb.TokenChunk(request_id=rid, token_ids=[out.first_token], finished=True, finish_reason="length")
            return
        yield pb.TokenChunk(request_id=rid, token_ids=[out.first_token])
        target = self._target(request.decode_instance_id)
        if target is None:  # the view lags registration by up to one report: wait for the next broadcast
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.decode_view.updated.wait(), timeout=1.0)
            target = self._target(request.decode_instance_id)
        if target is None:
            await self.engine.release_kv(rid)
            yield pb.TokenChunk(
                request_id=rid, finished=True, finish_reason="error", error="no healthy decode instance to hand over to"
            )
            return
        decode_id, address = target
        kv = out.kv
        try:
            reply = await self.peers.worker(address).Accept(
                pb.AcceptRequest(
                    request=request,
                    first_token=out.first_token,
                    kv=pb.KVHandle(
                        request_id=rid,
                        num_tokens=kv.num_tokens,
                        num_bytes=kv.num_bytes,
                        source_instance_id=kv.source_instance_id,
                        params=kv.params,
                    ),
                ),
                timeout=30,
            )
        except grpc.aio.AioRpcError as e:
            reply = pb.AcceptReply(accepted=False, reason=f"decode instance {decode_id} unreachable: {e.code().name}")
        finally:
            await self.engine.release_kv(rid)
        if not reply.accepted:
            yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="error", error=reply.reason)
            return
        yield pb.TokenChunk(request_id=rid, handoff=pb.Handoff(decode_instance_id=decode_id, decode_address=address))

    def _target(self, pinned: str) -> tuple[str, str] | None:
        if pinned:
            hit = self.decode_view.instances.get(pinned)
            return (pinned, hit[0]) if hit else None
        return self.decode_view.choose()

    async def Accept(self, request: pb.AcceptRequest, context: grpc.aio.ServicerContext) -> pb.AcceptReply:
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
        job = _DecodeJob(req, asyncio.Queue())
        job.task = asyncio.create_task(self._decode(job, kv, request.first_token))
        self.jobs[req.request_id] = job
        return pb.AcceptReply(accepted=True)

    async def _decode(self, job: _DecodeJob, kv: KVHandle, first_token: int) -> None:
        try:
            await self.engine.load_kv(job.req, kv)
        except EngineError as e:
            job.queue.put_nowait(e)
            return
        except asyncio.CancelledError:  # cancelled while the KV was still arriving: end the Attach stream
            job.queue.put_nowait(EngineError("aborted"))
            raise
        await _pump(self.engine.decode(job.req, first_token), job.queue)

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenChunk]:
        rid = request.request_id
        job = self.jobs.get(rid)
        if job is None:
            yield pb.TokenChunk(request_id=rid, finished=True, finish_reason="error", error=f"unknown request {rid}")
            return
        finished = False
        try:
            async for chunk in _chunks(rid, job.queue, 1, job.req.max_tokens):
                finished = chunk.finished
                yield chunk
        finally:
            self.jobs.pop(rid, None)
            if not finished and job.task is not None and not job.task.done():
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
        await self.engine.abort(rid)
        return pb.CancelReply(found=job is not None or stream is not None)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        return pb.InfoReply(
            instance_id=self.instance_id,
            role=self.role,
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            load=self.load_report(0.0),
        )

    def load_report(self, now: float) -> pb.LoadReport:
        u = self.engine.usage()
        return pb.LoadReport(
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
        )

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
                with contextlib.suppress(BaseException):
                    await job.task
        self.jobs.clear()
