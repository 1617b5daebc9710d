"""Faults on real processes: a worker dying mid-request, a wrong token, a daemon restart."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from daemon.db.store import Store, make_engine
from tetrictl.procs import spawn, wait_ready

from .harness import start_cluster

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


def all_rows(db_url: str) -> dict[str, dict]:
    store = Store(make_engine(db_url))
    try:
        return {r["id"]: r for r in store.list_requests(None, None, 10_000, 0)[0]}
    finally:
        store.close()


def test_decode_worker_dies_mid_request(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=5.0)
    try:
        decode_id = next(i for i in c.workers if i.startswith("decode"))
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2000, stream=True)
        it = iter(stream)
        first = next(it)
        rid = first.id
        c.workers[decode_id].send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError, match="failed mid-request|closed the stream"):
            for _ in it:
                pass
        deadline = time.monotonic() + 5
        while all_rows(c.db_url).get(rid, {}).get("status") != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        row = all_rows(c.db_url)[rid]
        assert row["error"] and decode_id in row["error"]
        # the daemon keeps serving: the dead instance goes unhealthy, a new decode worker takes over
        with httpx.Client(base_url=c.url, timeout=10) as h:
            deadline = time.monotonic() + 5
            while h.get(f"/api/v1/instances/{decode_id}").json()["state"] != "unhealthy":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert h.get("/readyz").status_code == 503
            bad = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert bad.status_code == 502 and "no healthy instance" in bad.json()["error"]["message"]
            c.add_worker("decode", time_scale=5.0)
            ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        client.close()
    finally:
        c.stop()


def test_worker_with_wrong_token_is_refused(tmp_path: Path):
    c = start_cluster(tmp_path, [], token="s3cret")
    try:
        p, _ = c.add_worker("prefill", token="wrong", expect_ready=False)
        line = p.stdout.readline()  # type: ignore[union-attr]
        msg = json.loads(line)
        assert msg["event"] == "error" and "refused" in msg["error"]
        assert p.wait(timeout=10) == 1
        _, info = c.add_worker("prefill")  # the right token
        assert info["role"] == "prefill"
        with httpx.Client(base_url=c.url, timeout=10) as h:
            assert h.get("/api/v1/instances").status_code == 401
            r = h.get("/api/v1/instances", headers={"authorization": "Bearer s3cret"})
            assert [i["id"] for i in r.json()["instances"]] == [info["instance_id"]]
    finally:
        c.stop()


def test_restart_marks_in_flight_requests_interrupted(tmp_path: Path):
    c = start_cluster(tmp_path, ["colocated"], mode="colocated", time_scale=2.0)
    ids: list[str] = []

    async def start_streams() -> None:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            async def one() -> None:
                async with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": [3, 4],
                                                                       "max_tokens": 1500, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ids.append(json.loads(line[6:])["id"])
                            return
            await asyncio.gather(*(one() for _ in range(3)))

    try:
        asyncio.run(start_streams())
        time.sleep(0.3)  # one flush interval: the rows are in the table as running
        assert {all_rows(c.db_url)[i]["status"] for i in ids} == {"running"}
        c.daemon.send_signal(signal.SIGKILL)
        c.daemon.wait()
        daemon = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path)])
        ready = wait_ready(daemon, "daemon")
        c.daemon = daemon
        assert ready["recovered_interrupted"] == 3
        after = all_rows(c.db_url)
        for i in ids:
            assert after[i]["status"] == "interrupted" and "restarted" in after[i]["error"]
        with httpx.Client(base_url=ready["url"], timeout=10) as h:
            assert h.get(f"/api/v1/requests/{ids[0]}").json()["status"] == "interrupted"
    finally:
        c.stop()


def test_tetrictl_up_starts_and_stops_cleanly(tmp_path: Path):
    p = spawn("tetrictl.app", ["up", "--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path),
                               "--profile", "tiny", "--time-scale", "50", "--json"])
    try:
        text = ""
        deadline = time.monotonic() + 60
        while True:
            text += p.stdout.readline()  # type: ignore[union-attr]
            try:
                doc = json.loads(text)
                break
            except json.JSONDecodeError:
                assert time.monotonic() < deadline and p.poll() is None
        assert doc["mode"] == "disaggregated" and {w["role"] for w in doc["workers"]} == {"prefill", "decode"}
        r = httpx.post(doc["url"] + "/v1/completions", json={"model": MODEL, "prompt": "up", "max_tokens": 4})
        assert r.status_code == 200
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(doc["url"] + "/healthz", timeout=2)
    finally:
        if p.poll() is None:
            p.kill()
