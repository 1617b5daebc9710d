"""The daemon's gRPC edge, control-plane side: the ControlPlane service workers call (registration, load
reports answered by the decode-load broadcast) and the conversions between its protobuf messages and the
cluster's plain data (`daemon.cluster`). Protobuf goes no further into the daemon than this module and
`daemon.worker_client` (the calls the daemon makes to workers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

import grpc

from tetri.proto import pb, rpc

from .cluster import Cluster, DecodeBroadcast, Instance, LoadReport, Registration

_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadReport))


def load_from_pb(msg: pb.LoadReport) -> LoadReport:
    return LoadReport(**{name: getattr(msg, name) for name in _LOAD_FIELDS})


def load_to_pb(load: LoadReport) -> pb.LoadReport:
    return pb.LoadReport(**dataclasses.asdict(load))


def registration_from_pb(msg: pb.RegisterRequest) -> Registration:
    return Registration(msg.instance_id, msg.role, msg.address, msg.model, msg.max_model_len, msg.kv_capacity_tokens)


def broadcast_to_pb(b: DecodeBroadcast) -> pb.DecodeLoadBroadcast:
    return pb.DecodeLoadBroadcast(
        instances=[
            pb.DecodeInstanceLoad(instance_id=d.instance_id, address=d.address, load=load_to_pb(d.load))
            for d in b.instances
        ],
        timestamp=b.timestamp,
        policies_json=b.policies_json,
        policy_version=b.policy_version,
    )


class ControlPlaneService(rpc.ControlPlaneServicer):
    """Registration and load reporting. Off loopback the daemon has a token; a worker presenting another
    (or none) is refused with UNAUTHENTICATED."""

    def __init__(self, cluster: Cluster, token: str | None, on_register: Callable[[Instance], None]) -> None:
        self.cluster = cluster
        self.token = token
        self.on_register = on_register

    def _authorised(self, context: grpc.aio.ServicerContext) -> bool:
        if not self.token:
            return True
        md = dict(context.invocation_metadata() or ())
        return md.get("authorization") == f"Bearer {self.token}"

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterReply:
        if not self._authorised(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "registration refused: bad or missing token")
        reg = registration_from_pb(request)
        refusal = reg.refusal()
        if refusal is not None:
            return pb.RegisterReply(accepted=False, reason=refusal)
        inst = self.cluster.register(reg)
        self.on_register(inst)
        return pb.RegisterReply(accepted=True, report_interval_s=self.cluster.report_interval_s)

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.LoadReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeLoadBroadcast]:
        if not self._authorised(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing token")
        async for report in request_iterator:
            self.cluster.report(load_from_pb(report))
            yield broadcast_to_pb(self.cluster.decode_broadcast())


async def start_control_plane(
    cluster: Cluster, host: str, port: int, token: str | None, on_register: Callable[[Instance], None]
) -> tuple[grpc.aio.Server, int]:
    """Serve the ControlPlane service on host:port (0: any free port); returns the server and its port."""
    server = grpc.aio.server()
    rpc.add_ControlPlaneServicer_to_server(ControlPlaneService(cluster, token, on_register), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
