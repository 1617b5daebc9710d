"""Fixed admin-API documents, in the daemon's shapes, for pixel-stable dashboard snapshots.

The snapshot tests check rendering, which needs the same numbers on every run; a live daemon's timings
and ids change. So `transport()` answers the dashboard's HTTP calls (through the real `TetriClient` and
httpx) from these documents: 64 instances and 10,000 requests, the sizes the dashboard must handle.
The live behaviour is tested against a real daemon in test_top_live.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

N_INSTANCES = 64
N_REQUESTS = 10_000
T0 = 1_700_000_000.0
POLICIES = {
    "prefill_policy": "sjf",
    "prefill_sched_batch": 16,
    "chunk_size": 512,
    "predictor": "learned",
    "predictor_accuracy": 1.0,
    "predictor_granularity": 200,
    "dispatch": "pot",
    "decode_admission": "reserve-dynamic",
    "flip_policy": "idle",
    "flip_low": 0.1,
    "flip_high": 0.8,
    "flip_window_s": 60.0,
}


def instance(k: int) -> dict[str, Any]:
    role = "prefill" if k < 16 else "decode"
    state = "flipping" if k == 5 else "unhealthy" if k == 40 else "draining" if k == 41 else "active"
    cap = 3408
    used = (k * 397) % cap
    return {
        "id": f"worker-{k:02d}",
        "role": role,
        "state": state,
        "address": f"10.0.0.{k}:7000",
        "model": "facebook/opt-13b",
        "max_model_len": 2048,
        "queued": (k * 7) % 23,
        "running": (k * 5) % 17,
        "inflight": (k * 3) % 11,
        "kv_used_tokens": used,
        "kv_capacity_tokens": cap,
        "kv_usage": used / cap,
        "tokens_per_s": 100.0 + (k * 131) % 900,
        "preemptions": k % 4,
        "policy_version": 3,
        "last_report_age_s": 0.05,
    }


def request(i: int) -> dict[str, Any]:
    done = i % 10 != 0
    arrival = T0 + i * 0.05
    return {
        "id": f"req-{i:05d}",
        "model": "facebook/opt-13b",
        "phase": "done" if done else ("decode" if i % 20 else "prefill"),
        "status": ("finished" if i % 97 else "failed") if done else "running",
        "arrival_ts": arrival,
        "prefill_start_ts": arrival + 0.010,
        "first_token_ts": arrival + 0.120 + (i % 7) * 0.01,
        "decode_start_ts": arrival + 0.150 + (i % 7) * 0.01,
        "finished_ts": arrival + 2.0 + (i % 13) * 0.3 if done else None,
        "prompt_tokens": 18 + (i * 37) % 700,
        "max_tokens": 512,
        "output_tokens": 40 + (i * 53) % 400,
        "ttft_ms": 120.0 + (i % 7) * 10 if done else None,
        "jct_ms": 2000.0 + (i % 13) * 300 if done else None,
        "prefill_instance": f"worker-{i % 16:02d}",
        "decode_instance": f"worker-{16 + i % 48:02d}",
        "predicted_lo": 200 * ((40 + (i * 53) % 400) // 200) + 1,
        "predicted_hi": 200 * ((40 + (i * 53) % 400) // 200 + 1),
        "error": "worker worker-40 went away" if done and i % 97 == 0 else None,
    }


REQUESTS = [request(i) for i in reversed(range(N_REQUESTS))]  # newest first, as the daemon lists them


BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]  # the daemon's buckets


def _histogram(per_call: list[int], mean_s: float, calls: int) -> dict[str, Any]:
    """A daemon histogram after `calls` refreshes that each saw `per_call` (counts by bucket)."""
    counts = [n * calls for n in per_call]
    return {"bounds": BOUNDS, "counts": counts, "count": sum(counts), "sum": mean_s * sum(counts)}


def _cluster(calls: int) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for r in REQUESTS:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    return {
        "model": "facebook/opt-13b",
        "mode": "disaggregated",
        "uptime_s": 3600.0,
        "instances": {"prefill": {"total": 16, "active": 15}, "decode": {"total": 48, "active": 46}},
        "inflight": by_status.get("running", 0),
        "inflight_by_phase": {"decode": 500, "prefill": 500},
        "requests_by_status": by_status,
        "latency": {  # grows each call: the dashboard's window (between two refreshes) sees per_call
            "ttft_s": _histogram([0, 0, 0, 0, 3, 30, 6, 1, 0, 0, 0, 0, 0, 0, 0], 0.21, calls),
            "jct_s": _histogram([0, 0, 0, 0, 0, 0, 0, 2, 12, 20, 4, 2, 0, 0, 0], 4.6, calls),
            "itl_s": _histogram([0, 0, 0, 900, 80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0.048, calls),
        },
        "max_model_len": 2048,
    }


def _detail(rid: str) -> dict[str, Any] | None:
    i = int(rid.split("-")[1])
    if not 0 <= i < N_REQUESTS:
        return None
    r = request(i)
    points = [
        ("queued", "arrival_ts"),
        ("prefill", "prefill_start_ts"),
        ("first_token", "first_token_ts"),
        ("decode", "decode_start_ts"),
        ("done", "finished_ts"),
    ]
    return r | {"timeline": [{"phase": p, "ts": r[k]} for p, k in points if r[k] is not None]}


class Handler:
    """Answers the dashboard's calls; counts /cluster calls, so the latency histograms grow each one."""

    def __init__(self) -> None:
        self.cluster_calls = 0

    def __call__(self, req: httpx.Request) -> httpx.Response:
        if req.method == "GET" and req.url.path == "/api/v1/cluster":
            self.cluster_calls += 1
            return httpx.Response(200, json=_cluster(self.cluster_calls))
        return handle(req)


def handle(req: httpx.Request) -> httpx.Response:
    path, q = req.url.path, req.url.params
    if req.method == "GET" and path == "/api/v1/instances":
        return httpx.Response(200, json={"instances": [instance(k) for k in range(N_INSTANCES)]})
    if req.method == "GET" and path == "/api/v1/policies":
        return httpx.Response(200, json={"version": 3, "policies": POLICIES})
    if req.method == "GET" and path == "/api/v1/requests":
        rows = [r for r in REQUESTS if q.get("status") in (None, r["status"])]
        limit, offset = int(q.get("limit", 50)), int(q.get("offset", 0))
        return httpx.Response(
            200, json={"requests": rows[offset : offset + limit], "total": len(rows), "limit": limit, "offset": offset}
        )
    if req.method == "GET" and path.startswith("/api/v1/requests/"):
        doc = _detail(path.rsplit("/", 1)[1])
        if doc is not None:
            return httpx.Response(200, json=doc)
    body = {"error": {"message": f"no route {req.method} {path}", "type": "NotFoundError", "param": None}}
    return httpx.Response(404, content=json.dumps(body), headers={"content-type": "application/json"})


def transport() -> httpx.MockTransport:
    return httpx.MockTransport(Handler())
