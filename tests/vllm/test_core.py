"""vLLM's engine core read by the worker's own loop (`workers/engines/vllm/core.py`), on a real vLLM colocated
engine: `generate_to` and the `generate` iterator give the same tokens; a request whose sink fails ends
alone; `abort` ends a running request. vLLM on the CPU, a tiny random-weight Llama written at test time, the
engine in a child process (tests/vllm/core_scenario.py)."""

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


def test_the_core_loop_streams_isolates_a_failing_request_and_aborts(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    script = Path(__file__).with_name("core_scenario.py")
    cmd = [sys.executable, str(script), str(model)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"same": True, "fault": True, "aborted": True}
