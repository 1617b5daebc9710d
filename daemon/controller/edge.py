"""The controller's gRPC edge: the ControlPlane service workers call (registration, load reports answered
by the decode-load broadcast) and fronts follow (`Watch`: the registry's view and the prefix-cache index's
changes). The messages' conversions are `daemon.wire`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from tetri.proto import pb, rpc
from tetri.proto.security import NO_TLS, PortInUse, Tls, make_server

from ..cluster import DecodeBroadcast, Instance, Registration
from ..wire import broadcast_to_pb, cache_from_pb, cache_view_pb, load_from_pb, registration_from_pb, view_to_pb
from .registry import Registry

__all__ = ["ControlPlaneServer", "PortInUse", "Tls", "bind_control_plane", "start_control_plane"]


class ControlPlaneService(rpc.ControlPlaneServicer):
    """Registration, load reporting, and the fronts' view. Every call carries the cluster token (checked by
    the server's interceptor, `tetri.proto.security`); a registration for an id a live worker holds is
    refused."""

    def __init__(
        self,
        cluster: Registry,
        on_register: Callable[[Instance], None],
        prepare: Callable[[Registration], Awaitable[str | None]] | None = None,
        on_report: Callable[[float], None] | None = None,
        on_front: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.on_register = on_register
        self.prepare = prepare  # e.g. load the model's tokenizer; returns why it cannot (refused)
        self.on_report = on_report  # seconds taken by one report and its broadcast (tetri_report_seconds)
        self.on_front = on_front  # a front's view stream began (True) or ended (False)
        self.admin_url = ""  # the controller's HTTP API, told to fronts in their view
        self._view_pb: tuple[int, pb.ClusterView] | None = None
        self._converted: dict[int, tuple[DecodeBroadcast, pb.DecodeLoadBroadcast]] = {}

    def _view(self, changes: int) -> pb.ClusterView:
        """The view as of `changes`, converted once for every front that asks."""
        if self._view_pb is None or self._view_pb[0] != changes:
            view = dataclasses.replace(self.cluster.view(), admin_url=self.admin_url)
            self._view_pb = (changes, view_to_pb(view))
        return self._view_pb[1]

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ClusterView]:
        front = request.front_id
        if self.on_front is not None:
            self.on_front(front, True)
        try:
            sent = -1
            cursor: int | None = None  # the last index change relayed here (None: none, a snapshot first)
            while True:
                if self.cluster.changes != sent:
                    sent = self.cluster.changes
                    yield self._view(sent)
                index = self.cluster.cache
                if cursor != index.cursor:  # the prefix-cache index changed: what this front has not seen
                    changes = None if cursor is None else index.since(cursor)
                    snapshot = changes is None  # new here, or fallen behind the log: the whole index
                    cursor = index.cursor
                    yield cache_view_pb(index.snapshot() if changes is None else changes, snapshot)
                await asyncio.sleep(self.cluster.report_interval_s / 2)
        finally:
            if self.on_front is not None:
                self.on_front(front, False)

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterReply:
        reg = registration_from_pb(request)
        refusal = self.cluster.refusal(reg)
        if refusal is None and self.prepare is not None:
            refusal = await self.prepare(reg)
        if refusal is not None:
            return pb.RegisterReply(accepted=False, reason=refusal)
        inst = self.cluster.register(reg)
        self.on_register(inst)
        return pb.RegisterReply(accepted=True, report_interval_s=self.cluster.report_interval_s)

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.LoadReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeLoadBroadcast]:
        sent = None  # the last answer on this stream: the worker keeps it until a newer one comes
        async for report in request_iterator:
            started = time.perf_counter()
            cache = cache_from_pb(report.cache) if report.HasField("cache") else None
            if not self.cluster.report(load_from_pb(report), cache):
                # removed as dead (or never registered): the worker's link registers again
                await context.abort(grpc.StatusCode.NOT_FOUND, f"instance {report.instance_id!r} is not registered")
            b = self.cluster.answer(report.role, report.policy_version)
            reply = None
            if b is not None:
                hit = self._converted.get(id(b))
                if hit is None or hit[0] is not b:  # converted once per broadcast built, not once per answer
                    if len(self._converted) >= 4:  # only the current full and empty ones are asked for
                        self._converted.clear()
                    hit = self._converted[id(b)] = (b, broadcast_to_pb(b))
                reply = None if hit[1] is sent else hit[1]
            if self.on_report is not None:
                self.on_report(time.perf_counter() - started)
            if reply is not None:
                sent = reply
                yield reply


@dataclass
class ControlPlaneServer:
    """The ControlPlane's gRPC server, bound to `port`, started by `start_control_plane`."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)


def bind_control_plane(host: str, port: int, token: str | None, tls: Tls = NO_TLS) -> ControlPlaneServer:
    """Bind the ControlPlane's port (0: any free port) before anything else starts. Every call must carry
    `token`. Raises `PortInUse` when the port is taken."""
    return ControlPlaneServer(*make_server(f"{host}:{port}", token, tls))


async def start_control_plane(
    bound: ControlPlaneServer,
    cluster: Registry,
    on_register: Callable[[Instance], None],
    prepare: Callable[[Registration], Awaitable[str | None]] | None = None,
    on_report: Callable[[float], None] | None = None,
    on_front: Callable[[str, bool], None] | None = None,
) -> ControlPlaneService:
    """Serve the ControlPlane service on a bound server."""
    service = ControlPlaneService(cluster, on_register, prepare, on_report, on_front)
    rpc.add_ControlPlaneServicer_to_server(service, bound.server)
    await bound.server.start()
    return service
