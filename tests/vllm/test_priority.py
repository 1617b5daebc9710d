"""`queue_order` srpt on a real vLLM colocated engine: started with vLLM's priority scheduling policy
(`scheduling_policy = "priority"`), the engine hands each request to vLLM with the srpt key as its priority,
so with one sequence at a time the request predicted to be short starts before one predicted to be long
that came first; fcfs keeps arrival order (every priority the same). vLLM on the CPU, a tiny random-weight
Llama written at test time, the engine in a child process (tests/vllm/priority_scenario.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm import need_vllm, run_scenario

need_vllm()

pytestmark = pytest.mark.slow


def test_srpt_reorders_vllms_waiting_requests_by_predicted_work(tmp_path: Path) -> None:
    got = run_scenario(tmp_path, "priority_scenario.py")
    assert got == {"fcfs": ["hold", "long", "short"], "srpt": ["hold", "short", "long"], "left": []}
