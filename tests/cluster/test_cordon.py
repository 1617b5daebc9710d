"""`tetrictl instances cordon|uncordon|drain` and `POST /api/v1/instances/{id}/cordon|uncordon`: a cordoned
instance gets no new work (no new prompts, no new hand-overs) while what runs there runs to completion;
refused for the last instance that keeps a model served; drain waits for what is in flight. Real processes
on loopback (sim workers), and the registry's own objects for what a front follows."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from daemon.cluster import Cluster, LoadReport, Registration
from daemon.controller.registry import Registry
from daemon.wire import view_from_pb, view_to_pb

from .harness import LiveCluster, all_rows, start_cluster, wait_for
from .test_broadcast import SteppedClock

MODEL = "tetri-sim"
SCALE = 4.0  # model seconds per wall second: a 1,900-token answer takes about two wall seconds
LONG = 1900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cordon"), ["prefill", "prefill", "decode", "decode"], time_scale=SCALE)
    yield c
    c.stop()


@pytest.fixture()
def h(cluster: LiveCluster) -> Iterator[httpx.Client]:
    """The admin API; every instance uncordoned after the test (the next one starts with none)."""
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        yield client
        for iid in cluster.workers:
            client.post(f"/api/v1/instances/{iid}/uncordon")


def tetrictl(c: LiveCluster, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tetrictl.app", *args, "--url", c.url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def burst(c: LiveCluster, n: int) -> list[str]:
    """`n` short requests at once (least-loaded routing spreads them over what it may choose); their ids."""

    async def go() -> list[str]:
        async with openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            done = await asyncio.gather(
                *(client.completions.create(model=MODEL, prompt=[7] * 20, max_tokens=4) for _ in range(n))
            )
        return [r.id for r in done]

    return asyncio.run(go())


def served(c: LiveCluster, ids: list[str]) -> list[dict]:
    """The rows of these requests once all are written and ended (the table is written behind the stream)."""
    rows: dict[str, dict] = {}

    def ended() -> bool:
        nonlocal rows
        rows = {i: r for i, r in all_rows(c.db_url).items() if i in ids}
        return len(rows) == len(ids) and all(r["status"] != "running" for r in rows.values())

    wait_for(ended)
    assert all(r["status"] == "finished" for r in rows.values())
    return list(rows.values())


def long_request(c: LiveCluster, decode: str) -> tuple[threading.Thread, dict]:
    """A long streamed request pinned to `decode`, in a thread; the dict gets its id, its token count and
    when (monotonic) its stream ended."""
    got: dict = {}

    def run() -> None:
        with openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            pin = {"tetri": {"decode_instance": decode}}
            stream = client.completions.create(
                model=MODEL, prompt=[3] * 8, max_tokens=LONG, extra_body=pin, stream=True
            )
            n = 0
            for chunk in stream:
                got["id"] = chunk.id
                if chunk.choices:
                    n += len(chunk.choices[0].text.split())
        got["tokens"], got["ended"] = n, time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t, got


def test_a_cordoned_instance_gets_no_new_work_until_uncordoned(cluster: LiveCluster, h: httpx.Client):
    p1, p2 = cluster.started_as("prefill")
    d1, d2 = cluster.started_as("decode")
    for iid in (p1, d1):
        r = h.post(f"/api/v1/instances/{iid}/cordon")
        assert r.status_code == 200 and r.json()["cordoned"] and r.json()["changed"], r.text
    again = h.post(f"/api/v1/instances/{d1}/cordon").json()
    assert again["cordoned"] and not again["changed"]
    listed = {i["id"]: i for i in h.get("/api/v1/instances").json()["instances"]}
    assert {i: d["cordoned"] for i, d in listed.items()} == {p1: True, d1: True, p2: False, d2: False}
    assert {d["state"] for d in listed.values()} == {"active"}  # registered and visible, in their state
    time.sleep(0.6)  # reports keep coming: the last one is younger than that (report age is model time)
    wait_for(lambda: h.get(f"/api/v1/instances/{d1}").json()["last_report_age_s"] < 0.3 * SCALE, 5)

    rows = served(cluster, burst(cluster, 16))
    assert {r["prefill_instance"] for r in rows} == {p2}
    assert {r["decode_instance"] for r in rows} == {d2}
    pinned = h.post("/v1/completions", json={"model": MODEL, "prompt": [1], "tetri": {"decode_instance": d1}})
    assert pinned.status_code == 409 and pinned.json()["error"]["param"] == "tetri.decode_instance"

    # the last instance that keeps the model served: refused as a flip is, the error shape of the admin API
    for iid, why in ((d2, "last active decode"), (p2, "last active prefill")):
        r = h.post(f"/api/v1/instances/{iid}/cordon")
        assert r.status_code == 409 and r.json()["error"]["type"] == "ConflictError", r.text
        assert why in r.json()["error"]["message"]
        assert not h.get(f"/api/v1/instances/{iid}").json()["cordoned"]
    for verb in ("cordon", "uncordon"):
        r = h.post(f"/api/v1/instances/nope/{verb}")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no instance 'nope'"

    for iid in (p1, d1):
        r = h.post(f"/api/v1/instances/{iid}/uncordon")
        assert r.status_code == 200 and not r.json()["cordoned"] and r.json()["changed"]
    assert not h.post(f"/api/v1/instances/{d1}/uncordon").json()["changed"]
    used: set[str] = set()
    for _ in range(5):  # the prefill instances hear of d1 with their next load report's answer
        used |= {x for r in served(cluster, burst(cluster, 16)) for x in (r["prefill_instance"], r["decode_instance"])}
        if {p1, d1} <= used:
            break
    assert {p1, d1} <= used


def test_drain_returns_once_the_request_in_flight_has_finished(cluster: LiveCluster, h: httpx.Client):
    d1, d2 = cluster.started_as("decode")
    t, got = long_request(cluster, d1)
    wait_for(lambda: h.get(f"/api/v1/instances/{d1}").json()["inflight"] > 0)
    launched = time.monotonic()
    r = tetrictl(cluster, "instances", "drain", d1, "--timeout", "60", "--json")
    returned = time.monotonic()
    t.join(60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["drained"] and doc["instance"]["id"] == d1 and doc["instance"]["cordoned"]
    assert doc["instance"]["inflight"] == 0 and doc["instance"]["running"] == 0
    assert got["tokens"] == LONG  # it ran to completion where it was,
    assert launched < got["ended"] <= returned  # and drain, begun while it ran, returned only after it ended
    assert served(cluster, [got["id"]])[0]["decode_instance"] == d1
    # drain stops no process: the worker runs, registered, cordoned
    assert cluster.workers[d1].poll() is None
    assert h.get(f"/api/v1/instances/{d1}").json()["cordoned"]

    ls = tetrictl(cluster, "instances", "ls")
    assert ls.returncode == 0 and "active,cordoned" in ls.stdout
    ls_json = json.loads(tetrictl(cluster, "instances", "ls", "--json").stdout)["instances"]
    assert {i["id"]: i["cordoned"] for i in ls_json if i["role"] == "decode"} == {d1: True, d2: False}

    refused = tetrictl(cluster, "instances", "cordon", d2, "--json")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "HTTP 409" in refused.stderr and "last active decode" in refused.stderr
    for verb in ("cordon", "uncordon", "drain"):
        unknown = tetrictl(cluster, "instances", verb, "nope")
        assert unknown.returncode == 2 and unknown.stderr.strip() == "error: HTTP 404: no instance 'nope'", unknown

    back = tetrictl(cluster, "instances", "uncordon", d1, "--json")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout) | {"id": d1, "cordoned": False, "changed": True} == json.loads(back.stdout)
    said = tetrictl(cluster, "instances", "cordon", d1)
    assert said.returncode == 0 and said.stdout.strip() == f"instance {d1} cordoned"
    said = tetrictl(cluster, "instances", "uncordon", d1)
    assert said.returncode == 0 and said.stdout.strip() == f"instance {d1} uncordoned"


def test_drain_gives_up_after_its_timeout_and_leaves_the_instance_cordoned(cluster: LiveCluster, h: httpx.Client):
    d2 = cluster.started_as("decode")[1]
    t, got = long_request(cluster, d2)
    wait_for(lambda: h.get(f"/api/v1/instances/{d2}").json()["inflight"] > 0)
    r = tetrictl(cluster, "instances", "drain", d2, "--timeout", "0.3", "--json")
    assert r.returncode == 1 and r.stdout == "" and "still has requests in flight after 0.3s" in r.stderr, r
    assert h.get(f"/api/v1/instances/{d2}").json()["cordoned"]
    t.join(60)
    assert got["tokens"] == LONG  # a cordon leaves what runs there alone
    bad = tetrictl(cluster, "instances", "drain", d2, "--timeout", "0")
    assert bad.returncode == 2 and "--timeout must be positive" in bad.stderr


# --- the registry's own objects: what a front follows, when drained says so -------------------------------
def registry(*roles: str) -> tuple[Cluster, SteppedClock]:
    clock = SteppedClock()
    c = Registry(report_interval_s=0.1, unhealthy_after=3, clock=clock, dead_after_s=10.0)
    for k, role in enumerate(roles):
        c.register(Registration(f"w{k}", role, f"h:{k}", "m", 1024, 1000))
    return c, clock


def test_broadcasts_and_fronts_views_carry_the_cordon() -> None:
    ctl, clock = registry("prefill", "decode", "decode")
    clock.t += 11  # settled: past the dead-after time
    assert ctl.cordon_refusal(ctl.instances["w1"]) is None and ctl.cordon(ctl.instances["w1"])
    assert "last active decode" in str(ctl.cordon_refusal(ctl.instances["w2"]))
    assert {d.instance_id: d.load.state for d in ctl.decode_broadcast().instances} == {"w1": "cordoned", "w2": "active"}
    front = Cluster(report_interval_s=0.1, unhealthy_after=3, clock=SteppedClock())
    front.follow(view_from_pb(view_to_pb(ctl.view())))
    w1 = front.instances["w1"]
    assert w1.cordoned and w1.state == "active" and [i.id for i in front.healthy("decode")] == ["w2"]
    # re-registering (a worker restarted) keeps an operator's cordon
    ctl.register(Registration("w1", "decode", "h:1", "m", 1024, 1000))
    assert ctl.instances["w1"].cordoned and [i.id for i in ctl.healthy("decode")] == ["w2"]
    ctl.uncordon(ctl.instances["w1"])
    front.follow(view_from_pb(view_to_pb(ctl.view())))
    assert not w1.cordoned and sorted(i.id for i in front.healthy("decode")) == ["w1", "w2"]


def test_drained_needs_a_quiet_report_a_settle_time_after_the_cordon() -> None:
    ctl, clock = registry("prefill", "decode", "decode")
    d = ctl.instances["w1"]
    ctl.cordon(d)
    assert ctl.report(LoadReport("w1", "decode", "active", kv_capacity_tokens=1000))
    assert not ctl.instance_dict(d)["drained"]  # a hand-over chosen before the cordon may still land
    clock.t += ctl.drain_settle_s()
    assert ctl.report(LoadReport("w1", "decode", "active", running=1, kv_capacity_tokens=1000))
    assert not ctl.instance_dict(d)["drained"]
    assert ctl.report(LoadReport("w1", "decode", "active", kv_capacity_tokens=1000))
    assert ctl.instance_dict(d)["drained"]
    ctl.routed(d, +1)  # this daemon's own request there, before any report shows it
    assert not ctl.instance_dict(d)["drained"]


def test_a_cordoned_instance_removed_and_back_comes_back_cordoned() -> None:
    """`instances drain` and then a worker stopped and started again under its id: the cordon stands until
    uncordon, even though the daemon removed the silent instance meanwhile."""
    ctl, clock = registry("prefill", "decode", "decode")
    assert ctl.cordon(ctl.instances["w1"])
    clock.t += 11  # w1 stopped: silent past dead_after_s (the others report)
    for iid, role in (("w0", "prefill"), ("w2", "decode")):
        assert ctl.report(LoadReport(iid, role, "active", kv_capacity_tokens=1000))
    ctl.check_health()
    assert "w1" not in ctl.instances
    back = ctl.register(Registration("w1", "decode", "h:1", "m", 1024, 1000))
    assert back.cordoned and [i.id for i in ctl.healthy("decode")] == ["w2"]
    assert ctl.uncordon(back)
    ctl.check_health()
    assert sorted(i.id for i in ctl.healthy("decode")) == ["w1", "w2"]
