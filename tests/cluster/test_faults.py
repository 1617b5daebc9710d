"""Faults on real processes: a worker dying mid-request, a wrong token, a daemon restart."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tetri.costmodel import load_profile
from tetrictl.procs import spawn, wait_ready
from workers.engines.sim import sim_token

from .harness import all_rows, start_cluster, stop_up, tetrictl_up

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


def test_only_decode_worker_dies_mid_request_and_a_replacement_finishes_it(tmp_path: Path):
    """The one decode instance dies mid-stream: the request waits (migration_wait_s) for a healthy one, the
    dead instance goes unhealthy at once and is removed after dead_after_s; a new decode worker
    finishes the stream with exactly the remaining tokens."""
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=5.0, env={"TETRI_DAEMON_DEAD_AFTER_S": "1"})
    try:
        decode_id = c.started_as("decode")[0]
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=60)
        prompt = [1, 2, 3]
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2000, stream=True, extra_body={"return_token_ids": True}
        )
        it = iter(stream)
        got: list[int] = []
        rid = ""
        while len(got) < 5:  # tokens after the first come from the decode instance: it is decoding now
            chunk = next(it)
            rid = chunk.id
            got += chunk.choices[0].token_ids  # type: ignore[attr-defined]
        c.workers[decode_id].send_signal(signal.SIGKILL)
        with httpx.Client(base_url=c.url, timeout=10) as h:
            deadline = time.monotonic() + 10
            while decode_id in {i["id"] for i in h.get("/api/v1/instances").json()["instances"]}:
                assert time.monotonic() < deadline, "the dead instance was not removed"
                time.sleep(0.05)
            assert h.get("/readyz").status_code == 503
            bad = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert bad.status_code == 502 and "no healthy instance" in bad.json()["error"]["message"]
            c.add_worker("decode", time_scale=5.0)
            for chunk in it:
                got += chunk.choices[0].token_ids or []  # type: ignore[attr-defined]
            assert got == [sim_token(prompt, i, load_profile("tiny").model.vocab_size) for i in range(2000)]
            ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 5
        while all_rows(c.db_url).get(rid, {}).get("status") != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        row = all_rows(c.db_url)[rid]
        assert row["output_tokens"] == 2000 and row["migrations"] == 1 and row["migrated_from"] == decode_id
        client.close()
    finally:
        c.stop()


def test_new_request_waits_out_an_instance_that_reports_late(tmp_path: Path):
    """The only instance misses its load reports (frozen for a moment, as on a host starved by its engines)
    and goes unhealthy: a request that arrives meanwhile waits for it (entry_wait_s) and is served, where
    it used to fail at once with "no healthy instance"."""
    c = start_cluster(tmp_path, ["colocated"], time_scale=5.0, mode="colocated")
    worker = next(iter(c.workers.values()))
    try:
        with httpx.Client(base_url=c.url, timeout=30) as h:
            worker.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while h.get("/api/v1/instances").json()["instances"][0]["state"] != "unhealthy":
                assert time.monotonic() < deadline, "the frozen instance never went unhealthy"
                time.sleep(0.05)
            threading.Timer(1.0, worker.send_signal, (signal.SIGCONT,)).start()
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        worker.send_signal(signal.SIGCONT)
        c.stop()


def test_worker_with_wrong_token_is_refused(tmp_path: Path):
    c = start_cluster(tmp_path, [], token="s3cret", env={"TETRI_DAEMON_ADMIN_TOKENS": '{"ops": "ops-token"}'})
    try:
        p, _ = c.add_worker("prefill", token="wrong", expect_ready=False)
        line = p.stdout.readline()  # type: ignore[union-attr]
        msg = json.loads(line)
        assert msg["event"] == "error" and "refused" in msg["error"]
        assert p.wait(timeout=10) == 1
        p.stdout.close()  # type: ignore[union-attr]
        _, info = c.add_worker("prefill")  # the right token
        assert info["role"] == "prefill"
        with httpx.Client(base_url=c.url, timeout=10) as h:
            assert h.get("/api/v1/instances").status_code == 401
            r = h.get("/api/v1/instances", headers={"authorization": "Bearer s3cret"})
            assert [i["id"] for i in r.json()["instances"]] == [info["instance_id"]]
            # the audit names the token's owner, whatever a header claims
            for token, chunk in (("s3cret", 256), ("ops-token", 128)):
                headers = {"authorization": f"Bearer {token}", "x-tetri-user": "mallory"}
                assert h.put("/api/v1/policies", json={"chunk_size": chunk}, headers=headers).status_code == 200
            assert (
                h.put("/api/v1/policies", json={"chunk_size": 64}, headers={"x-tetri-user": "ops"}).status_code == 401
            )
            audit = h.get("/api/v1/policies/history", headers={"authorization": "Bearer ops-token"}).json()
            assert [c["requested_by"] for c in audit["changes"]] == ["admin", "ops"]
    finally:
        c.stop()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_restart_marks_in_flight_requests_interrupted(store: str, tmp_path: Path, request: pytest.FixtureRequest):
    """kill -9 of the daemon under load, then a restart on the same store: the streams in flight are
    `interrupted`, every request that had finished is still there as it ended, nothing else changed."""
    db = request.getfixturevalue("pg").new_database() if store == "postgresql" else None
    c = start_cluster(tmp_path, ["colocated"], mode="colocated", time_scale=2.0, db_url=db)
    ids: list[str] = []
    done: list[str] = []
    before: dict[str, dict] = {}

    async def streams_then_kill() -> None:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:

            async def one() -> None:  # stays connected, reading, until the daemon dies
                async with h.stream(
                    "POST",
                    "/v1/completions",
                    json={"model": MODEL, "prompt": [3, 4], "max_tokens": 1500, "stream": True},
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and len(ids) < 3 and json.loads(line[6:])["id"] not in ids:
                            ids.append(json.loads(line[6:])["id"])

            for k in range(8):  # finished before the crash: must come back exactly as they ended
                r = await h.post("/v1/completions", json={"model": MODEL, "prompt": [5, k], "max_tokens": 4 + k})
                done.append(r.json()["id"])
            tasks = [asyncio.create_task(one()) for _ in range(3)]
            while len(ids) < 3:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # a few flush intervals: the rows are in the table as running
            before.update(all_rows(c.db_url))
            assert {before[i]["status"] for i in ids} == {"running"}
            assert {before[i]["status"] for i in done} == {"finished"}
            c.daemon.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(streams_then_kill())
        c.daemon.wait()
        c.daemon.stdout.close()  # type: ignore[union-attr]
        again = ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path)] + (["--db-url", db] if db else [])
        daemon = spawn("daemon.main", again)
        ready = wait_ready(daemon, "daemon")
        c.daemon = daemon
        assert ready["recovered_interrupted"] == 3
        after = all_rows(c.db_url)
        for i in ids:
            assert after[i]["status"] == "interrupted" and "restarted" in after[i]["error"]
            # a row is written when its request starts and when it ends: a crash leaves it as inserted
            assert after[i]["output_tokens"] == before[i]["output_tokens"] == 0 and after[i]["ttft_ms"] is None
        assert set(after) == set(before)  # no row lost, none made up
        assert all(after[i] == before[i] for i in done)  # the finished ones exactly as they were
        with httpx.Client(base_url=ready["url"], timeout=10) as h:
            assert h.get(f"/api/v1/requests/{ids[0]}").json()["status"] == "interrupted"
    finally:
        c.stop()


def test_tetrictl_up_starts_and_stops_cleanly(tmp_path: Path):
    args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny", "--time-scale", "50"]
    p, doc = tetrictl_up(args)
    try:
        assert doc["mode"] == "disaggregated" and {w["role"] for w in doc["workers"]} == {"prefill", "decode"}
        r = httpx.post(doc["url"] + "/v1/completions", json={"model": MODEL, "prompt": "up", "max_tokens": 4})
        assert r.status_code == 200
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(doc["url"] + "/healthz", timeout=2)
    finally:
        stop_up(p)


def test_cancel_in_flight(tmp_path: Path):
    disagg = start_cluster(tmp_path, ["prefill", "decode"], time_scale=1.0)

    async def go() -> None:
        async with (
            httpx.AsyncClient(base_url=disagg.url, timeout=60) as h,
            h.stream(
                "POST", "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True}
            ) as resp,
        ):
            lines = resp.aiter_lines()  # one iterator: abandoning it would close the response
            rid = None
            async for line in lines:
                if line.startswith("data: {"):
                    rid = json.loads(line[6:])["id"]
                    break
            assert rid
            r = await h.post(f"/api/v1/requests/{rid}/cancel")
            assert r.status_code == 200
            tail = [line async for line in lines if line.startswith("data: ")]
            assert tail[-1] == "data: [DONE]"
            assert json.loads(tail[-2][6:])["choices"][0]["finish_reason"] == "cancelled"
        await asyncio.sleep(0.3)
        assert all_rows(disagg.db_url)[rid]["status"] == "cancelled"

    try:
        asyncio.run(go())
    finally:
        disagg.stop()
