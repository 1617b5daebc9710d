"""`tetrictl up --mode colocated --baseline NAME`: the colocated instances run that schedule from their
first request (the daemon starts with the policy, the workers acknowledge it), and requests are served."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from .harness import stop_up, tetrictl_up

pytestmark = pytest.mark.slow


def test_tetrictl_up_runs_the_colocated_instances_as_vllm_v1(tmp_path: Path) -> None:
    args = ["--mode", "colocated", "--colocated", "1", "--baseline", "vllm-v1", "--port", "0", "--grpc-port", "0"]
    args += ["--state-dir", str(tmp_path), "--profile", "tiny", "--time-scale", "50"]
    p, doc = tetrictl_up(args)
    try:
        assert (doc["mode"], doc["baseline"], [w["role"] for w in doc["workers"]]) == (
            "colocated",
            "vllm-v1",
            ["colocated"],
        )
        with httpx.Client(base_url=doc["url"], timeout=30) as h:
            assert h.get("/api/v1/policies").json()["policies"]["colocated_schedule"] == "vllm-v1"
            (audit,) = h.get("/api/v1/policies/history").json()["changes"]  # the start is audited too
            assert (audit["field"], audit["new_value"], audit["requested_by"]) == (
                "colocated_schedule",
                '"vllm-v1"',
                "daemon config",
            )
            deadline = time.monotonic() + 10
            while {i["policy_version"] for i in h.get("/api/v1/instances").json()["instances"]} != {1}:
                assert time.monotonic() < deadline, "the worker never acknowledged the starting policies"
                time.sleep(0.05)

            def ask(n: int) -> dict:
                body = {"model": "tetri-sim", "prompt": list(range(1, 300 + n)), "max_tokens": 24}
                return h.post("/v1/completions", json=body).json()

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(8)))
        assert [a["usage"]["completion_tokens"] for a in answers] == [24] * 8
    finally:
        stop_up(p)
