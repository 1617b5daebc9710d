"""The decode-load broadcast's cost (issue 16): built at most every half report interval, only when a
decode instance's load changed, and at once after a change of the registry, a state or the policies."""

from __future__ import annotations

import pytest

from daemon.cluster import LoadReport, Registration
from daemon.controller.registry import Registry
from tetri.clock import ClusterClock
from tetri.scheduling.policyset import PolicySet


class SteppedClock(ClusterClock):
    """The cluster clock, moved by the test (the rule reads time; the test sets it)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def cluster_of(*roles: str) -> tuple[Registry, SteppedClock]:
    clock = SteppedClock()
    c = Registry(report_interval_s=0.1, unhealthy_after=3, clock=clock)
    for k, role in enumerate(roles):
        c.register(Registration(f"w{k}", role, f"h:{k}", "m", 1024, 1000))
    return c, clock


def report(c: Registry, iid: str, role: str, kv: int, ts: float) -> None:
    assert c.report(LoadReport(iid, role, "active", kv_used_tokens=kv, kv_capacity_tokens=1000, timestamp=ts))


def test_an_idle_clusters_broadcast_is_built_once() -> None:
    c, clock = cluster_of("prefill", "decode", "decode")
    for k in range(50):  # 5 s of reports saying the same, each at its own worker time
        clock.t += 0.1
        for iid, role in (("w0", "prefill"), ("w1", "decode"), ("w2", "decode")):
            report(c, iid, role, 7, ts=clock.t)
        if k == 0:
            first = c.decode_broadcast()
        assert c.decode_broadcast() is first
    assert [d.load.kv_used_tokens for d in first.instances] == [7, 7]


def test_a_changed_decode_load_shows_after_half_an_interval() -> None:
    c, clock = cluster_of("prefill", "decode")
    delays: list[float] = []
    c.on_broadcast = delays.append
    report(c, "w1", "decode", 7, ts=1.0)
    before = c.decode_broadcast()
    assert delays == [0.0]  # shown by the broadcast built at once
    report(c, "w1", "decode", 9, ts=2.0)
    clock.t += 0.04
    report(c, "w1", "decode", 11, ts=3.0)
    assert c.decode_broadcast() is before  # within half an interval: the same answer
    clock.t += 0.02
    after = c.decode_broadcast()
    assert after is not before and [d.load.kv_used_tokens for d in after.instances] == [11]
    assert delays == [0.0, pytest.approx(0.06)]  # from the first report the broadcast lacked
    report(c, "w0", "prefill", 500, ts=4.0)  # a prefill instance's load is not in the broadcast
    clock.t += 1.0
    assert c.decode_broadcast() is after and len(delays) == 2


def test_a_state_registry_or_policy_change_shows_at_once() -> None:
    c, _ = cluster_of("prefill", "decode")
    b = c.decode_broadcast()
    c.suspect("w1")
    b, old = c.decode_broadcast(), b
    assert b is not old and [d.load.state for d in b.instances] == ["unhealthy"]
    c.register(Registration("w9", "decode", "h:9", "m", 1024, 1000))
    b, old = c.decode_broadcast(), b
    assert b is not old and [d.instance_id for d in b.instances] == ["w1", "w9"]
    c.set_policies(PolicySet())
    b, old = c.decode_broadcast(), b
    assert b is not old and b.policy_version == 1
    assert c.answer("decode", 1) is None and c.answer("decode", 0) is c.decode_broadcast("decode")
