"""What import-linter cannot see (pyproject's [tool.importlinter] has the static rules): the heavy
imports that must stay inside functions. `tetrictl` loads textual only for `top`, and the worker process
loads vllm only for `--engine vllm`."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import tetrictl.app, workers.main
print(",".join(sorted(m for m in ("textual", "vllm") if m in sys.modules)))
"""


def test_the_cli_and_the_worker_process_load_textual_and_vllm_only_when_used():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
