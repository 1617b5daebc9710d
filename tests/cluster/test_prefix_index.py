"""The control plane's prefix-cache index, live (in-process gRPC, real sim engines and ControlLinks): the
workers report what their engines cache, the controller's index follows, routing reads it, the fronts get
it relayed; bad, duplicated or out-of-order events, a flood and a restarted worker leave it bounded and
the daemon serving, routing then falling back to load; a restarted worker or controller relearns it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc

from daemon.cluster import Cluster
from daemon.controller.edge import ControlPlaneService
from daemon.controller.registry import Registry
from daemon.front.route import Router
from daemon.wire import view_from_pb
from daemon.worker_client import WorkerClient
from tetri.proto import pb, rpc
from tetri.proto.security import make_server
from tetri.scheduling.cacheindex import MAX_BATCH
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefix import block_keys
from workers.control import ControlLink

from .test_grpc_inprocess import PROFILE, _control_plane, _free_port, _generate_on, _register, _run, _worker

B = PROFILE.block_size
MODEL = "tetri/tiny-sim"


def _system(n: int = 96) -> list[int]:
    return [(3 * i + 11) % 200 + 1 for i in range(n)]


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_workers_report_their_caches_and_cache_aware_routing_follows_them() -> None:
    async def scenario() -> None:
        client = WorkerClient()
        async with (
            _control_plane(report_interval_s=0.02) as (cluster, _, _, daemon),
            _worker("colocated", "a") as a,
            _worker("colocated", "b") as b,
        ):
            links = [ControlLink(n.service, daemon, n.address, None) for n in (a, b)]
            tasks = [asyncio.create_task(link.run()) for link in links]
            try:
                await _until(lambda: {"a", "b"} <= set(cluster.instances))
                assert cluster.instances["a"].block_size == B
                first = [*_system(), 7, 8, 9]
                chunks = [c async for c in _generate_on(client, a.address, "t1", first, 4)]
                assert chunks[-1].cached_tokens == 0  # nothing cached yet
                # the worker's next report carries the cache events; the index has a's blocks
                await _until(lambda: cluster.cache.blocks("a") >= len(first) // B)
                assert set(block_keys(first, B)) <= set(cluster.cache.keys("a"))
                assert cluster.cache.blocks("b") == 0
                turn2 = first + [5] * 40  # the same conversation, a turn on
                assert Router(cluster).pick(MODEL, prompt=turn2).id == "a"
                chunks = [c async for c in _generate_on(client, a.address, "t2", turn2, 4)]
                assert chunks[-1].cached_tokens == (len(first) // B) * B
                await _until(lambda: cluster.instances["a"].load.prefix_hit_tokens > 0)
                load = cluster.instances["a"].load
                assert (load.prefix_query_tokens, load.prefix_hit_tokens) == (
                    len(first) + len(turn2),
                    chunks[-1].cached_tokens,
                )
                # a busier than b: within the saturation guard it keeps the conversation, past it b takes it
                cluster.routed(cluster.instances["a"], +3)
                assert Router(cluster).pick(MODEL, prompt=turn2).id == "a"
                cluster.routed(cluster.instances["a"], +2)  # 5 more than b: past cache_slack 4
                assert Router(cluster).pick(MODEL, prompt=turn2).id == "b"
                cluster.routed(cluster.instances["a"], -5)
                cluster.set_policies(PolicySet(routing="least-load"))
                cluster.routed(cluster.instances["a"], +1)
                assert Router(cluster).pick(MODEL, prompt=turn2).id == "b"  # blind to the cache
                cluster.set_policies(PolicySet(routing="round-robin"))
                assert [Router(cluster).pick(MODEL, prompt=turn2).id for _ in range(4)] == ["a", "b", "a", "b"]
            finally:
                for link in links:
                    link.stop()
                await asyncio.gather(*tasks)
                await client.close()

    _run(scenario)


@asynccontextmanager
async def _linked(worker: Any, daemon: str) -> AsyncIterator[None]:
    """The worker's control link to the daemon running (registration, load reports) while inside."""
    link = ControlLink(worker.service, daemon, worker.address, None)
    task = asyncio.create_task(link.run())
    try:
        yield
    finally:
        link.stop()
        await task


def _report(iid: str, batch: pb.CacheEvents | None = None) -> pb.LoadReport:
    report = pb.LoadReport(instance_id=iid, role="colocated", state="active", kv_capacity_tokens=4096)
    if batch is not None:
        report.cache.CopyFrom(batch)
    return report


def test_bad_duplicated_out_of_order_and_flooding_events_leave_the_index_bounded_and_routing_on_load() -> None:
    async def scenario() -> None:
        client = WorkerClient()
        async with (
            _control_plane(report_interval_s=0.02) as (cluster, _, stub, daemon),
            _worker("colocated", "good") as good,
        ):
            link = ControlLink(good.service, daemon, good.address, None)
            task = asyncio.create_task(link.run())
            try:
                bad = _register("bad", "colocated", kv=4096)
                bad.block_size = B
                assert (await stub.Register(bad)).accepted
                await _until(lambda: "good" in cluster.instances)
                prompt = _system(160)
                keys = block_keys(prompt, B)
                stream = stub.ReportLoad()
                sent = [
                    pb.CacheEvents(epoch=7, seq=0, reset=True, stored=keys[:4], block_size=B),
                    pb.CacheEvents(epoch=7, seq=0, reset=True, stored=keys, block_size=B),  # a duplicate
                    pb.CacheEvents(epoch=6, seq=9, stored=keys, block_size=B),  # a stale stream's
                    pb.CacheEvents(epoch=7, seq=1, removed=[keys[3]], block_size=B),
                    pb.CacheEvents(epoch=7, seq=3, stored=keys[:2], block_size=B),  # batch 2 lost: emptied
                ]
                for batch in sent:
                    await stream.write(_report("bad", batch))
                # the gap is the last batch (the good worker's batches count in stats.batches too)
                await _until(lambda: cluster.cache.stats.gaps == 1)
                assert cluster.cache.keys("bad") == keys[:2]
                assert (cluster.cache.stats.ignored, cluster.cache.stats.gaps) == (2, 1)
                # a flood: more keys than a batch may carry; the entry is emptied, the stream keeps going
                flood = pb.CacheEvents(epoch=7, seq=4, stored=list(range(1, MAX_BATCH + 2)), block_size=B)
                await stream.write(_report("bad", flood))
                await _until(lambda: cluster.cache.stats.floods == 1)
                assert cluster.cache.blocks("bad") == 0
                # past its bound (twice its capacity in blocks) the oldest keys go
                many = pb.CacheEvents(epoch=7, seq=5, stored=list(range(1, 2 * 4096 // B + 101)), block_size=B)
                await stream.write(_report("bad", many))
                await _until(lambda: cluster.cache.stats.evicted >= 100)
                assert cluster.cache.blocks("bad") == 2 * 4096 // B
                # the daemon still serves, and routes by load: the least-loaded instance holds no prefix
                cluster.routed(cluster.instances["bad"], +1)
                assert Router(cluster).pick(MODEL, prompt=prompt).id == "good"
                chunks = [c async for c in _generate_on(client, good.address, "ok", prompt, 3)]
                assert chunks[-1].finished and chunks[-1].finish_reason == "length"
                await stream.done_writing()
                assert await stream.read() is grpc.aio.EOF
            finally:
                link.stop()
                await task
                await client.close()

    _run(scenario)


def test_a_restarted_worker_is_relearned_from_its_next_report() -> None:
    async def scenario() -> None:
        client = WorkerClient()
        async with _control_plane(report_interval_s=0.02) as (cluster, _, _, daemon):
            prompt = _system(128)
            async with _worker("colocated", "w") as w, _linked(w, daemon):
                await _until(lambda: "w" in cluster.instances)
                _ = [c async for c in _generate_on(client, w.address, "r1", prompt, 2)]
                await _until(lambda: cluster.cache.blocks("w") == len(prompt) // B)
            await asyncio.sleep(0.1)  # silent past the health limit: its id is free for another address
            # the same id: a new process, an empty cache
            async with _worker("colocated", "w") as again, _linked(again, daemon):
                await _until(lambda: cluster.instances["w"].address == again.address)
                await _until(lambda: cluster.instances["w"].reports > 0)
                assert cluster.cache.blocks("w") == 0  # it holds nothing: the index says so
                assert Router(cluster).pick(MODEL, prompt=prompt).id == "w"  # by load (the only one)
                _ = [c async for c in _generate_on(client, again.address, "r2", prompt, 2)]
                await _until(lambda: cluster.cache.blocks("w") == len(prompt) // B)
        await client.close()

    _run(scenario)


def test_a_front_follows_the_controllers_index_and_takes_a_snapshot_when_it_reconnects() -> None:
    async def scenario() -> None:
        client = WorkerClient()
        async with (
            _control_plane(report_interval_s=0.02) as (cluster, _, stub, daemon),
            _worker("colocated", "a") as a,
            _linked(a, daemon),
        ):
            front = Cluster(report_interval_s=0.02, unhealthy_after=3)

            async def follow(until: Callable[[int], bool]) -> None:
                """A front's Watch stream (a new one: a snapshot first), followed until `until(messages)`."""
                watch = stub.Watch(pb.WatchRequest(front_id="f1"))
                try:
                    n = 0
                    while not until(n):
                        front.follow(view_from_pb(await watch.read()))
                        n += 1
                finally:
                    watch.cancel()

            try:
                await _until(lambda: "a" in cluster.instances)
                await follow(lambda n: n == 2)  # the view, then the index's snapshot
                prompt = _system(64)
                _ = [c async for c in _generate_on(client, a.address, "x", prompt, 2)]
                await _until(lambda: cluster.cache.blocks("a") == len(prompt) // B)
                await follow(lambda _: front.cache.keys("a") == cluster.cache.keys("a"))  # it reconnects
                assert Router(front).pick(MODEL, prompt=[*prompt, 1]).id == "a"
                assert front.cache.match(prompt, ["a"]) == {"a": len(prompt) // B}
            finally:
                await client.close()

    _run(scenario)


def test_a_restarted_controller_relearns_every_workers_cache() -> None:
    """The controller's index lives in its memory: after a restart (a new one on the same port) each worker
    registers again and its first report on the new stream carries its engine's whole cache."""

    async def scenario() -> None:
        client = WorkerClient()
        port = _free_port()
        prompt = _system(128)
        async with _worker("colocated", "w") as w:
            for attempt in range(2):
                cluster = Registry(report_interval_s=0.02, unhealthy_after=3)
                service = ControlPlaneService(cluster, lambda _: None)
                server, _ = make_server(f"127.0.0.1:{port}", None)
                rpc.add_ControlPlaneServicer_to_server(service, server)
                await server.start()
                link = ControlLink(w.service, f"127.0.0.1:{port}", w.address, None)
                task = asyncio.create_task(link.run())
                try:
                    await _until(lambda c=cluster: "w" in c.instances and c.instances["w"].reports > 0)
                    if attempt == 0:
                        _ = [c async for c in _generate_on(client, w.address, "r1", prompt, 2)]
                    await _until(lambda c=cluster: c.cache.blocks("w") == len(prompt) // B)
                    assert Router(cluster).pick(MODEL, prompt=prompt).id == "w"
                finally:
                    link.stop()
                    await server.stop(grace=None)
                    await task
        await client.close()

    _run(scenario)
