"""The architecture's import rules: daemon and workers never load textual (nor vllm outside its engine);
tetrictl loads textual only for `top`."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import daemon.app, daemon.main, workers.main, workers.service, tetrictl.app
bad = sorted(m for m in ("textual", "vllm") if m in sys.modules)
print(",".join(bad))
"""


def test_daemon_workers_and_the_cli_do_not_load_textual_or_vllm():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
