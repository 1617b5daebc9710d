"""Reading a request right after it finished: its status-table row may still be queued in the batched
writer (flushed every `flush_interval_s`), and the admin API shows it as the daemon knows it — finished,
with its model and instances — not a 404 (a race a loaded machine showed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from .harness import start_cluster

pytestmark = pytest.mark.slow


def test_a_request_that_just_finished_reads_whole_before_its_row_is_flushed(tmp_path: Path):
    env = {"TETRI_DAEMON_FLUSH_INTERVAL_S": "30"}  # nothing is flushed during the test
    c = start_cluster(tmp_path, ["colocated"], env=env)
    try:
        with httpx.Client(base_url=c.url, timeout=30) as h:
            done = h.post("/v1/completions", json={"model": "tetri-sim", "prompt": "read me", "max_tokens": 4})
            rid = done.json()["id"]
            row = h.get(f"/api/v1/requests/{rid}")
            assert row.status_code == 200, row.text
            r = row.json()
            assert (r["model"], r["status"], r["phase"], r["output_tokens"]) == ("tetri-sim", "finished", "done", 4)
            assert [r["prefill_instance"]] == c.started_as("colocated") and r["finish_reason"] == "length"
            assert [t["phase"] for t in r["timeline"]][-1] == "done"
            assert h.get("/api/v1/requests/cmpl-nosuch").status_code == 404
    finally:
        c.stop()


def test_cluster_counts_agree_with_what_is_in_flight_before_a_flush(tmp_path: Path):
    """`requests_by_status` lays the writer's queued rows over the table's counts: `running` is what is in
    flight, a request that just finished counts as finished (the table had `running: 1, inflight: 0`)."""
    env = {"TETRI_DAEMON_FLUSH_INTERVAL_S": "30"}  # nothing is flushed during the test
    c = start_cluster(tmp_path, ["colocated"], env=env, time_scale=0.5)
    try:
        with httpx.Client(base_url=c.url, timeout=60) as h:
            body = {"model": "tetri-sim", "prompt": "count me", "max_tokens": 400}
            with h.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
                lines = s.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                doc = h.get("/api/v1/cluster").json()
                assert doc["inflight"] == doc["requests_by_status"]["running"] == 1, doc
                rid = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
            h.post(f"/api/v1/requests/{rid}/cancel")  # the stream is closed: cancelled already, or now
            h.post("/v1/completions", json=body | {"max_tokens": 3})
            doc = h.get("/api/v1/cluster").json()
            by = doc["requests_by_status"]
            assert doc["inflight"] == by["running"] == 0 and by["finished"] == by["cancelled"] == 1, doc
            assert doc["latency"]["ttft_s"]["count"] == 2 and doc["latency"]["jct_s"]["count"] == 1
    finally:
        c.stop()


def test_requests_in_flight_list_by_phase_from_memory(tmp_path: Path):
    """A row is written as its request starts and as it ends; listing by an in-flight phase answers from
    the daemon's memory: the disaggregated requests decoding are listed under `decode` (with their
    instances and live counts, paged, newest first), none under `prefill`, and the finished ones under
    `done` from the table."""
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=0.5)
    try:
        with httpx.Client(base_url=c.url, timeout=60) as h:
            done = h.post("/v1/completions", json={"model": "tetri-sim", "prompt": "short", "max_tokens": 2}).json()
            body = {"model": "tetri-sim", "prompt": "decode me", "max_tokens": 2000, "stream": True}
            with (
                h.stream("POST", "/v1/completions", json=body) as s1,
                h.stream("POST", "/v1/completions", json=body) as s2,
            ):
                ids, lines = [], [s1.iter_lines(), s2.iter_lines()]  # kept: a dropped iterator closes its stream
                for it in lines:
                    first = next(line for line in it if line.startswith("data: {"))
                    ids.append(json.loads(first[6:])["id"])
                page = h.get("/api/v1/requests", params={"phase": "decode"}).json()
                deadline = 0
                while page["total"] < 2 and deadline < 200:  # the second token starts the decode phase
                    deadline += 1
                    time.sleep(0.05)
                    page = h.get("/api/v1/requests", params={"phase": "decode"}).json()
                assert page["total"] == 2 and {r["id"] for r in page["requests"]} == set(ids)
                assert all(r["status"] == "running" and r["phase"] == "decode" for r in page["requests"])
                assert all(r["decode_instance"] == c.started_as("decode")[0] for r in page["requests"])
                assert all(r["output_tokens"] >= 1 and r["ttft_ms"] > 0 for r in page["requests"])
                arrivals = [r["arrival_ts"] for r in page["requests"]]
                assert arrivals == sorted(arrivals, reverse=True)
                one = h.get("/api/v1/requests", params={"phase": "decode", "limit": 1, "offset": 1}).json()
                assert one["total"] == 2 and [r["id"] for r in one["requests"]] == [page["requests"][1]["id"]]
                assert h.get("/api/v1/requests", params={"phase": "prefill"}).json()["total"] == 0
                finished = h.get("/api/v1/requests", params={"phase": "decode", "status": "finished"}).json()
                assert finished["total"] == 0
            ended = h.get("/api/v1/requests", params={"phase": "done", "status": "finished"}).json()
            assert done["id"] in {r["id"] for r in ended["requests"]}
    finally:
        c.stop()
