"""`queue_order` srpt on a real vLLM colocated engine: started with vLLM's priority scheduling policy
(`scheduling_policy = "priority"`), the engine hands each request to vLLM with the srpt key as its priority,
so with one sequence at a time the request predicted to be short starts before one predicted to be long
that came first; fcfs keeps arrival order (every priority the same). vLLM on the CPU, a tiny random-weight
Llama written at test time, the engine in a child process (tests/vllm/priority_scenario.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm import need_vllm

need_vllm()

pytestmark = pytest.mark.slow


def test_srpt_reorders_vllms_waiting_requests_by_predicted_work(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    script = Path(__file__).with_name("priority_scenario.py")
    cmd = [sys.executable, str(script), str(model)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"fcfs": ["hold", "long", "short"], "srpt": ["hold", "short", "long"], "left": []}
