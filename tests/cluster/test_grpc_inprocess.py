"""The gRPC services in one process: real grpc.aio servers on 127.0.0.1, real SimEngines (`tiny` profile
on a ScaledClock), real channels. Covers daemon/controller/edge.py's ControlPlaneService, daemon/cluster.py's
Cluster, daemon/worker_client.py's WorkerClient and workers/service.py's WorkerService (prefill → decode
hand-over, colocated, cancel, errors)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon.cluster import Instance, LoadReport
from daemon.controller.edge import ControlPlaneService
from daemon.controller.registry import Registry
from daemon.db.store import Store
from daemon.db.writer import BatchWriter
from daemon.front.gateway import Failed, Finished, Gateway
from daemon.front.route import Router
from daemon.metrics import Metrics
from daemon.worker_client import Call, Handoff, TokenChunk, WorkerCallError, WorkerClient
from tetri.clock import ScaledClock
from tetri.costmodel import load_profile
from tetri.proto import pb, rpc
from tetri.proto.peers import Peers, auth_metadata
from tetri.proto.security import make_server
from tetri.scheduling.dispatch import DecodeLoad
from tetri.scheduling.instance import Phase
from workers.control import ControlLink, RegistrationRefused
from workers.engines.sim import SimEngine, sim_token
from workers.service import DecodeView, WorkerService, decode_loads

PROFILE = load_profile("tiny")
VOCAB = PROFILE.model.vocab_size
MAX_LEN = PROFILE.model.max_model_len
SCALE = 50.0
TOKEN = "s3cret-token"


# --- plumbing -------------------------------------------------------------------------------------


@asynccontextmanager
async def _serve(add: Callable[[grpc.aio.Server], None], token: str | None = None) -> AsyncIterator[str]:
    server, port = make_server("127.0.0.1:0", token)  # the processes' own server: token check included
    add(server)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


@dataclass
class Node:
    service: WorkerService
    engine: SimEngine
    address: str
    stub: rpc.WorkerStub

    @property
    def id(self) -> str:
        return self.service.instance_id


@asynccontextmanager
async def _worker(role: str, instance_id: str, scale: float = SCALE, token: str | None = None) -> AsyncIterator[Node]:
    engine = SimEngine(PROFILE, role, instance_id, ScaledClock(scale))
    peers = Peers(token)
    service = WorkerService(engine, role, instance_id, peers)
    await engine.start()
    try:
        async with (
            _serve(lambda s: rpc.add_WorkerServicer_to_server(service, s), token) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            yield Node(service, engine, address, rpc.WorkerStub(channel))
    finally:
        await service.close()
        await peers.close()
        await engine.stop()


@asynccontextmanager
async def _control_plane(
    token: str | None = None, report_interval_s: float = 0.05, unhealthy_after: int = 3
) -> AsyncIterator[tuple[Registry, list[Instance], rpc.ControlPlaneStub, str]]:
    cluster = Registry(report_interval_s=report_interval_s, unhealthy_after=unhealthy_after)
    registered: list[Instance] = []
    service = ControlPlaneService(cluster, registered.append)
    async with (
        _serve(lambda s: rpc.add_ControlPlaneServicer_to_server(service, s), token) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        yield cluster, registered, rpc.ControlPlaneStub(channel), address


def _run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Each test is one event loop; a hung stream fails the test instead of hanging the run."""

    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout=10)

    asyncio.run(bounded())


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % VOCAB for i in range(n)]


def _gen(rid: str, prompt: list[int], max_tokens: int, decode_instance_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens, decode_instance_id=decode_instance_id
    )


def _accept(rid: str, prompt: list[int], max_tokens: int, first_token: int = 7) -> pb.AcceptRequest:
    return pb.AcceptRequest(
        request=_gen(rid, prompt, max_tokens),
        first_token=first_token,
        kv=pb.KVHandle(request_id=rid, num_tokens=len(prompt), num_bytes=len(prompt) * 2048, source_instance_id="p"),
    )


class _Call:
    """One Generate, Attach or Accept call on a Serve stream of its own, driven at the wire as the daemon
    (or a prefill worker) does."""

    def __init__(
        self,
        stub: rpc.WorkerStub,
        metadata: tuple[tuple[str, str], ...] = (),
        **op: pb.GenerateRequest | pb.AttachRequest | pb.AcceptRequest,
    ) -> None:
        self._up: asyncio.Queue[pb.ServeUp | None] = asyncio.Queue()
        self._up.put_nowait(pb.ServeUp(call=1, **op))  # type: ignore[arg-type]
        self._stream = stub.Serve(self._ups(), metadata=metadata)
        self._ready: list[pb.TokenChunk] = []
        self.done = False
        (what,) = op.values()  # a packed token carries its call, not its request's id: the call knows it
        self._rid = what.request.request_id if isinstance(what, pb.AcceptRequest) else what.request_id

    async def _ups(self) -> AsyncIterator[pb.ServeUps]:
        while (msg := await self._up.get()) is not None:
            yield pb.ServeUps(ups=[msg])

    async def reply(self) -> pb.AcceptReply:
        """An Accept call's one answer; the stream is closed after it."""
        down = await self._stream.read()
        assert down is not grpc.aio.EOF, "the Serve stream ended before the call did"
        (reply,) = down.replies
        assert reply.call == 1 and not down.chunks
        self.done = True
        self._up.put_nowait(None)
        self._stream.cancel()
        return reply

    async def read(self) -> pb.TokenChunk:
        """The call's next chunk; after its last (finished, or the hand-off), the stream is closed."""
        while not self._ready:
            down = await self._stream.read()
            assert down is not grpc.aio.EOF, "the Serve stream ended before the call did"
            assert all(c.call == 1 for c in down.chunks) and all(c == 1 for c in down.token_calls)
            assert sum(down.token_counts) == len(down.tokens)
            if down.tokens:  # the call's packed tokens come before its end in the same message
                self._ready.append(pb.TokenChunk(request_id=self._rid, token_ids=down.tokens, call=1))
            self._ready.extend(down.chunks)
        chunk = self._ready.pop(0)
        if chunk.finished or chunk.HasField("handoff"):
            self.done = True
            self._up.put_nowait(None)
            self._stream.cancel()
        return chunk

    def cancel(self) -> None:
        """Leave the call early (the worker stops it) and close the stream."""
        if not self.done:
            self._up.put_nowait(pb.ServeUp(call=1, close=True))
            self._up.put_nowait(None)
            self.done = True


def _generate(stub: rpc.WorkerStub, request: pb.GenerateRequest) -> _Call:
    return _Call(stub, generate=request)


def _attach(stub: rpc.WorkerStub, rid: str) -> _Call:
    return _Call(stub, attach=pb.AttachRequest(request_id=rid))


async def _accept_on(stub: rpc.WorkerStub, request: pb.AcceptRequest) -> pb.AcceptReply:
    """Hand a request over to a decode worker as a prefill worker does: an Accept call on a Serve stream."""
    return await _Call(stub, accept=request).reply()


async def _collect(call: _Call) -> list[pb.TokenChunk]:
    chunks = [await call.read()]
    while not call.done:
        chunks.append(await call.read())
    return chunks


def _tokens(chunks: list[pb.TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


class _Stream:
    """A WorkerClient call's answers, awaited one at a time (as TokenChunks; the end raises when lost)."""

    def __init__(self, start: Callable[..., Call]) -> None:
        self._answers: asyncio.Queue[TokenChunk | WorkerCallError] = asyncio.Queue()
        self.call = start(receiver=self)
        self.over = False

    def tokens(self, ids: list[int]) -> None:
        self._answers.put_nowait(TokenChunk("", ids))

    def end(self, chunk: TokenChunk) -> None:
        self._answers.put_nowait(chunk)

    def lost(self, error: WorkerCallError) -> None:
        self._answers.put_nowait(error)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self.over:
            raise StopAsyncIteration
        got = await self._answers.get()
        if isinstance(got, WorkerCallError):
            self.over = True
            raise got
        self.over = got.finished or got.handoff is not None
        return got

    async def aclose(self) -> None:
        self.call.leave()
        self.over = True


def _generate_on(client: WorkerClient, *args: Any) -> _Stream:
    return _Stream(lambda receiver: client.generate(*args, receiver=receiver))


def _attach_on(client: WorkerClient, address: str, rid: str) -> _Stream:
    return _Stream(lambda receiver: client.attach(address, rid, receiver=receiver))


def _broadcast(*decodes: Node, state: str = "active") -> pb.DecodeLoadBroadcast:
    instances = []
    for n in decodes:
        load = n.service.load_report(0.0)
        load.state = state
        assert load.kv_capacity_tokens > 0
        instances.append(pb.DecodeInstanceLoad(instance_id=n.id, address=n.address, load=load))
    return pb.DecodeLoadBroadcast(instances=instances, timestamp=time.time())


def _register(iid: str, role: str, address: str = "127.0.0.1:1", kv: int = 4096) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        instance_id=iid,
        role=role,
        address=address,
        model="tetri/tiny-sim",
        max_model_len=MAX_LEN,
        kv_capacity_tokens=kv,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- ControlPlaneService --------------------------------------------------------------------------


def test_register_accepts_known_roles_and_refuses_others() -> None:
    async def scenario() -> None:
        async with _control_plane(report_interval_s=0.05) as (cluster, registered, stub, _):
            for port, (iid, role) in enumerate((("p1", "prefill"), ("d1", "decode"), ("c1", "colocated")), 5001):
                reply = await stub.Register(_register(iid, role, address=f"127.0.0.1:{port}"))
                assert reply.accepted, reply.reason
                assert reply.report_interval_s == pytest.approx(0.05)
            assert set(cluster.instances) == {"p1", "d1", "c1"}
            d1 = cluster.instances["d1"]
            assert (d1.role, d1.address, d1.model, d1.max_model_len) == (
                "decode",
                "127.0.0.1:5002",
                "tetri/tiny-sim",
                MAX_LEN,
            )
            assert d1.kv_capacity_tokens == 4096
            assert d1.state == "active"
            assert [i.id for i in registered] == ["p1", "d1", "c1"]
            assert [i.id for i in cluster.healthy("decode")] == ["d1"]

            bad = await stub.Register(_register("x1", "router"))
            assert not bad.accepted
            assert "router" in bad.reason
            no_addr = await stub.Register(_register("x2", "decode", address=""))
            assert not no_addr.accepted
            assert "address" in no_addr.reason
            assert "x1" not in cluster.instances
            assert "x2" not in cluster.instances
            assert len(registered) == 3

            # A worker re-registering itself (same address: its daemon link reconnected) is accepted and keeps
            # the daemon's in-flight count; another process claiming a live id is refused, and the id stays
            # with its worker; once that worker has gone unhealthy a replacement may take the id.
            cluster.instances["d1"].inflight = 2
            again = await stub.Register(_register("d1", "decode", address="127.0.0.1:5002"))
            assert again.accepted and cluster.instances["d1"].inflight == 2
            rogue = await stub.Register(_register("d1", "decode", address="127.0.0.1:6000"))
            assert not rogue.accepted and "held by a live worker at 127.0.0.1:5002" in rogue.reason
            assert cluster.instances["d1"].address == "127.0.0.1:5002"
            cluster.instances["d1"].state = "unhealthy"  # one failed call: the id is still held
            assert not (await stub.Register(_register("d1", "decode", address="127.0.0.1:6000"))).accepted
            cluster.instances["d1"].last_report -= 3600  # silent past the health limit: a replacement may
            replacement = await stub.Register(_register("d1", "decode", address="127.0.0.1:6000"))
            assert replacement.accepted
            assert cluster.instances["d1"].address == "127.0.0.1:6000"
            assert cluster.instances["d1"].inflight == 2

    _run(scenario)


def test_register_and_report_need_the_token() -> None:
    async def scenario() -> None:
        async with _control_plane(token=TOKEN) as (cluster, registered, stub, _):
            for metadata in ((), auth_metadata("wrong"), (("authorization", TOKEN),)):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Register(_register("p1", "prefill"), metadata=metadata)
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert cluster.instances == {}
            assert registered == []

            ok = await stub.Register(_register("p1", "prefill"), metadata=auth_metadata(TOKEN))
            assert ok.accepted
            assert "p1" in cluster.instances

            # The stream is refused before any report is read. (Nothing is written here: a write racing the
            # server's abort turns into a client-side INTERNAL status in grpc.aio.)
            for metadata in ((), auth_metadata("wrong")):
                call = stub.ReportLoad(metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call.read()
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert cluster.instances["p1"].reports == 0

            call = stub.ReportLoad(metadata=auth_metadata(TOKEN))
            await call.write(pb.LoadReport(instance_id="p1", role="prefill", state="active", queued=9))
            msg = await call.read()
            assert isinstance(msg, pb.DecodeLoadBroadcast)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert cluster.instances["p1"].load.queued == 9

    _run(scenario)


def test_report_load_answers_each_report_with_decode_load() -> None:
    """A prefill instance's report is answered with the decode instances' load (built at most every half
    report interval: the same answer until then), once: a stream is not sent an answer it was sent
    already; a decode instance's report is not answered while its policies are current (it dispatches
    nothing)."""

    async def scenario() -> None:
        async with _control_plane() as (cluster, _, stub, _):
            for req in (
                _register("p1", "prefill", "127.0.0.1:7001"),
                _register("d1", "decode", "127.0.0.1:7002", kv=4000),
                _register("d2", "decode", "127.0.0.1:7003", kv=5000),
            ):
                assert (await stub.Register(req)).accepted

            decode = stub.ReportLoad()
            await decode.write(
                pb.LoadReport(
                    instance_id="d1",
                    role="decode",
                    state="active",
                    queued=2,
                    running=3,
                    kv_used_tokens=100,
                    kv_capacity_tokens=4000,
                    tokens_per_s=55.0,
                )
            )
            prefill = stub.ReportLoad()
            await prefill.write(pb.LoadReport(instance_id="p1", role="prefill", state="active"))
            first = await prefill.read()
            assert isinstance(first, pb.DecodeLoadBroadcast)
            by_id = {d.instance_id: d for d in first.instances}
            assert set(by_id) == {"d1", "d2"}  # decode instances only
            assert by_id["d1"].address == "127.0.0.1:7002"
            assert (by_id["d1"].load.queued, by_id["d1"].load.running, by_id["d1"].load.kv_used_tokens) == (2, 3, 100)
            assert by_id["d1"].load.state == "active"
            # d2 has not reported: its capacity comes from the registration
            assert by_id["d2"].load.kv_capacity_tokens == 5000
            assert by_id["d2"].load.kv_used_tokens == 0
            assert by_id["d2"].load.state == "active"
            assert first.timestamp > 0 and first.policies_json

            await decode.write(
                pb.LoadReport(instance_id="d2", role="decode", state="active", queued=1, kv_used_tokens=700)
            )
            await asyncio.sleep(0.03)  # past half the report interval (0.05 s): the next answer is rebuilt
            await prefill.write(pb.LoadReport(instance_id="p1", role="prefill", state="active"))
            second = await prefill.read()
            by_id = {d.instance_id: d for d in second.instances}
            assert by_id["d2"].load.kv_used_tokens == 700
            assert by_id["d2"].load.queued == 1
            assert by_id["d2"].load.kv_capacity_tokens == 5000  # a report without capacity keeps the registered one
            assert by_id["d1"].load.kv_used_tokens == 100

            await asyncio.sleep(0.06)
            await prefill.write(pb.LoadReport(instance_id="p1", role="prefill", state="active"))
            await decode.done_writing()
            assert await decode.read() is grpc.aio.EOF  # no answer to a decode instance: policies current
            await prefill.done_writing()
            assert await prefill.read() is grpc.aio.EOF  # nothing new since `second`: not sent again
            assert cluster.instances["d1"].reports == 1
            assert cluster.instances["d2"].reports == 1
            assert cluster.instances["p1"].reports == 3
            again = stub.ReportLoad()  # a new stream (the worker reconnected) is sent the current answer
            await again.write(pb.LoadReport(instance_id="p1", role="prefill", state="active"))
            assert {d.instance_id: d.load.kv_used_tokens for d in (await again.read()).instances} == {
                "d1": 100,
                "d2": 700,
            }
            await again.done_writing()
            assert await again.read() is grpc.aio.EOF

            # A report for an unknown instance (removed as dead, or never registered) ends the stream with
            # NOT_FOUND, so the worker's link registers again; nothing is added.
            ghost = stub.ReportLoad()
            await ghost.write(pb.LoadReport(instance_id="ghost", role="decode", state="active"))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await ghost.read()
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            assert "ghost" not in cluster.instances

            # A prefill dispatcher's view of that broadcast.
            view = DecodeView()
            view.update(decode_loads(second))
            assert set(view.instances) == {"d1", "d2"}
            assert view.choose() == ("d1", "127.0.0.1:7002")  # d1: 100/4000 used, d2: 700/5000

    _run(scenario)


def test_health_check_marks_unhealthy_and_a_report_revives() -> None:
    async def scenario() -> None:
        async with _control_plane(report_interval_s=0.05, unhealthy_after=3) as (cluster, _, stub, _):
            assert (await stub.Register(_register("d1", "decode", "127.0.0.1:7002"))).accepted
            assert (await stub.Register(_register("d2", "decode", "127.0.0.1:7003"))).accepted

            assert cluster.check_health(now=time.time()) == []  # just registered
            marked = cluster.check_health(now=time.time() + 1.0)  # past 3 reports, short of dead_after_s
            assert sorted(marked) == ["d1", "d2"]
            assert cluster.instances["d1"].state == "unhealthy"
            assert cluster.healthy("decode") == []
            assert cluster.check_health(now=time.time() + 2.0) == []  # already marked: not again
            assert {d.load.state for d in cluster.decode_broadcast().instances} == {"unhealthy"}

            call = stub.ReportLoad()
            await call.write(pb.LoadReport(instance_id="d1", role="decode", state="active", kv_capacity_tokens=4096))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF  # a decode instance's report: no answer (policies current)
            assert (await stub.Register(_register("p1", "prefill", "127.0.0.1:7001"))).accepted
            call = stub.ReportLoad()  # a prefill instance's report: answered with the decode load, d1 revived
            await call.write(pb.LoadReport(instance_id="p1", role="prefill", state="active"))
            msg = await call.read()
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            states = {d.instance_id: d.load.state for d in msg.instances}
            assert states == {"d1": "active", "d2": "unhealthy"}
            assert cluster.instances["d1"].state == "active"
            assert [i.id for i in cluster.healthy("decode")] == ["d1"]

            # Prefill dispatchers skip the unhealthy one.
            view = DecodeView()
            view.update(decode_loads(msg))
            assert list(view.instances) == ["d1"]

            # Silent for dead_after_s: removed from the registry (and from every broadcast); told to on_removed.
            removed: list[str] = []
            cluster.on_removed = lambda inst: removed.append(inst.id)
            cluster.check_health(now=time.time() + cluster.dead_after_s + 1)
            assert removed == ["d1", "d2", "p1"] and cluster.instances == {}
            assert cluster.decode_broadcast().instances == []

    _run(scenario)


def test_control_link_feeds_prefill_decode_view() -> None:
    """ControlLink (workers/control.py) against the real ControlPlaneService: both workers register, report,
    and the prefill worker's DecodeView learns the decode instance from the broadcast."""

    async def scenario() -> None:
        async with (
            _control_plane(token=TOKEN, report_interval_s=0.02) as (cluster, _, _, daemon),
            _worker("prefill", "p1") as p1,
            _worker("decode", "d1") as d1,
        ):
            links = [ControlLink(n.service, daemon, n.address, TOKEN) for n in (p1, d1)]
            tasks = [asyncio.create_task(link.run()) for link in links]
            try:
                for link in links:
                    await asyncio.wait_for(link.registered.wait(), 5)
                assert links[0].interval == pytest.approx(0.02)
                while "d1" not in p1.service.decode_view.instances:
                    await asyncio.sleep(0.01)
                address, load = p1.service.decode_view.instances["d1"]
                assert address == d1.address
                assert load.kv_capacity_tokens == d1.engine.kv_capacity
                assert cluster.instances["p1"].role == "prefill"
                while cluster.instances["d1"].reports == 0:  # the view can list d1 before its own first report
                    await asyncio.sleep(0.01)
            finally:
                for link in links:
                    link.stop()
                await asyncio.gather(*tasks)

            bad = ControlLink(p1.service, daemon, p1.address, "wrong")
            with pytest.raises(RegistrationRefused):
                await bad.run()

    _run(scenario)


# --- WorkerService: disaggregated and colocated ---------------------------------------------------


def test_prefill_decode_handoff_matches_colocated() -> None:
    async def scenario() -> None:
        async with (
            _worker("prefill", "p1") as p1,
            _worker("decode", "d1") as d1,
            _worker("colocated", "c1") as c1,
        ):
            p1.service.decode_view.update(decode_loads(_broadcast(d1)))
            prompt = _prompt(40)
            max_tokens = 24

            chunks = await _collect(_generate(p1.stub, _gen("r1", prompt, max_tokens)))
            assert len(chunks) == 2, chunks
            first, last = chunks
            assert len(first.token_ids) == 1
            assert not first.finished
            assert not first.HasField("handoff")
            assert last.HasField("handoff")
            assert last.handoff.decode_instance_id == "d1"
            assert last.handoff.decode_address == d1.address
            assert list(last.token_ids) == []
            assert not last.finished
            assert p1.engine.usage().kv_used_tokens == 0  # the prefill KV was released after the hand-over
            assert "r1" in d1.service.jobs

            rest = await _collect(_attach(d1.stub, "r1"))
            assert rest[-1].finished
            assert rest[-1].finish_reason == "length"
            assert all(not c.finished for c in rest[:-1])
            assert all(c.request_id == "r1" for c in rest)
            disagg = list(first.token_ids) + _tokens(rest)
            assert len(disagg) == max_tokens
            assert d1.service.jobs == {}
            assert d1.engine.usage().kv_used_tokens == 0

            colo = await _collect(_generate(c1.stub, _gen("r1", prompt, max_tokens)))
            assert colo[-1].finished
            assert colo[-1].finish_reason == "length"
            assert not any(c.HasField("handoff") for c in colo)
            assert _tokens(colo) == disagg
            assert disagg == [sim_token(prompt, i, VOCAB) for i in range(max_tokens)]

    _run(scenario)


def test_worker_client_answers_in_plain_data() -> None:
    """daemon/worker_client.py, the daemon's calls to workers: plain chunks, replies and errors; leaving a
    stream early cancels the call on the worker."""

    async def scenario() -> None:
        client = WorkerClient()
        try:
            async with (
                _worker("prefill", "p1") as p1,
                _worker("decode", "d1") as d1,
                _worker("colocated", "c1", scale=1.0) as c1,  # 2,000 tokens: about 6 s of wall time
            ):
                p1.service.decode_view.update(decode_loads(_broadcast(d1)))
                prompt = _prompt(30)
                chunks = [c async for c in _generate_on(client, p1.address, "w1", prompt, 12)]
                assert [len(c.token_ids) for c in chunks] == [1, 0]
                assert chunks[-1].handoff == Handoff("d1", d1.address)
                rest = [c async for c in _attach_on(client, d1.address, "w1")]
                assert rest[-1].finished and rest[-1].finish_reason == "length"
                tokens = [t for c in chunks + rest for t in c.token_ids]
                assert tokens == [sim_token(prompt, i, VOCAB) for i in range(12)]

                info = await client.info(d1.address, timeout=5)
                assert (info.instance_id, info.role, info.load.state) == ("d1", "decode", "active")
                assert isinstance(info.load, LoadReport) and info.load.kv_capacity_tokens == d1.engine.kv_capacity
                assert not await client.cancel(d1.address, "nobody", timeout=5)
                refused = await client.flip(c1.address, "router", timeout=5)
                assert not refused.ok and "must be colocated, prefill or decode" in refused.reason
                plan = await client.set_plan(p1.address, ["a", "b"], timeout=5)
                assert not plan.ok and "prefill" in plan.reason

                stream = _generate_on(client, c1.address, "long", _prompt(10), 2000)
                first = await stream.__anext__()
                assert first.token_ids and not first.finished
                await stream.aclose()
                for _ in range(200):
                    if not c1.service.generating and c1.engine.usage().running == 0:
                        break
                    await asyncio.sleep(0.01)
                assert c1.service.generating == {} and c1.engine.usage().running == 0

            with pytest.raises(WorkerCallError) as exc:
                await client.cancel(f"127.0.0.1:{_free_port()}", "x", timeout=2)
            assert exc.value.code == "UNAVAILABLE"
        finally:
            await client.close()

    _run(scenario)


def test_calls_multiplex_on_one_serve_stream() -> None:
    """Every call the daemon makes to one worker rides that worker's one Serve stream: concurrent calls
    each get their own tokens, leaving one early stops only that one on the worker, and the stream
    breaking (the worker gone) ends every call still on it with a WorkerCallError."""

    async def scenario() -> None:
        client = WorkerClient()
        try:
            async with _worker("colocated", "c1", scale=1.0) as c1:
                prompts = {f"m{i}": _prompt(10 + i, seed=i) for i in range(8)}

                async def run(rid: str, n: int) -> list[int]:
                    stream = _generate_on(client, c1.address, rid, prompts[rid], n)
                    return [t async for c in stream for t in c.token_ids]

                left = _generate_on(client, c1.address, "left", _prompt(12), 2000)
                assert (await left.__anext__()).token_ids
                outs = await asyncio.gather(*(run(rid, 6 + i) for i, rid in enumerate(prompts)))
                for i, prompt in enumerate(prompts.values()):
                    assert outs[i] == [sim_token(prompt, j, VOCAB) for j in range(6 + i)]
                await left.aclose()
                for _ in range(200):
                    if not c1.service.generating:
                        break
                    await asyncio.sleep(0.01)
                assert c1.service.generating == {} and c1.engine.usage().running == 0
                assert len(client._serving) == 1  # one stream carried them all

                open_call = _generate_on(client, c1.address, "open", _prompt(12), 2000)
                assert (await open_call.__anext__()).token_ids
            with pytest.raises(WorkerCallError):  # the worker stopped under the open call
                async for _ in open_call:
                    pass
            with pytest.raises(WorkerCallError) as exc:  # and nothing listens there any more
                _ = [c async for c in _generate_on(client, c1.address, "after", _prompt(12), 4)]
            assert exc.value.code == "UNAVAILABLE"
        finally:
            await client.close()

    _run(scenario)


def test_concurrent_handoffs_spread_over_decode_instances() -> None:
    async def scenario() -> None:
        async with (
            _worker("prefill", "p1") as p1,
            _worker("decode", "d1") as d1,
            _worker("decode", "d2") as d2,
        ):
            p1.service.decode_view.update(decode_loads(_broadcast(d1, d2)))
            decodes = {"d1": d1, "d2": d2}

            async def one(i: int) -> tuple[str, list[int], list[int]]:
                prompt = _prompt(16 + i, seed=i)
                chunks = await _collect(_generate(p1.stub, _gen(f"q{i}", prompt, 12)))
                handoff = chunks[-1].handoff
                rest = await _collect(_attach(decodes[handoff.decode_instance_id].stub, f"q{i}"))
                assert rest[-1].finish_reason == "length"
                return handoff.decode_instance_id, _tokens(chunks) + _tokens(rest), prompt

            results = await asyncio.gather(*(one(i) for i in range(6)))
            used = [r[0] for r in results]
            assert used.count("d1") == 3
            assert used.count("d2") == 3
            for _, toks, prompt in results:
                assert toks == [sim_token(prompt, j, VOCAB) for j in range(12)]
            assert len(p1.service.serving) == 2  # the six hand-overs rode one Serve stream per decode worker

            pinned = await _collect(_generate(p1.stub, _gen("pin", _prompt(10), 4, decode_instance_id="d2")))
            assert pinned[-1].handoff.decode_instance_id == "d2"
            rest = await _collect(_attach(d2.stub, "pin"))
            assert len(_tokens(pinned) + _tokens(rest)) == 4

    _run(scenario)


def test_prefill_holds_the_kv_until_the_decode_instance_pulls_it() -> None:
    # tiny's 4,192-token cache: the decode instance takes four 1,000-token prompts; the next two stay
    # prefilled on the prefill instance, their KV held there (and reported) until the decode side pulls.
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("decode", "d1") as d1:
            p1.service.decode_view.update(decode_loads(_broadcast(d1)))
            held: list[int] = []
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    report = p1.service.load_report(0.0)
                    assert report.kv_used_tokens <= report.kv_capacity_tokens
                    held.append(report.held_kv_tokens)
                    await asyncio.sleep(0.002)

            async def one(i: int) -> list[int]:
                prompt = _prompt(1000, seed=i)
                chunks = await _collect(_generate(p1.stub, _gen(f"h{i}", prompt, 300)))
                assert chunks[-1].handoff.decode_instance_id == "d1", chunks[-1]
                rest = await _collect(_attach(d1.stub, f"h{i}"))
                assert rest[-1].finish_reason == "length"
                toks = _tokens(chunks) + _tokens(rest)
                assert toks == [sim_token(prompt, j, VOCAB) for j in range(300)]
                return toks

            watcher = asyncio.create_task(watch())
            await asyncio.gather(*(one(i) for i in range(6)))
            done.set()
            await watcher
            assert max(held) >= 1000  # at least one prefilled prompt waited, held on the prefill side
            assert p1.service.load_report(0.0).held_kv_tokens == 0
            assert p1.engine.usage().kv_used_tokens == 0 and d1.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_cancel_while_the_decode_instance_has_not_pulled_the_kv() -> None:
    # The decode instance is full: x waits there with its KV still on the prefill instance. Cancelling x on
    # the prefill worker (as the daemon does: x is still in its prefill phase) ends the hand-over there and
    # drops x on the decode side; a Cancel on the decode worker meanwhile ends a waiting Accept too.
    async def scenario() -> None:
        async with _worker("prefill", "p1", scale=0.5) as p1, _worker("decode", "d1", scale=0.5) as d1:
            p1.service.decode_view.update(decode_loads(_broadcast(d1)))
            for i in range(4):
                assert (await _accept_on(d1.stub, _accept(f"big{i}", _prompt(1000, seed=i), 300))).accepted
            call = _generate(p1.stub, _gen("x", _prompt(1000, seed=9), 50))
            assert len((await call.read()).token_ids) == 1  # the first token
            while "x" not in d1.engine.sched:
                await asyncio.sleep(0.005)
            assert d1.engine.sched.phase("x") is Phase.REMOTE
            assert p1.engine.usage().held_tokens == 1000
            assert (await p1.stub.Cancel(pb.CancelRequest(request_id="x"))).found
            last = await asyncio.wait_for(call.read(), 5)
            assert last.finished and last.finish_reason == "abort"
            while "x" in d1.engine.sched:  # the cancelled Accept dropped it there
                await asyncio.sleep(0.005)
            assert p1.engine.usage().kv_used_tokens == 0

            waiting = asyncio.ensure_future(_accept_on(d1.stub, _accept("y", _prompt(1000, seed=8), 100)))
            while "y" not in d1.engine.sched:
                await asyncio.sleep(0.005)
            assert (await d1.stub.Cancel(pb.CancelRequest(request_id="y"))).found
            reply = await asyncio.wait_for(waiting, 5)
            assert not reply.accepted and "cancelled" in reply.reason
            for i in range(4):
                await d1.stub.Cancel(pb.CancelRequest(request_id=f"big{i}"))

    _run(scenario)


def test_prefill_max_tokens_one_finishes_without_handoff() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("decode", "d1") as d1:
            p1.service.decode_view.update(decode_loads(_broadcast(d1)))
            prompt = _prompt(30)
            chunks = await _collect(_generate(p1.stub, _gen("one", prompt, 1)))
            assert len(chunks) == 1
            (only,) = chunks
            assert only.finished
            assert only.finish_reason == "length"
            assert list(only.token_ids) == [sim_token(prompt, 0, VOCAB)]
            assert not only.HasField("handoff")
            assert d1.service.jobs == {}
            assert p1.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_pinned_decode_instance_waits_for_the_next_broadcast() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("decode", "d1") as d1:
            call = _generate(p1.stub, _gen("late", _prompt(20), 5, decode_instance_id="d1"))
            first = await call.read()
            assert len(first.token_ids) == 1
            p1.service.decode_view.update(decode_loads(_broadcast(d1)))  # the view catches up with registration
            last = await call.read()
            assert last.handoff.decode_instance_id == "d1"
            assert call.done  # the hand-off chunk is the call's last
            rest = await _collect(_attach(d1.stub, "late"))
            assert len(first.token_ids) + len(_tokens(rest)) == 5

    _run(scenario)


def test_prefill_without_a_decode_instance_fails_cleanly() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("decode", "d1") as d1:
            p1.service.decode_view.update(decode_loads(_broadcast(d1, state="unhealthy")))
            assert p1.service.decode_view.instances == {}  # non-active instances are not candidates
            chunks = await _collect(_generate(p1.stub, _gen("lonely", _prompt(20), 5)))
            assert len(chunks[0].token_ids) == 1
            assert chunks[-1].finished
            assert chunks[-1].finish_reason == "error"
            assert "no healthy decode instance" in chunks[-1].error
            assert p1.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_handoff_refused_or_unreachable_is_an_error() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("colocated", "c1") as c1:
            # The view names an instance that is not a decode instance: Accept refuses.
            p1.service.decode_view.update(decode_loads(_broadcast(c1)))
            chunks = await _collect(_generate(p1.stub, _gen("refused", _prompt(20), 5)))
            assert chunks[-1].finish_reason == "error"
            assert "colocated" in chunks[-1].error
            assert p1.engine.usage().kv_used_tokens == 0

            # Nothing listens at the address.
            gone = pb.DecodeInstanceLoad(
                instance_id="gone",
                address=f"127.0.0.1:{_free_port()}",
                load=pb.LoadReport(instance_id="gone", role="decode", state="active", kv_capacity_tokens=4096),
            )
            p1.service.decode_view.update(decode_loads(pb.DecodeLoadBroadcast(instances=[gone])))
            chunks = await _collect(_generate(p1.stub, _gen("unreachable", _prompt(20), 5)))
            assert chunks[-1].finish_reason == "error"
            assert "gone" in chunks[-1].error
            assert "unreachable" in chunks[-1].error
            assert p1.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_role_checks_accept_generate_info() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("decode", "d1") as d1, _worker("colocated", "c1") as c1:
            for node in (p1, c1):
                reply = await _accept_on(node.stub, _accept("a1", _prompt(8), 4))
                assert not reply.accepted
                assert node.service.role in reply.reason
                assert node.service.jobs == {}

            # Generate on an instance that will not start it: "refused" (nothing done, the daemon tries
            # another entry instance), as when an instance began draining after the daemon chose it.
            chunks = await _collect(_generate(d1.stub, _gen("g", _prompt(8), 4)))
            assert len(chunks) == 1
            assert chunks[0].finish_reason == "refused"
            assert "decode" in chunks[0].error
            p1.service.state = "draining"
            chunks = await _collect(_generate(p1.stub, _gen("g", _prompt(8), 4)))
            assert [(c.finish_reason, "draining" in c.error) for c in chunks] == [("refused", True)]
            p1.service.state = "active"

            assert (await _accept_on(d1.stub, _accept("dup", _prompt(8), 4))).accepted
            again = await _accept_on(d1.stub, _accept("dup", _prompt(8), 4))
            assert not again.accepted
            assert "already" in again.reason

            d1.service.state = "draining"
            draining = await _accept_on(d1.stub, _accept("late", _prompt(8), 4))
            assert not draining.accepted
            assert "draining" in draining.reason
            d1.service.state = "active"

            for node in (p1, d1, c1):
                info = await node.stub.Info(pb.InfoRequest())
                assert (info.instance_id, info.role) == (node.id, node.service.role)
                assert info.model == PROFILE.model.name
                assert info.max_model_len == MAX_LEN
                assert info.load.kv_capacity_tokens == node.engine.kv_capacity
                assert info.load.state == "active"

    _run(scenario)


def test_attach_unknown_request_is_an_error() -> None:
    async def scenario() -> None:
        async with _worker("decode", "d1") as d1:
            chunks = await _collect(_attach(d1.stub, "nobody"))
            assert len(chunks) == 1
            assert chunks[0].finished
            assert chunks[0].finish_reason == "error"
            assert "nobody" in chunks[0].error

    _run(scenario)


def test_decode_attach_replays_buffered_tokens() -> None:
    """Tokens decoded before Attach are buffered and come in the first chunk(s)."""

    async def scenario() -> None:
        async with _worker("decode", "d1") as d1:
            prompt = _prompt(12)
            handed = _accept("buf", prompt, 20, first_token=sim_token(prompt, 0, VOCAB))
            assert (await _accept_on(d1.stub, handed)).accepted
            while d1.service.jobs["buf"].task is not None and not d1.service.jobs["buf"].task.done():
                await asyncio.sleep(0.005)
            chunks = await _collect(_attach(d1.stub, "buf"))
            assert _tokens(chunks) == [sim_token(prompt, i, VOCAB) for i in range(1, 20)]
            assert chunks[-1].finish_reason == "length"

    _run(scenario)


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel_inflight_colocated_generate_ends_the_stream() -> None:
    async def scenario() -> None:
        async with _worker("colocated", "c1") as c1:
            max_tokens = 2000
            call = _generate(c1.stub, _gen("long", _prompt(10), max_tokens))
            first = await call.read()
            assert first.token_ids
            await c1.stub.Cancel(pb.CancelRequest(request_id="long"))
            chunks = [first]
            while not call.done:
                chunks.append(await call.read())
            assert chunks[-1].finished
            assert chunks[-1].finish_reason in ("abort", "stop")
            assert len(_tokens(chunks)) < max_tokens
            assert c1.engine.usage().kv_used_tokens == 0
            assert c1.engine.usage().running == 0

    _run(scenario)


def test_cancelled_colocated_generate_reports_abort() -> None:
    async def scenario() -> None:
        async with _worker("colocated", "c1") as c1:
            call = _generate(c1.stub, _gen("long", _prompt(10), 2000))
            await call.read()
            await c1.stub.Cancel(pb.CancelRequest(request_id="long"))
            last = await call.read()
            while not call.done:
                last = await call.read()
            assert last.finish_reason == "abort"

    _run(scenario)


def test_cancel_decode_jobs_found_and_not_found() -> None:
    async def scenario() -> None:
        async with _worker("decode", "d1") as d1:
            assert not (await d1.stub.Cancel(pb.CancelRequest(request_id="unknown"))).found

            # Accepted, never attached.
            assert (await _accept_on(d1.stub, _accept("idle", _prompt(16), 500))).accepted
            assert (await d1.stub.Cancel(pb.CancelRequest(request_id="idle"))).found
            assert not (await d1.stub.Cancel(pb.CancelRequest(request_id="idle"))).found
            late = await _collect(_attach(d1.stub, "idle"))
            assert late[-1].finish_reason == "error"

            # Attached and decoding: the Attach stream ends with "abort".
            max_tokens = 1500
            assert (await _accept_on(d1.stub, _accept("busy", _prompt(16, seed=2), max_tokens))).accepted
            call = _attach(d1.stub, "busy")
            chunks = [await call.read()]
            assert chunks[0].token_ids
            assert (await d1.stub.Cancel(pb.CancelRequest(request_id="busy"))).found
            while not call.done:
                chunks.append(await call.read())
            assert chunks[-1].finished
            assert chunks[-1].finish_reason == "abort"
            assert len(_tokens(chunks)) < max_tokens - 1
            assert d1.service.jobs == {}
            for _ in range(100):  # the engine drops the sequence when the cancelled task unwinds
                if d1.engine.usage().kv_used_tokens == 0:
                    break
                await asyncio.sleep(0.005)
            assert d1.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_cancel_during_kv_load_ends_the_attached_stream() -> None:
    async def scenario() -> None:
        # A slow clock so the KV transfer (~33 ms of model time) takes ~0.65 s of wall time.
        async with _worker("decode", "d1", scale=0.05) as d1:
            prompt = _prompt(2000)
            assert (await _accept_on(d1.stub, _accept("loading", prompt, 8))).accepted
            call = _attach(d1.stub, "loading")
            await asyncio.sleep(0.1)  # Attach is waiting on the job's queue; load_kv is still running
            assert (await d1.stub.Cancel(pb.CancelRequest(request_id="loading"))).found
            try:
                chunk = await asyncio.wait_for(call.read(), timeout=1.0)
            finally:
                call.cancel()
            assert chunk.finished
            assert chunk.finish_reason in ("abort", "error")

    _run(scenario)


# --- request errors -----------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len_is_an_error() -> None:
    async def scenario() -> None:
        async with _worker("prefill", "p1") as p1, _worker("colocated", "c1") as c1, _worker("decode", "d1") as d1:
            too_long = _prompt(MAX_LEN + 1)
            for node in (p1, c1):
                chunks = await _collect(_generate(node.stub, _gen("big", too_long, 4)))
                assert len(chunks) == 1
                (chunk,) = chunks
                assert chunk.finished
                assert chunk.finish_reason == "error"
                assert "max_model_len" in chunk.error
                assert "\n" not in chunk.error
                assert list(chunk.token_ids) == []

            # Prompt fits, prompt + max_tokens does not.
            chunks = await _collect(_generate(c1.stub, _gen("edge", _prompt(MAX_LEN - 2), 3)))
            assert chunks[-1].finish_reason == "error"
            assert "max_model_len" in chunks[-1].error

            # The decode side refuses the hand-over, saying why (the prefill side would try another).
            reply = await _accept_on(d1.stub, _accept("big", too_long, 4))
            assert not reply.accepted
            assert "max_model_len" in reply.reason and "\n" not in reply.reason
            chunks = await _collect(_attach(d1.stub, "big"))
            assert chunks[-1].finish_reason == "error"  # nothing to attach to

            for node in (p1, c1, d1):
                assert node.engine.usage().kv_used_tokens == 0

    _run(scenario)


def test_empty_prompt_and_zero_max_tokens_are_errors() -> None:
    async def scenario() -> None:
        async with _worker("colocated", "c1") as c1:
            empty = await _collect(_generate(c1.stub, _gen("e", [], 4)))
            assert empty[-1].finish_reason == "error"
            assert "empty prompt" in empty[-1].error
            zero = await _collect(_generate(c1.stub, _gen("z", _prompt(4), 0)))
            assert zero[-1].finish_reason == "error"
            assert "max_tokens" in zero[-1].error

    _run(scenario)


def test_every_worker_rpc_needs_the_cluster_token() -> None:
    """A worker started with a token refuses every RPC without it (or with another), however it is
    called: no Generate, no Attach of another request's stream, no Accept, no Cancel, Flip, SetPlan or Info.
    The cluster's own calls (Peers with the token) go through: a prefill instance hands over to a decode
    instance with them."""

    async def scenario() -> None:
        async with (
            _worker("prefill", "p1", token=TOKEN) as p1,
            _worker("decode", "d1", token=TOKEN) as d1,
        ):
            gen = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=4)
            calls = {
                "Serve generate": lambda stub, md: _Call(stub, md, generate=gen).read(),
                "Serve attach": lambda stub, md: _Call(stub, md, attach=pb.AttachRequest(request_id="r")).read(),
                "Cancel": lambda stub, md: stub.Cancel(pb.CancelRequest(request_id="r"), metadata=md),
                "Flip": lambda stub, md: stub.Flip(pb.FlipRequest(to_role="decode"), metadata=md),
                "SetPlan": lambda stub, md: stub.SetPlan(pb.PlanRequest(clear=True), metadata=md),
                "Serve accept": lambda stub, md: _Call(stub, md, accept=pb.AcceptRequest(request=gen)).reply(),
                "Info": lambda stub, md: stub.Info(pb.InfoRequest(), metadata=md),
            }
            for node in (p1, d1):
                for name, call in calls.items():
                    for md in ((), auth_metadata("wrong"), (("authorization", TOKEN),)):
                        with pytest.raises(grpc.aio.AioRpcError) as exc:
                            await call(node.stub, md)
                        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert p1.service.role == "prefill" and p1.service.state == "active"  # the Flip did nothing

            peers = Peers(TOKEN)
            try:
                info = await peers.worker(d1.address).Info(pb.InfoRequest(), metadata=peers.metadata)
                assert info.instance_id == "d1"
                p1.service.decode_view.update(
                    [(d1.address, "active", DecodeLoad("d1", 0, d1.engine.kv_capacity, 0, 0, 0))]
                )
                chunks = await _collect(_Call(peers.worker(p1.address), peers.metadata, generate=gen))
                assert chunks[-1].handoff.decode_instance_id == "d1"
                attach = _Call(peers.worker(d1.address), peers.metadata, attach=pb.AttachRequest(request_id="r"))
                rest = await _collect(attach)
                assert sum(len(c.token_ids) for c in chunks + rest) == 4 and rest[-1].finished
            finally:
                await peers.close()

    _run(scenario)


# --- the daemon's Run: a request as one object, fed by the Serve stream's reader ---------------------------


class _Collected:
    """A request's output (daemon.front.run.Output), gathered; `fail_at`: the call to `tokens` that raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.ids: list[int] = []
        self.calls = 0
        self.fail_at = fail_at

    def tokens(self, ids: list[int], text: str) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("broken output")
        self.ids += ids


def test_a_fault_in_one_requests_output_ends_that_request_alone(tmp_path: Path) -> None:
    """Every request's tokens are handed over by the one Serve stream's reader: a request whose output
    raises there fails (its row says why, its worker call is left), while the requests beside it on the
    same stream get all their tokens, in order."""

    async def scenario() -> None:
        store = Store.open(f"sqlite:///{tmp_path / 'tetri.db'}")
        writer = BatchWriter(store, flush_interval_s=0.02)
        await writer.start()
        async with (
            _control_plane(token=TOKEN, report_interval_s=0.02) as (cluster, _, _, daemon),
            _worker("colocated", "c1", scale=200.0) as c1,
        ):
            link = ControlLink(c1.service, daemon, c1.address, TOKEN)
            task = asyncio.create_task(link.run())
            workers = WorkerClient(TOKEN)
            gw = Gateway(cluster, writer, Metrics(lambda: ([], {})), workers=workers)
            try:
                await asyncio.wait_for(link.registered.wait(), 5)
                while Router(cluster).pick(c1.engine.model_name) is None:
                    await asyncio.sleep(0.01)
                outs = {f"ok{i}": _Collected() for i in range(3)} | {"bad": _Collected(fail_at=3)}
                prompts = {rid: _prompt(12, seed=i) for i, rid in enumerate(outs)}
                ends = await asyncio.gather(
                    *(gw.serve(rid, c1.engine.model_name, prompts[rid], 20, out) for rid, out in outs.items())
                )
                for (rid, out), end in zip(outs.items(), ends, strict=True):
                    if rid == "bad":
                        assert isinstance(end, Failed) and "broken output" in end.message
                    else:
                        assert end == Finished("length", 20, cached_tokens=0)  # a 12-token prompt: no full block
                        assert out.ids == [sim_token(prompts[rid], j, VOCAB) for j in range(20)]
                while c1.service.generating:  # the failed request's call was left: the worker stopped it
                    await asyncio.sleep(0.01)
                await writer.flush()
                assert store.get_request("bad")["status"] == "failed"  # type: ignore[index]
                assert {store.get_request(r)["status"] for r in outs if r != "bad"} == {"finished"}  # type: ignore[index]
            finally:
                link.stop()
                await task
                await workers.close()
        await writer.stop()
        store.close()

    _run(scenario)
