"""The daemon's wire format: conversions between the ControlPlane's protobuf messages and the cluster's
plain data (`daemon.cluster`). Both rooms use them: the controller's gRPC edge (`daemon.controller.edge`)
serves the messages, a front's controller link (`daemon.front.link`) reads the view, and the worker client
(`daemon.worker_client`) reads load reports. Protobuf goes no further into the daemon than these modules.
"""

from __future__ import annotations

import dataclasses

from tetri.proto import pb
from tetri.scheduling.cacheindex import CacheEvents, Change

from .cluster import ClusterView, DecodeBroadcast, InstanceState, LoadReport, Registration

_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadReport))


def load_from_pb(msg: pb.LoadReport) -> LoadReport:
    return LoadReport(**{name: getattr(msg, name) for name in _LOAD_FIELDS})


def load_to_pb(load: LoadReport) -> pb.LoadReport:
    return pb.LoadReport(**{name: getattr(load, name) for name in _LOAD_FIELDS})  # not asdict: it deep-copies


def registration_from_pb(msg: pb.RegisterRequest) -> Registration:
    return Registration(
        msg.instance_id,
        msg.role,
        msg.address,
        msg.model,
        msg.max_model_len,
        msg.kv_capacity_tokens,
        msg.vocab_size,
        msg.tokenizer,
        msg.block_size,
    )


_REGISTRATION_FIELDS = tuple(f.name for f in dataclasses.fields(Registration))


def registration_to_pb(r: Registration) -> pb.RegisterRequest:
    return pb.RegisterRequest(**{name: getattr(r, name) for name in _REGISTRATION_FIELDS})


def cache_from_pb(msg: pb.CacheEvents) -> CacheEvents:
    return CacheEvents(msg.epoch, msg.seq, msg.reset, tuple(msg.stored), tuple(msg.removed), msg.block_size)


def changes_to_pb(changes: list[Change]) -> list[pb.CacheChange]:
    return [
        pb.CacheChange(instance_id=c.instance, reset=c.reset, dropped=c.dropped, stored=c.stored, removed=c.removed)
        for c in changes
    ]


def cache_view_pb(changes: list[Change], snapshot: bool) -> pb.ClusterView:
    """A view message that relays index changes only."""
    return pb.ClusterView(cache=changes_to_pb(changes), cache_snapshot=snapshot, cache_only=True)


def view_to_pb(v: ClusterView) -> pb.ClusterView:
    return pb.ClusterView(
        instances=[
            pb.InstanceView(registration=registration_to_pb(s.registration), state=s.state, load=load_to_pb(s.load))
            for s in v.instances
        ],
        policies_json=v.policies_json,
        policy_version=v.policy_version,
        clock_now=v.clock_now,
        time_scale=v.time_scale,
        admin_url=v.admin_url,
        settled=v.settled,
        cache=changes_to_pb(v.cache),
        cache_snapshot=v.cache_snapshot,
        cache_only=v.cache_only,
    )


def view_from_pb(msg: pb.ClusterView) -> ClusterView:
    return ClusterView(
        [InstanceState(registration_from_pb(s.registration), s.state, load_from_pb(s.load)) for s in msg.instances],
        msg.policies_json,
        msg.policy_version,
        msg.clock_now,
        msg.time_scale,
        msg.admin_url,
        msg.settled,
        [Change(0, c.instance_id, c.reset, tuple(c.stored), tuple(c.removed), c.dropped) for c in msg.cache],
        msg.cache_snapshot,
        msg.cache_only,
    )


def broadcast_to_pb(b: DecodeBroadcast) -> pb.DecodeLoadBroadcast:
    return pb.DecodeLoadBroadcast(
        instances=[
            pb.DecodeInstanceLoad(instance_id=d.instance_id, address=d.address, load=load_to_pb(d.load), model=d.model)
            for d in b.instances
        ],
        timestamp=b.timestamp,
        policies_json=b.policies_json,
        policy_version=b.policy_version,
    )
