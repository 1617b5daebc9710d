"""Reading a request right after it finished: its status-table row may still be queued in the batched
writer (flushed every `flush_interval_s`), and the admin API shows it as the daemon knows it — finished,
with its model and instances — not a 404 (a race a loaded machine showed)."""

from __future__ import annotations

import json
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
