"""vLLM's engine core read by the worker's own loop (`workers/engines/vllm/core.py`), on a real vLLM colocated
engine: `generate_to` and the `generate` iterator give the same tokens; a request whose sink fails ends
alone; `abort` ends a running request. vLLM on the CPU, a tiny random-weight Llama written at test time, the
engine in a child process (tests/vllm/core_scenario.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm import need_vllm, run_scenario

need_vllm()

pytestmark = pytest.mark.slow


def test_the_core_loop_streams_isolates_a_failing_request_and_aborts(tmp_path: Path) -> None:
    got = run_scenario(tmp_path, "core_scenario.py")
    assert got == {"same": True, "fault": True, "aborted": True}
