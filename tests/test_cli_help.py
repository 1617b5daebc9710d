"""`tetrictl --version` and help text as a user reads it: plain text, nothing eaten as markup."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = tetrictl("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tetrictl {version('tetri')}"


def test_help_keeps_bracketed_text():
    status = tetrictl("status", "--help")
    assert status.returncode == 0 and "[ctl] table" in " ".join(status.stdout.split())
    up = tetrictl("up", "--help")
    assert up.returncode == 0 and "([daemon], [worker])" in up.stdout
    top = tetrictl("--help")
    assert top.returncode == 0 and "--version" in top.stdout and "plan" in top.stdout
