"""A front's copy of the controller's registry (issue 28): `Cluster.view` on the controller, through the
wire format, into `Cluster.follow` on a front; and the controller's record of its fronts (`FrontWatch`)
ending a gone front's running rows, on real SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemon.cluster import Cluster, LoadReport, Registration
from daemon.controller.fronts import FrontWatch
from daemon.controller.registry import Registry
from daemon.db.store import Store
from daemon.front.route import Router
from daemon.wire import view_from_pb, view_to_pb
from tetri.clock import ClusterClock
from tetri.scheduling.policyset import PolicySet

from .test_broadcast import SteppedClock


def controller(*roles: str) -> tuple[Cluster, SteppedClock]:
    clock = SteppedClock()
    c = Registry(report_interval_s=0.1, unhealthy_after=3, clock=clock, dead_after_s=10.0)
    for k, role in enumerate(roles):
        c.register(Registration(f"w{k}", role, f"h:{k}", "m", 1024, 1000, 50, "builtin:bytes"))
    return c, clock


def through_the_wire(c: Cluster):  # type: ignore[no-untyped-def]
    return view_from_pb(view_to_pb(c.view()))


def test_a_front_follows_registry_states_load_and_policies() -> None:
    ctl, clock = controller("prefill", "decode")
    clock.t += 11  # settled: past the dead-after time
    assert ctl.report(LoadReport("w1", "decode", "active", running=3, kv_used_tokens=400, kv_capacity_tokens=1000))
    ctl.set_policies(PolicySet().changed(decode_admission="reserve-static"))
    front = Cluster(report_interval_s=0.1, unhealthy_after=3, clock=SteppedClock())
    new = front.follow(through_the_wire(ctl))
    assert sorted(i.id for i in new) == ["w0", "w1"]
    assert front.instances["w1"].load.kv_used_tokens == 400 and front.instances["w0"].tokenizer == "builtin:bytes"
    assert front.policies.decode_admission == "reserve-static" and front.policy_version == ctl.policy_version
    assert Router(front).pick("m") is front.instances["w0"]
    # the front's own routing counts stay across views; a flip on the controller takes w1 out of routing
    front.routed(front.instances["w1"], +1)
    ctl.begin_flip(ctl.instances["w1"])
    assert front.follow(through_the_wire(ctl)) == []
    assert front.instances["w1"].state == "draining" and front.instances["w1"].inflight == 1
    assert Router(front).pick("m") is None  # no decode instance to hand over to
    # a worker this front found failing stays out of its routing until the controller shows a newer report
    front.suspect("w0")
    front.follow(through_the_wire(ctl))
    assert front.instances["w0"].state == "unhealthy"
    assert ctl.report(LoadReport("w0", "prefill", "active", kv_capacity_tokens=1000, timestamp=5.0))
    front.follow(through_the_wire(ctl))
    assert front.instances["w0"].state == "active"
    # an instance the controller removed goes from the front too
    del ctl.instances["w1"]
    ctl.invalidate()
    front.follow(through_the_wire(ctl))
    assert list(front.instances) == ["w0"]


def test_a_controller_just_started_adds_but_removes_nothing() -> None:
    """A restarted controller knows only the workers that re-registered so far: its view is not settled
    for its dead-after time, and a front keeps what that view lacks (it serves on)."""
    old, _ = controller("prefill", "decode")
    front = Cluster(report_interval_s=0.1, unhealthy_after=3, clock=SteppedClock())
    front.follow(through_the_wire(old))
    new, clock = controller("prefill")  # w1 has not re-registered yet
    view = through_the_wire(new)
    assert not view.settled
    front.follow(view)
    assert sorted(front.instances) == ["w0", "w1"] and Router(front).pick("m") is not None
    clock.t += 10
    assert through_the_wire(new).settled
    front.follow(through_the_wire(new))
    assert sorted(front.instances) == ["w0"]


def _running(store: Store, rid: str, front: str | None) -> None:
    store.insert_request(id=rid, model="m", arrival_ts=1.0, front=front)


def test_a_gone_front_s_rows_end_interrupted_after_the_grace(tmp_path: Path) -> None:
    async def go() -> None:
        store = Store.open(f"sqlite:///{tmp_path / 'tetri.db'}")
        try:
            for rid, front in (("a", "front-0.1"), ("b", "front-1.2"), ("c", "front-2.3")):
                _running(store, rid, front)
            watch = FrontWatch(store, ClusterClock(), grace_s=0.2)
            for f in ("front-0.1", "front-1.2", "front-2.3"):
                watch.changed(f, True)
            watch.changed("front-0.1", False)  # gone for good
            watch.changed("front-1.2", False)  # gone, but back within the grace (a controller's restart)
            watch.changed("front-1.2", True)
            await asyncio.sleep(0.5)
            status = {r: store.get_request(r)["status"] for r in "abc"}  # type: ignore[index]
            assert status == {"a": "interrupted", "b": "running", "c": "running"}
            assert "front-0.1 died" in store.get_request("a")["error"]  # type: ignore[index]
            await watch.close()
        finally:
            store.close()

    asyncio.run(go())


def test_a_starting_controller_ends_the_rows_of_fronts_that_do_not_reconnect(tmp_path: Path) -> None:
    async def go() -> None:
        store = Store.open(f"sqlite:///{tmp_path / 'tetri.db'}")
        try:
            _running(store, "old", None)  # a daemon without fronts ran before
            _running(store, "live", "front-0.7")
            _running(store, "dead", "front-1.8")
            store.insert_request(id="done", model="m", arrival_ts=1.0, status="finished", front="front-1.8")
            watch = FrontWatch(store, ClusterClock(), grace_s=0.1)
            watch.changed("front-0.7", True)  # reconnects within the grace
            assert store.recover_own(2.0) == 1  # at once: the rows of no front
            await watch.sweep()
            status = {r: store.get_request(r)["status"] for r in ("old", "live", "dead", "done")}  # type: ignore[index]
            assert status == {"old": "interrupted", "live": "running", "dead": "interrupted", "done": "finished"}
            _running(store, "new", None)  # a daemon's own request after its start: not the sweep's
            await watch.sweep()
            assert store.get_request("new")["status"] == "running"  # type: ignore[index]
        finally:
            store.close()

    asyncio.run(go())


def test_a_restarted_controller_resumes_the_policies_in_force(tmp_path: Path) -> None:
    """The audit trail ends in the cluster's state: a controller restarted after a crash
    (`resume_policies`) takes the policies in force; a plain start takes the configured ones and audits
    each field it changes back."""
    from daemon.controller.room import _start_policies
    from tetri.config import DaemonSettings

    def started(settings: DaemonSettings) -> Registry:
        c = Registry(report_interval_s=0.1, unhealthy_after=3, clock=SteppedClock())
        asyncio.run(_start_policies(settings, c, store))
        return c

    store = Store.open(f"sqlite:///{tmp_path / 'tetri.db'}")
    try:
        config = DaemonSettings(policies={"decode_admission": "reserve-static"})
        assert started(config).policies.decode_admission == "reserve-static"
        assert len(store.list_policy_changes()) == 1
        store.record_policy_change(2.0, "chunk_size", "512", "256", "ops")  # `tetrictl policy set` later
        resumed = started(config.model_copy(update={"resume_policies": True}))
        assert (resumed.policies.chunk_size, resumed.policies.decode_admission) == (256, "reserve-static")
        assert len(store.list_policy_changes()) == 2  # nothing changed: nothing audited
        fresh = started(config)
        assert (fresh.policies.chunk_size, fresh.policies.decode_admission) == (512, "reserve-static")
        last = store.list_policy_changes()[-1]
        assert (last["field"], last["new_value"], last["requested_by"]) == ("chunk_size", "512", "daemon config")
    finally:
        store.close()


def test_a_front_without_its_controller_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TETRI_DAEMON_FRONT_CONNECT_S="1")
    args = ["--role", "front", "--controller", "127.0.0.1:1", "--port", "0", "--state-dir", str(tmp_path)]
    r = subprocess.run(
        [sys.executable, "-m", "daemon.main", *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(r.stdout) == {
        "event": "error",
        "error": "no view from the controller at 127.0.0.1:1 within 1 s (UNAVAILABLE)",
    }
    r = subprocess.run([sys.executable, "-m", "daemon.main", "--fronts", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: --fronts must be at least 1"
