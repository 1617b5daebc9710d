"""Every console command as an operator's script runs it: a real `tetrictl` subprocess against a real daemon
with sim workers on loopback; `--json` parses, and the exit codes are the documented ones."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.harness import LiveCluster, start_cluster
from tetrictl import exitcodes
from tetrictl.procs import stop_all

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = start_cluster(tmp_path_factory.mktemp("console"), ["prefill", "prefill", "decode", "decode"])
    yield c
    c.stop()


def ctl(c: LiveCluster | None, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    target = ["--url", url or (c.url if c else "http://127.0.0.1:9")]
    return subprocess.run(
        [sys.executable, "-m", "tetrictl.app", *args, *target], capture_output=True, text=True, timeout=120
    )


def ok_json(c: LiveCluster, *args: str) -> dict:
    r = ctl(c, *args, "--json")
    assert r.returncode == exitcodes.OK, r.stderr
    return json.loads(r.stdout)  # exactly one JSON document


def fails(r: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@contextlib.contextmanager
def slow_decode_instance(cluster: LiveCluster) -> Iterator[str]:
    """One more decode instance on a real-time clock (minutes for a long answer), removed afterwards: the
    other tests expect the cluster's two decode instances."""
    proc, info = cluster.add_worker("decode", time_scale=1.0)
    slow = info["instance_id"]
    try:
        yield slow
    finally:
        stop_all([proc])
        cluster.workers.pop(slow)
        deadline = time.monotonic() + 20
        while httpx.get(f"{cluster.url}/api/v1/instances/{slow}").json()["state"] != "unhealthy":
            assert time.monotonic() < deadline
            time.sleep(0.1)


def active_decodes(c: LiveCluster) -> list[str]:
    insts = ok_json(c, "instances", "ls")["instances"]
    return sorted(i["id"] for i in insts if i["role"] == "decode" and i["state"] == "active")


def complete(c: LiveCluster, n: int, max_tokens: int = 8) -> list[str]:
    with httpx.Client(base_url=c.url, timeout=60) as h:
        return [
            h.post("/v1/completions", json={"model": MODEL, "prompt": [k + 1] * 20, "max_tokens": max_tokens}).json()[
                "id"
            ]
            for k in range(n)
        ]


def test_status_instances_and_requests(cluster: LiveCluster):
    ids = complete(cluster, 3)
    time.sleep(0.3)  # one flush of the batched status writes
    st = ok_json(cluster, "status")
    assert st["model"] == MODEL and st["instances"]["decode"]["total"] == 2 and len(st["instance_list"]) == 4
    assert st["policies"]["decode_admission"] == "greedy"
    human = ctl(cluster, "status")
    assert human.returncode == 0 and "instances" in human.stdout and MODEL in human.stdout

    models = ok_json(cluster, "models")["models"]
    assert [m["id"] for m in models] == [MODEL] and models[0]["max_model_len"] > 0
    assert models[0]["instances"] == {"prefill": {"active": 2, "total": 2}, "decode": {"active": 2, "total": 2}}
    shown_models = ctl(cluster, "models")
    assert shown_models.returncode == 0 and MODEL in shown_models.stdout and "decode 2/2" in shown_models.stdout

    insts = ok_json(cluster, "instances", "ls")["instances"]
    assert {i["role"] for i in insts} == {"prefill", "decode"}
    one = ok_json(cluster, "instances", "show", insts[0]["id"])
    assert one["id"] == insts[0]["id"] and one["kv_capacity_tokens"] > 0
    fails(ctl(cluster, "instances", "show", "nope"), exitcodes.USAGE, "no instance 'nope'")

    page = ok_json(cluster, "requests", "ls", "--status", "finished", "--limit", "2")
    assert page["total"] >= 3 and len(page["requests"]) == 2 and page["limit"] == 2
    assert all(r["status"] == "finished" for r in page["requests"])
    shown = ok_json(cluster, "requests", "show", ids[0])
    assert [p["phase"] for p in shown["timeline"]] == ["queued", "prefill", "first_token", "decode", "done"]
    human = ctl(cluster, "requests", "show", ids[0])
    assert human.returncode == 0
    arrival = next(line for line in human.stdout.splitlines() if "arrival_ts" in line)
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", arrival), arrival  # ISO, not 1,796,…
    empty = ctl(cluster, "requests", "ls", "--status", "interrupted")
    assert empty.returncode == 0 and "requests: none" in empty.stdout and "1–0" not in empty.stdout
    fails(ctl(cluster, "requests", "ls", "--phase", "bogus"), exitcodes.USAGE, "--phase must be one of")
    fails(ctl(cluster, "requests", "ls", "--limit", "0"), exitcodes.USAGE, "--limit")
    mine = ok_json(cluster, "requests", "ls", "--id-prefix", ids[0][:12])
    assert ids[0] in {r["id"] for r in mine["requests"]}
    assert all(r["id"].startswith(ids[0][:12]) for r in mine["requests"])
    fails(ctl(cluster, "requests", "ls", "--id-prefix", "x" * 65), exitcodes.USAGE, "--id-prefix")
    fails(ctl(cluster, "requests", "show", "nope"), exitcodes.USAGE, "no request 'nope'")
    fails(ctl(cluster, "requests", "cancel", ids[0]), exitcodes.REFUSED, "is not in flight")


def test_cancel_an_in_flight_request(cluster: LiveCluster):
    with slow_decode_instance(cluster) as slow:
        _cancel_one(cluster, slow)


def _cancel_one(cluster: LiveCluster, slow: str) -> None:
    result: dict[str, object] = {}

    def long_request() -> None:
        with httpx.Client(base_url=cluster.url, timeout=120) as h:
            body = {
                "model": MODEL,
                "prompt": [5] * 10,
                "max_tokens": 2000,
                "tetri": {"request_id": "to-cancel", "decode_instance": slow},
            }
            result["resp"] = h.post("/v1/completions", json=body)

    t = threading.Thread(target=long_request)
    t.start()

    def decoding() -> bool:  # on the slow instance: minutes from its end
        r = httpx.get(f"{cluster.url}/api/v1/requests/to-cancel")
        assert "resp" not in result, getattr(result["resp"], "text", None)  # it ended before it decoded
        return r.status_code == 200 and r.json()["phase"] == "decode"

    deadline = time.monotonic() + 20
    while not decoding():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        doc = ok_json(cluster, "requests", "cancel", "to-cancel")
    except AssertionError as e:  # it ended before the cancel: say how
        t.join(10)
        resp = result.get("resp")
        raise AssertionError(f"{e}; the request answered {getattr(resp, 'text', None)!r}") from None
    assert doc == {"id": "to-cancel", "cancelled": True}
    t.join(60)
    time.sleep(0.3)
    assert ok_json(cluster, "requests", "show", "to-cancel")["status"] == "cancelled"


def test_cancel_in_bulk(cluster: LiveCluster):
    with slow_decode_instance(cluster) as slow:
        _cancel_many(cluster, slow)


def _cancel_many(cluster: LiveCluster, slow: str) -> None:
    ids = ["bulk-1", "bulk-2", "bulk-3", "other-1"]

    def long_request(rid: str) -> None:
        with httpx.Client(base_url=cluster.url, timeout=120) as h:
            body = {
                "model": MODEL,
                "prompt": [5] * 10,
                "max_tokens": 2000,
                "tetri": {"request_id": rid, "decode_instance": slow},
            }
            h.post("/v1/completions", json=body)

    threads = [threading.Thread(target=long_request, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()

    def decoding(rid: str) -> bool:
        r = httpx.get(f"{cluster.url}/api/v1/requests/{rid}")
        return r.status_code == 200 and r.json()["phase"] == "decode"

    deadline = time.monotonic() + 20
    while not all(decoding(rid) for rid in ids):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    fails(ctl(cluster, "requests", "cancel"), exitcodes.USAGE, "--status running")
    fails(ctl(cluster, "requests", "cancel", "--status", "finished"), exitcodes.USAGE, "only running")
    fails(ctl(cluster, "requests", "cancel", "bulk-1", "--status", "running"), exitcodes.USAGE, "not both")
    long = "x" * 65  # the filter `requests ls --id-prefix` takes, spelled and bounded the same
    too_long = ctl(cluster, "requests", "cancel", "--status", "running", "--id-prefix", long)
    fails(too_long, exitcodes.USAGE, "--id-prefix")
    doc = ok_json(cluster, "requests", "cancel", "--status", "running", "--id-prefix", "bulk-")
    assert doc == {"cancelled": ["bulk-1", "bulk-2", "bulk-3"], "count": 3}
    assert httpx.get(f"{cluster.url}/api/v1/requests/other-1").json()["status"] == "running"
    human = ctl(cluster, "requests", "cancel", "--status", "running")
    assert human.returncode == 0 and "cancelled 1 request\n" in human.stdout, human.stdout + human.stderr
    for t in threads:
        t.join(60)
    time.sleep(0.3)
    assert {ok_json(cluster, "requests", "show", rid)["status"] for rid in ids} == {"cancelled"}
    bad = httpx.post(f"{cluster.url}/api/v1/requests/cancel", json={"id_prefix": 7, "extra": 1})
    assert bad.status_code == 400 and "error" in bad.json()
    old = httpx.post(f"{cluster.url}/api/v1/requests/cancel", json={"prefix": "bulk-"})  # not its name
    assert old.status_code == 400 and "prefix" in old.text
    empty = httpx.post(f"{cluster.url}/api/v1/requests/cancel")  # no body: nothing is cancelled
    assert empty.status_code == 400 and "error" in empty.json()


def test_policy_and_flip_policy(cluster: LiveCluster):
    before = ok_json(cluster, "policy", "show")
    changed = ok_json(cluster, "policy", "set", "--prefill", "sjf", "--sched-batch", "8", "--chunk", "256")
    assert set(changed["changed"]) == {"prefill_policy", "prefill_sched_batch", "chunk_size"}
    assert changed["version"] == before["version"] + 1
    assert ok_json(cluster, "policy", "show")["policies"]["chunk_size"] == 256
    fails(ctl(cluster, "policy", "set", "--chunk", "0"), exitcodes.USAGE, "chunk_size")
    fails(ctl(cluster, "policy", "set", "--decode", "bogus"), exitcodes.USAGE, "decode_admission")
    fails(ctl(cluster, "policy", "set", "--reserve-point", "top"), exitcodes.USAGE, "reserve_point")
    point = ok_json(cluster, "policy", "set", "--reserve-point", "mid")
    assert point["changed"] == ["reserve_point"]
    assert ok_json(cluster, "policy", "show")["policies"]["reserve_point"] == "mid"
    fails(ctl(cluster, "policy", "set"), exitcodes.USAGE, "nothing to set")
    slo = ok_json(cluster, "policy", "set", "--ttft-target", "0.5", "--ttft-miss", "reject", "--token-budget", "384")
    assert set(slo["changed"]) == {"ttft_target_s", "ttft_miss", "token_budget"}
    fails(ctl(cluster, "policy", "set", "--ttft-miss", "drop"), exitcodes.USAGE, "ttft_miss")
    fails(ctl(cluster, "policy", "set", "--token-budget", "-1"), exitcodes.USAGE, "token_budget")
    assert ok_json(cluster, "policy", "show")["policies"]["chunk_size"] == 256  # state unchanged by the refusals
    hist = ok_json(cluster, "policy", "history")["changes"]
    assert {h["field"] for h in hist} >= {"prefill_policy", "chunk_size"}
    assert all(h["requested_by"] == "local" for h in hist)  # no admin token: the caller is `local`

    fp = ok_json(cluster, "flip-policy", "show")
    assert fp["flip_policy"] == "off"
    fp = ok_json(cluster, "flip-policy", "set", "--window", "30")
    assert fp["flip_window_s"] == 30 and fp["changed"] == ["flip_window_s"]
    fails(ctl(cluster, "flip-policy", "set", "--low", "0.95"), exitcodes.USAGE, "flip_low")
    fails(ctl(cluster, "flip-policy", "set", "--policy", "sometimes"), exitcodes.USAGE, "flip_policy")
    fp = ok_json(cluster, "flip-policy", "set", "--policy", "advise")  # the daemon has the cluster's profile
    assert fp["flip_policy"] == "advise" and fp["changed"] == ["flip_policy"]


def test_flip_wait_and_refusals(cluster: LiveCluster):
    decode = active_decodes(cluster)[0]
    row = ok_json(cluster, "flip", decode, "--to", "prefill", "--wait", "--reason", "test")
    assert row["outcome"] == "done" and row["to_role"] == "prefill" and row["reason"] == "test"
    assert ok_json(cluster, "instances", "show", decode)["role"] == "prefill"
    shown = ctl(cluster, "instances", "ls").stdout  # the id names no role; the role column says what it is now
    assert decode.startswith("worker-") and re.search(rf"{decode}\s*│\s*prefill", shown), shown
    assert any(f["id"] == row["id"] for f in ok_json(cluster, "flips", "ls")["flips"])
    assert ok_json(cluster, "flips") == ok_json(cluster, "flips", "ls")  # bare `flips` lists too
    assert "flips" in ctl(cluster, "flips").stdout
    last_decode = active_decodes(cluster)[0]
    fails(ctl(cluster, "flip", last_decode), exitcodes.REFUSED, "last active decode instance")
    fails(ctl(cluster, "flip", "nope"), exitcodes.USAGE, "no instance 'nope'")
    fails(
        ctl(cluster, "flip", decode, "--to", "sideways"), exitcodes.USAGE, "--to must be colocated, prefill or decode"
    )
    fails(ctl(cluster, "flip", decode, "--to", "prefill"), exitcodes.REFUSED, "already is a prefill instance")
    back = ok_json(cluster, "flip", decode, "--wait")  # and back, so the other tests keep two decodes
    assert back["to_role"] == "decode" and back["outcome"] == "done"


def test_plan_replay_follows_the_plan_and_restores_the_instance(cluster: LiveCluster, tmp_path: Path):
    w = tmp_path / "w.jsonl"
    rows = [{"id": f"q{k}", "prompt_tokens": 40 + k, "output_tokens": 600 - 40 * k} for k in range(12)]
    w.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = tmp_path / "plan.json"
    r = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "plan", "solve", str(w), "-M", "4192", "-o", str(plan), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    decode = active_decodes(cluster)[1]
    doc = ok_json(cluster, "plan", "replay", str(plan), "--instance", decode)
    prog = doc["progress"]
    assert doc["instance_id"] == decode and doc["plan_memory"] == 4192 and doc["kv_capacity_tokens"] == 4192
    assert prog["n"] == prog["finished"] == 12 and prog["failed"] == 0 and prog["done"]
    assert prog["planned_tel"] == json.loads(plan.read_text())["tel"] and prog["measured_tel_s"] > 0
    assert prog["order_agreement"] > 0.5 and set(prog["measured_order"]) == {f"q{k}" for k in range(12)}
    rows = httpx.get(f"{cluster.url}/api/v1/requests", params={"id_prefix": doc["tag"] + "."}).json()["requests"]
    assert len(rows) == 12 and {r["decode_instance"] for r in rows} == {decode}
    assert sorted(r["output_tokens"] for r in rows) == sorted(600 - 40 * k for k in range(12))
    # the plan was cleared: a request the plan never named is admitted on that instance
    body = {"model": MODEL, "prompt": [3] * 10, "max_tokens": 5, "tetri": {"decode_instance": decode}}
    assert httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30).status_code == 200
    fcfs = ok_json(cluster, "plan", "replay", str(plan), "--order", "fcfs")
    assert fcfs["order"] == "fcfs" and fcfs["progress"]["finished"] == 12
    assert fcfs["progress"]["planned_tel"] >= prog["planned_tel"]  # Sorted-F plans no worse than fcfs
    human = ctl(cluster, "plan", "replay", str(plan))
    assert human.returncode == 0 and "Kendall" in human.stdout

    bad = tmp_path / "bad.json"
    bad.write_text('{"memory": 4192, "batches": [["q0", "zz"]], "schedule": [{"id": "q0", "start": 0}]}')
    fails(ctl(cluster, "plan", "replay", str(bad)), exitcodes.USAGE, "names unknown request 'zz'")
    bad.write_text("{not json")
    fails(ctl(cluster, "plan", "replay", str(bad)), exitcodes.USAGE, "not valid JSON")
    fails(ctl(cluster, "plan", "replay", str(tmp_path / "missing.json")), exitcodes.USAGE, "cannot read")
    fails(ctl(cluster, "plan", "replay", str(plan), "--instance", "nope"), exitcodes.USAGE, "--instance nope")
    fails(ctl(cluster, "plan", "replay", str(plan), "--speed", "0"), exitcodes.USAGE, "--speed")
    fails(ctl(cluster, "plan", "replay", str(plan), "--order", "lifo"), exitcodes.USAGE, "--order")
    # a plan that does not fit the instance is refused before anything is sent, unless --force
    big = tmp_path / "big.json"
    doc_big = json.loads(plan.read_text()) | {"memory": 100_000}
    big.write_text(json.dumps(doc_big))
    before = httpx.get(f"{cluster.url}/api/v1/requests").json()["total"]
    fails(ctl(cluster, "plan", "replay", str(big), "--instance", decode), exitcodes.USAGE, "plan with --memory 4192")
    long_rows = [dict(r, prompt_tokens=4000) if r["id"] == "q0" else r for r in doc_big["schedule"]]
    big.write_text(json.dumps(doc_big | {"memory": 4192, "schedule": long_rows}))
    fails(ctl(cluster, "plan", "replay", str(big), "--instance", decode), exitcodes.USAGE, "q0 (4000 + 600)")
    time.sleep(0.3)
    assert httpx.get(f"{cluster.url}/api/v1/requests").json()["total"] == before  # nothing was sent
    big.write_text(json.dumps(doc_big))
    forced = ok_json(cluster, "plan", "replay", str(big), "--instance", decode, "--force")
    assert forced["progress"]["finished"] == 12
    # a plan made for the cluster fits it: M and the context from a live decode instance
    fit_w = tmp_path / "fit.jsonl"
    small = [{"id": f"f{k}", "prompt_tokens": 40 + k, "output_tokens": 300} for k in range(6)]
    fit_rows = [*small, {"id": "huge", "prompt_tokens": 1500, "output_tokens": 600}]  # 2,100 > the context
    fit_w.write_text("".join(json.dumps(r) + "\n" for r in fit_rows))
    fails(ctl(cluster, "plan", "solve", str(fit_w), "--from-cluster"), exitcodes.USAGE, "its model's context is")
    fails(ctl(cluster, "plan", "solve", str(fit_w), "--from-cluster", "-M", "10"), exitcodes.USAGE, "not both")
    fit_plan = tmp_path / "fit.json"
    made = ok_json(cluster, "plan", "solve", str(fit_w), "--from-cluster", "--instance", decode, "--drop-oversized",
                   "-o", str(fit_plan))  # fmt: skip
    assert made["dropped"] == 1 and made["memory"] == 4192 and made["from_cluster"]["id"] == decode
    assert ok_json(cluster, "plan", "replay", str(fit_plan), "--instance", decode)["progress"]["finished"] == 6
    pinned = dict(body, tetri={"decode_instance": "nope"})
    r2 = httpx.post(f"{cluster.url}/v1/completions", json=pinned, timeout=30)
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "tetri.decode_instance"


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("instances", "ls"),
        ("requests", "ls"),
        ("policy", "show"),
        ("flip", "decode-1"),
        ("flips",),
        ("flips", "ls"),
        ("flip-policy", "show"),
    ],
)
def test_a_down_daemon_is_exit_3(args: tuple[str, ...]):
    r = ctl(None, *args, "--json")
    fails(r, exitcodes.UNREACHABLE, "cannot reach the daemon at http://127.0.0.1:9")
    assert r.stdout == ""


def test_bad_url_and_config_are_usage_errors(tmp_path: Path):
    fails(ctl(None, "status", url="localhost:8000"), exitcodes.USAGE, "must start with http://")
    cfg = tmp_path / "ctl.toml"
    cfg.write_text("[ctl\n")
    args = [sys.executable, "-m", "tetrictl.app", "status", "--config", str(cfg)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    fails(r, exitcodes.USAGE, f"config {cfg}")
