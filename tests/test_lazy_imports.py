"""What import-linter cannot see (pyproject's [tool.importlinter] has the static rules): the heavy
imports that must stay inside functions. `tetrictl` loads textual only for `top`, numpy and scipy only for
the commands that compute (`plan`, `bench`, `advise`, `profile`, `requests export`), matplotlib only to
draw, pydantic (the config models) only where a config is loaded; the worker process loads vllm only for
`--engine vllm`."""

from __future__ import annotations

import subprocess
import sys

import pytest

# pydantic: typer 0.29 validates every parameter through it, +70 ms a command (pyproject pins typer < 0.29)
HEAVY = ("textual", "vllm", "numpy", "scipy", "matplotlib", "pydantic")

CHECK = """
import sys
import tetrictl.app, workers.main
print(",".join(sorted(m for m in ("textual", "vllm") if m in sys.modules)))
"""

RUN = """
import sys
from tetrictl.app import app
try:
    app(sys.argv[1:], prog_name="tetrictl")
except SystemExit as e:
    code = e.code
print("\\nLOADED=" + ",".join(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def test_the_cli_and_the_worker_process_load_textual_and_vllm_only_when_used():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["status", "--json", "--url", "http://127.0.0.1:9"],  # nothing listens: exit 3, after the whole path
        ["instances", "ls", "--json", "--url", "http://127.0.0.1:9"],
        ["requests", "ls", "--json", "--url", "http://127.0.0.1:9"],
        ["flip-policy", "show", "--json", "--url", "http://127.0.0.1:9"],
        ["policy", "show", "--json", "--url", "http://127.0.0.1:9"],
        ["plan", "--help"],
        ["bench", "--help"],
        ["advise", "--help"],
        ["up", "--help"],
    ],
)
def test_light_commands_load_no_numerics_and_no_tui(argv: list[str]):
    code = RUN.format(heavy=HEAVY)
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    loaded = r.stdout.rsplit("LOADED=", 1)[-1].strip()
    assert "LOADED=" in r.stdout, r.stderr
    assert loaded == "", f"tetrictl {' '.join(argv)} imported {loaded}"
