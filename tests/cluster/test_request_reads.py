"""Reading a request right after it finished: its status-table row may still be queued in the batched
writer (flushed every `flush_interval_s`), and the admin API shows it as the daemon knows it — finished,
with its model and instances — not a 404 (a race a loaded machine showed)."""

from __future__ import annotations

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
            assert r["prefill_instance"].startswith("colocated") and r["finish_reason"] == "length"
            assert [t["phase"] for t in r["timeline"]][-1] == "done"
            assert h.get("/api/v1/requests/cmpl-nosuch").status_code == 404
    finally:
        c.stop()
