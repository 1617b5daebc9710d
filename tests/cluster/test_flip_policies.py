"""Instance flips and policy hot-swap on a live cluster (real processes over loopback)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from daemon.db.store import Store, make_engine

from .harness import LiveCluster, start_cluster, wait_for

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"
SCALE = 10.0  # the cluster's time scale (daemon and workers)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LiveCluster]:
    c = start_cluster(tmp_path, ["prefill", "prefill", "decode", "decode"], time_scale=SCALE)
    yield c
    c.stop()


def table(c: LiveCluster, what: str) -> list[dict]:
    store = Store(make_engine(c.db_url))
    try:
        if what == "requests":
            return store.list_requests(None, None, 10_000, 0)[0]
        return store.list_flips() if what == "flips" else store.list_policy_changes()
    finally:
        store.close()


def finished_rows(c: LiveCluster, ids: list[str], timeout: float = 20.0) -> dict[str, dict]:
    """The rows of these requests once every one is written and ended (the status table is written
    behind the stream, flush by flush: a request whose stream ended may not have its row yet)."""
    want = set(ids)
    deadline = time.monotonic() + timeout
    while True:
        rows = {r["id"]: r for r in table(c, "requests") if r["id"] in want}
        if len(rows) == len(want) and all(r["status"] != "running" for r in rows.values()):
            return rows
        assert time.monotonic() < deadline, f"rows never written or never ended: {sorted(want - set(rows))}"
        time.sleep(0.05)


def test_flip_under_load_loses_nothing_and_serves_nothing_twice(cluster: LiveCluster):
    with httpx.Client(base_url=cluster.url, timeout=30) as h:  # closed however the test ends
        _flip_under_load(cluster, h)


def _flip_under_load(cluster: LiveCluster, h: httpx.Client) -> None:
    decode = cluster.started_as("decode")[0]

    async def load() -> list[tuple[str, int, int]]:
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, int, int]:
            await asyncio.sleep(0.02 * i)  # arrivals spread over the flip
            want = 20 + i % 30
            stream = await client.completions.create(
                model=MODEL, prompt=[i % 200 + 1] * (5 + i % 20), max_tokens=want, stream=True
            )
            rid, got = "", 0
            async for chunk in stream:
                rid = chunk.id
                if chunk.choices:
                    got += len(chunk.choices[0].text.split())
            return rid, want, got

        async def flip_midway() -> None:
            await asyncio.sleep(0.4)
            r = await asyncio.to_thread(
                h.post, f"/api/v1/instances/{decode}/flip", json={"to": "prefill", "reason": "test"}
            )
            assert r.status_code == 202, r.text

        try:
            results = await asyncio.gather(*(one(i) for i in range(60)), flip_midway())
        finally:
            await client.close()
        return results[:-1]  # type: ignore[return-value]

    results = asyncio.run(load())
    assert all(got == want for _, want, got in results), [r for r in results if r[1] != r[2]]
    ids = [rid for rid, _, _ in results]
    assert len(set(ids)) == 60
    wait_for(lambda: any(f["outcome"] == "done" for f in table(cluster, "flips")))
    flip = table(cluster, "flips")[0]
    assert flip["instance_id"] == decode and flip["from_role"] == "decode" and flip["to_role"] == "prefill"
    assert flip["started_ts"] <= flip["drained_ts"] <= flip["done_ts"] and flip["requested_by"] == "local"
    rows = finished_rows(cluster, ids)
    assert len(rows) == 60 and all(r["status"] == "finished" for r in rows.values())
    inst = h.get(f"/api/v1/instances/{decode}").json()
    assert inst["role"] == "prefill" and inst["state"] == "active"

    # the flipped instance now takes prefill work; the remaining decode instance takes every hand-over
    # (at once: least-loaded routing spreads them over both prefill instances; one at a time, every one
    # would go to whichever id sorts first, the tie-break)
    async def after_flip() -> list[str]:
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0) as client:
            done = await asyncio.gather(
                *(client.completions.create(model=MODEL, prompt="after the flip", max_tokens=4) for _ in range(8))
            )
        return [r.id for r in done]

    recent = list(finished_rows(cluster, asyncio.run(after_flip())).values())
    assert decode in {r["prefill_instance"] for r in recent}
    assert {r["decode_instance"] for r in recent} == {cluster.started_as("decode")[1]}


def _long_streams(url: str, n: int) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        for _ in client.completions.create(model=MODEL, prompt=[3] * 8, max_tokens=1900, stream=True):
            pass
        client.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    waiter = threading.Thread(target=lambda: [t.join() for t in threads])
    waiter.start()
    return waiter


def test_bad_flips_are_refused_and_change_nothing(cluster: LiveCluster):
    with httpx.Client(base_url=cluster.url, timeout=30) as h:
        assert h.post("/api/v1/instances/nope/flip").status_code == 404
        d1, d2 = cluster.started_as("decode")
        r = h.post(f"/api/v1/instances/{d1}/flip", json={"to": "router"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "to"
        assert h.post(f"/api/v1/instances/{d1}/flip", json={"to": "decode"}).status_code == 409
        busy = _long_streams(cluster.url, 6)  # decode work to drain: the flip stays in progress a while
        wait_for(lambda: h.get(f"/api/v1/instances/{d1}").json()["running"] > 0)
        assert h.post(f"/api/v1/instances/{d1}/flip").status_code == 202
        again = h.post(f"/api/v1/instances/{d1}/flip")
        assert again.status_code == 409 and "already flipping" in again.json()["error"]["message"]
        busy.join(60)
        wait_for(lambda: h.get(f"/api/v1/instances/{d1}").json()["role"] == "prefill")
        last = h.post(f"/api/v1/instances/{d2}/flip")
        assert last.status_code == 409 and "last active decode" in last.json()["error"]["message"]
        assert h.get(f"/api/v1/instances/{d2}").json()["role"] == "decode"
        assert len(h.get("/api/v1/flips").json()["flips"]) == 1


def test_policy_hot_swap_validated_audited_and_applied(cluster: LiveCluster):
    with httpx.Client(base_url=cluster.url, timeout=30) as h:
        doc = h.get("/api/v1/policies").json()
        assert doc["policies"]["chunk_size"] == 512 and doc["version"] == 0
        for bad, field in [
            ({"chunk_size": 0}, "chunk_size"),
            ({"prefill_policy": "random"}, "prefill_policy"),
            ({"decode_admission": "yolo"}, "decode_admission"),
            ({"nope": 1}, "nope"),
        ]:
            r = h.put("/api/v1/policies", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert h.get("/api/v1/policies").json()["version"] == 0  # state unchanged
        r = h.put(
            "/api/v1/policies",
            json={
                "prefill_policy": "sjf",
                "chunk_size": 256,
                "dispatch": "pot",
                "predictor": "oracle",
                "predictor_accuracy": 0.749,
                "decode_admission": "reserve-dynamic",
            },
            headers={"x-tetri-user": "alice"},  # a free header names nobody: no token, the caller is `local`
        )
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1 and sorted(r.json()["changed"]) == sorted(
            ["prefill_policy", "chunk_size", "dispatch", "predictor", "predictor_accuracy", "decode_admission"]
        )
        audit = table(cluster, "audit")
        assert {a["field"] for a in audit} >= {"chunk_size", "prefill_policy"} and audit[0]["requested_by"] == "local"
        # the workers took the new policies without a restart (they acknowledge the version) and keep serving
        wait_for(lambda: {i["policy_version"] for i in h.get("/api/v1/instances").json()["instances"]} == {1})
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=9)
        client.close()
        assert out.usage.completion_tokens == 9
        assert h.get("/api/v1/policies/history").json()["changes"]


def test_learned_predictor_trains_from_the_status_table(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=50.0)
    try:
        with httpx.Client(base_url=c.url, timeout=60) as h:
            assert h.put("/api/v1/policies", json={"predictor": "learned"}).status_code == 200

            def send(i: int) -> None:  # prompts that mention token 7 get long answers
                long = i % 2 == 0
                prompt = [7, 7, 7, 7, *range(20, 20 + i % 9)] if long else [30 + i % 50, 31, 32, 33]
                r = h.post(
                    "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 300 if long else 40}
                )
                assert r.status_code == 200

            for i in range(60):
                send(i)
            trained = h.post("/api/v1/predictor/retrain").json()
            assert trained["retrained"] and trained["trained_on"] >= 60 and trained["holdout_accuracy"] > 0.8
            for i in range(60, 80):
                send(i)
            info = h.get("/api/v1/predictor").json()
            assert info["predictor"] == "learned" and info["live_samples"] == 20 and info["live_accuracy"] > 0.8
            assert 'tetri_predictor_accuracy{kind="live"}' in h.get("/metrics").text
            time.sleep(0.2)
            newest = h.get("/api/v1/requests", params={"limit": 20}).json()["requests"]
            assert all(r["predicted_lo"] is not None for r in newest)
            assert {r["predicted_lo"] for r in newest if r["max_tokens"] == 300} == {201}
    finally:
        c.stop()


def test_plan_admission_follows_a_loaded_sorted_f_plan(cluster: LiveCluster):
    d1 = cluster.started_as("decode")[0]
    order = [f"job-{k}" for k in (3, 0, 5, 1, 4, 2)]
    plan = {"memory": 4192, "policy": "sorted-f", "batches": [order]}
    with httpx.Client(base_url=cluster.url, timeout=60) as h:
        bad = h.put(f"/api/v1/instances/{d1}/plan", json={"batches": [["x"]]})
        assert bad.status_code == 400 and "memory" in bad.json()["error"]["message"]
        unknown = {"memory": 4192, "batches": [["a", "zz"]], "schedule": [{"id": "a", "start": 0}]}
        bad = h.put(f"/api/v1/instances/{d1}/plan", json=unknown)
        assert bad.status_code == 400 and "names unknown request 'zz'" in bad.json()["error"]["message"]
        prefill = cluster.started_as("prefill")[0]
        assert h.put(f"/api/v1/instances/{prefill}/plan", json=plan).status_code == 409
        assert h.put("/api/v1/instances/nope/plan", json=plan).status_code == 404
        r = h.put(f"/api/v1/instances/{d1}/plan", json=plan)
        assert r.status_code == 200 and r.json()["planned"] == 6
        # pin every request to d1 through the other decode instance leaving: flip it to prefill
        d2 = cluster.started_as("decode")[1]
        assert h.post(f"/api/v1/instances/{d2}/flip").status_code == 202
        wait_for(lambda: h.get(f"/api/v1/instances/{d2}").json()["role"] == "prefill")

    async def send_all() -> None:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as a:

            async def one(k: int, prefilled: asyncio.Event) -> None:  # 2,040 KV tokens each: two at a time
                body = {
                    "model": MODEL,
                    "prompt": [k + 1] * 1000,
                    "max_tokens": 1040,
                    "stream": True,
                    "tetri": {"request_id": f"job-{k}"},
                }
                async with a.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        assert '"error"' not in line, line
                        prefilled.set()  # the first chunk: prefilled, its hand-over to d1 under way

            # In plan order, as `tetrictl plan replay` sends: the prefill instance holds each prompt's KV
            # until the decode instance pulls it, so the decode can only follow a plan the prefill is fed in.
            # Each is sent once the one before it is prefilled: there are two prefill instances now (d2
            # flipped), and a later prompt prefilled on the other one could otherwise reach d1 first (a
            # planned request not there yet is skipped, by design: admission.py), as on a loaded machine.
            sends = []
            for k in (3, 0, 5, 1, 4, 2):
                prefilled = asyncio.Event()
                sends.append(asyncio.create_task(one(k, prefilled)))
                await asyncio.wait_for(prefilled.wait(), 60)
            await asyncio.gather(*sends)

    asyncio.run(send_all())
    with httpx.Client(base_url=cluster.url, timeout=60) as h:
        dup = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tetri": {"request_id": "job-0"}})
        assert dup.status_code == 409
        rows = finished_rows(cluster, order)
        assert {r["decode_instance"] for r in rows.values()} == {d1}
        starts = [rows[i]["decode_start_ts"] for i in order]
        # two at a time, in plan order: (job-3, job-0), then (job-5, job-1), then (job-4, job-2); the two of a
        # pair are admitted in one engine step and reach the daemon in either order (a tie of 20 ms of wall
        # time; the status table's times are the cluster clock's, SCALE × faster)
        assert all(b >= a - 0.02 * SCALE for a, b in itertools.pairwise(starts)), starts
        assert starts[2] > starts[1] + 0.05 * SCALE and starts[4] > starts[3] + 0.05 * SCALE, starts
        assert h.delete(f"/api/v1/instances/{d1}/plan").json()["planned"] == 0


def test_advise_flip_policy_moves_the_split_toward_what_the_window_wanted(cluster: LiveCluster):
    """2P:2D under a decode-heavy burst: the daemon replays the window from its status table on the
    simulator and flips a prefill instance to decode (1P:3D), recorded as the transition watcher's."""
    with httpx.Client(base_url=cluster.url, timeout=30) as h:
        r = h.put("/api/v1/policies", json={"flip_policy": "advise", "flip_window_s": 20.0})  # 2 s of wall time
        assert r.status_code == 200 and sorted(r.json()["changed"]) == ["flip_policy", "flip_window_s"], r.text

        async def load() -> list[int]:
            client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)

            async def one(i: int) -> int:
                await asyncio.sleep(0.025 * i)  # 40 a wall second: 4 a model second
                out = await client.completions.create(model=MODEL, prompt=[i % 200 + 1] * (8 + i % 20), max_tokens=800)
                return out.usage.completion_tokens

            try:
                return await asyncio.gather(*(one(i) for i in range(80)))
            finally:
                await client.close()

        assert asyncio.run(load()) == [800] * 80
        wait_for(lambda: any(f["outcome"] == "done" for f in table(cluster, "flips")), timeout=30)
        flips = table(cluster, "flips")
        assert flips[0]["requested_by"] == "transition-watcher", flips
        assert flips[0]["reason"].startswith("advise: 1P:3D"), flips
        assert (flips[0]["from_role"], flips[0]["to_role"]) == ("prefill", "decode")
        roles = sorted(i["role"] for i in h.get("/api/v1/instances").json()["instances"])
        assert roles == ["decode", "decode", "decode", "prefill"]


def test_advise_needs_the_daemons_cost_profile(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=SCALE, daemon_profile=False)
    try:
        with httpx.Client(base_url=c.url, timeout=30) as h:
            r = h.put("/api/v1/policies", json={"flip_policy": "advise"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "flip_policy", r.text
            assert "--profile" in r.json()["error"]["message"]
            assert h.get("/api/v1/policies").json()["version"] == 0
            assert h.put("/api/v1/policies", json={"flip_policy": "idle"}).status_code == 200
    finally:
        c.stop()
