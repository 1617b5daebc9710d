"""One clock per cluster: on a scaled cluster the status table's times are model time (docs/cluster.md,
"Timestamps: one clock per cluster"), on real processes over loopback."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from daemon.db.store import Store, make_engine
from tetri.costmodel import CostModel, load_profile

from .harness import start_cluster

pytestmark = pytest.mark.slow
SCALE = 10.0
PROFILE = "opt-13b-v100"  # ~38 ms per decode step: the sim's per-iteration host overhead stays small beside it


def modelled_s(prompt_tokens: int, output_tokens: int) -> float:
    """A lone request on a colocated sim instance: one prefill iteration (the first token), then one decode
    step per further token."""
    cost = CostModel(load_profile(PROFILE))
    steps = sum(cost.decode_step_time(1, prompt_tokens + k) for k in range(1, output_tokens))
    return cost.prefill_time(prompt_tokens) + steps


def test_a_scaled_cluster_records_model_time(tmp_path: Path):
    before = time.time()
    c = start_cluster(tmp_path, ["colocated"], mode="colocated", profile=PROFILE, time_scale=SCALE)
    try:
        with httpx.Client(base_url=c.url, timeout=60) as h:
            summary = h.get("/api/v1/cluster").json()
            assert summary["time_scale"] == SCALE
            prompt, n = [1 + k % 200 for k in range(64)], 40
            t0 = time.monotonic()
            r = h.post("/v1/completions", json={"model": "tetri-sim", "prompt": prompt, "max_tokens": n})
            wall_s = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
            rid = r.json()["id"]
            deadline = time.monotonic() + 10
            while (row := _row(c.db_url, rid)) is None or row["status"] != "finished":
                assert time.monotonic() < deadline, "the request's row never finished"
                time.sleep(0.05)
    finally:
        c.stop()
    jct_s, ttft_s = row["jct_ms"] / 1000, row["ttft_ms"] / 1000
    model_s = modelled_s(len(prompt), n)
    # model time: at least what the cost model says the engine takes (a wall-clock JCT would be ~1/10 of
    # it), at most the client's wall time × the scale (the daemon's interval lies inside the client's)
    assert model_s * 0.95 <= jct_s <= wall_s * SCALE * 1.05, (jct_s, model_s, wall_s)
    assert jct_s > wall_s * 2  # not wall time
    assert 0 < ttft_s < jct_s
    # the row's timestamps are the same clock: unix-like, and their differences are the recorded latencies
    assert before <= row["arrival_ts"] <= row["prefill_start_ts"] <= row["first_token_ts"] <= row["finished_ts"]
    assert row["finished_ts"] - row["arrival_ts"] == pytest.approx(jct_s, abs=1e-3)
    assert row["first_token_ts"] - row["arrival_ts"] == pytest.approx(ttft_s, abs=1e-3)


def _row(db_url: str, rid: str) -> dict | None:
    store = Store(make_engine(db_url))
    try:
        return store.get_request(rid)
    finally:
        store.close()
