"""The cluster monitor (TetriInfer §3.2): instance registry, load reports, health, decode-load
broadcast; served to workers as the ControlPlane gRPC service.

Workers stream a LoadReport every report interval; each report is answered with the current decode
load (what prefill dispatchers choose from). An instance that misses `unhealthy_after` intervals is
marked unhealthy and gets no new work until it reports again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from tetri.proto import pb, rpc
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.routing import InstanceLoad

from .db.writer import BatchWriter

log = logging.getLogger(__name__)


@dataclass
class Instance:
    id: str
    role: str
    address: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    state: str = "active"  # active | draining | flipping | unhealthy
    last_report: float = 0.0  # wall clock (time.time) of the last report
    load: pb.LoadReport = field(default_factory=pb.LoadReport)
    inflight: int = 0  # requests routed here by the daemon and not finished
    reports: int = 0
    flip_pending: bool = False  # the daemon started a flip: stay out of routing whatever reports say

    def snapshot(self) -> InstanceLoad:
        return InstanceLoad(
            self.id,
            self.load.queued,
            self.load.running,
            self.load.kv_used_tokens,
            self.load.kv_capacity_tokens or self.kv_capacity_tokens,
            self.inflight,
        )

    @property
    def kv_usage(self) -> float:
        cap = self.load.kv_capacity_tokens or self.kv_capacity_tokens
        return self.load.kv_used_tokens / cap if cap else 0.0

    def to_dict(self) -> dict[str, object]:
        ld = self.load
        cap = ld.kv_capacity_tokens or self.kv_capacity_tokens
        return {
            "id": self.id,
            "role": self.role,
            "state": self.state,
            "address": self.address,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "queued": ld.queued,
            "running": ld.running,
            "inflight": self.inflight,
            "kv_used_tokens": ld.kv_used_tokens,
            "kv_capacity_tokens": cap,
            "kv_usage": ld.kv_used_tokens / cap if cap else 0.0,
            "tokens_per_s": ld.tokens_per_s,
            "preemptions": ld.preemptions,
            "policy_version": ld.policy_version,
            "last_report_age_s": max(0.0, time.time() - self.last_report),
        }


class Cluster:
    def __init__(
        self,
        report_interval_s: float,
        unhealthy_after: int,
        writer: BatchWriter | None = None,
        sample_every: int = 10,
    ) -> None:
        self.instances: dict[str, Instance] = {}
        self.report_interval_s = report_interval_s
        self.unhealthy_after = unhealthy_after
        self.writer = writer
        self.sample_every = sample_every
        self.policies = PolicySet()
        self.policy_version = 0

    # --- registry ---------------------------------------------------------------------------------
    def register(self, req: pb.RegisterRequest) -> Instance:
        inst = Instance(
            req.instance_id,
            req.role,
            req.address,
            req.model,
            req.max_model_len,
            req.kv_capacity_tokens,
            last_report=time.time(),
        )
        old = self.instances.get(req.instance_id)
        if old is not None:
            inst.inflight = old.inflight
        self.instances[inst.id] = inst
        return inst

    def report(self, msg: pb.LoadReport) -> None:
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            return
        inst.load = msg
        inst.last_report = time.time()
        inst.reports += 1
        if inst.state == "unhealthy":
            log.warning("instance %s is reporting again", inst.id)
        if not inst.flip_pending:
            inst.state = msg.state or "active"  # the worker's own word: active, draining or flipping
            inst.role = msg.role or inst.role
        if self.writer is not None and inst.reports % self.sample_every == 1:
            self.writer.submit_load_samples(
                [
                    {
                        "instance_id": inst.id,
                        "ts": inst.last_report,
                        "queued": msg.queued,
                        "running": msg.running,
                        "kv_used_tokens": msg.kv_used_tokens,
                        "kv_capacity_tokens": msg.kv_capacity_tokens,
                        "tokens_per_s": msg.tokens_per_s,
                    }
                ]
            )

    def check_health(self, now: float | None = None) -> list[str]:
        """Mark instances that missed `unhealthy_after` reports; returns the ids newly marked."""
        now = time.time() if now is None else now
        limit = self.unhealthy_after * self.report_interval_s
        marked = []
        for inst in self.instances.values():
            if inst.state != "unhealthy" and now - inst.last_report > limit:
                inst.state = "unhealthy"
                marked.append(inst.id)
                log.warning("instance %s missed %d reports: unhealthy", inst.id, self.unhealthy_after)
        return marked

    def healthy(self, *roles: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role in roles and i.state == "active"]

    def decode_broadcast(self) -> pb.DecodeLoadBroadcast:
        return pb.DecodeLoadBroadcast(
            instances=[
                pb.DecodeInstanceLoad(instance_id=i.id, address=i.address, load=self._broadcast_load(i))
                for i in self.instances.values()
                if i.role == "decode"
            ],
            timestamp=time.time(),
            policies_json=json.dumps(self.policies.to_dict()),
            policy_version=self.policy_version,
        )

    def set_policies(self, policies: PolicySet) -> None:
        self.policies = policies
        self.policy_version += 1

    @staticmethod
    def _broadcast_load(i: Instance) -> pb.LoadReport:
        ld = pb.LoadReport()
        ld.CopyFrom(i.load)
        ld.state = i.state
        if not ld.kv_capacity_tokens:
            ld.kv_capacity_tokens = i.kv_capacity_tokens
        return ld

    async def monitor(self) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            self.check_health()


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
        if request.role not in ("prefill", "decode", "colocated"):
            return pb.RegisterReply(accepted=False, reason=f"unknown role {request.role!r}")
        if not request.instance_id or not request.address:
            return pb.RegisterReply(accepted=False, reason="instance_id and address are required")
        inst = self.cluster.register(request)
        self.on_register(inst)
        return pb.RegisterReply(accepted=True, report_interval_s=self.cluster.report_interval_s)

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.LoadReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeLoadBroadcast]:
        if not self._authorised(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing token")
        async for report in request_iterator:
            self.cluster.report(report)
            yield self.cluster.decode_broadcast()
