"""The event loop the daemon and workers run on (tetri/eventloop.py): chosen by TETRI_EVENT_LOOP, uvloop by
default; a bad value is a one-line error and exit 2 before anything starts. (Each loop serving end to end:
tests/cluster/test_e2e.py, whose disaggregated cluster runs uvloop and colocated cluster asyncio.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop

from tetri import eventloop


@pytest.mark.parametrize(
    ("value", "want"), [(None, "uvloop"), ("", "uvloop"), (" UVLOOP ", "uvloop"), ("asyncio", "asyncio")]
)
def test_chosen(monkeypatch: pytest.MonkeyPatch, value: str | None, want: str) -> None:
    if value is None:
        monkeypatch.delenv(eventloop.ENV, raising=False)
    else:
        monkeypatch.setenv(eventloop.ENV, value)
    assert eventloop.chosen() == want


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "tokio")
    with pytest.raises(eventloop.EventLoopError, match="TETRI_EVENT_LOOP='tokio': expected one of uvloop, asyncio"):
        eventloop.chosen()


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_run_runs_on_the_named_loop(name: str) -> None:
    async def probe() -> tuple[str, type]:
        await asyncio.sleep(0)
        return eventloop.running(), type(asyncio.get_running_loop())

    running, cls = eventloop.run(probe(), name)
    assert running == name
    assert (cls is uvloop.Loop) == (name == "uvloop")


@pytest.mark.parametrize(
    ("module", "args"), [("daemon.main", ["--port", "0"]), ("workers.main", ["--role", "prefill"])]
)
def test_processes_refuse_a_bad_value_in_one_line(module: str, args: list[str], tmp_path) -> None:
    env = {"PATH": "/usr/bin:/bin", eventloop.ENV: "tokio", "HOME": str(tmp_path)}
    if module == "daemon.main":
        args = [*args, "--state-dir", str(tmp_path)]
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == ["error: TETRI_EVENT_LOOP='tokio': expected one of uvloop, asyncio"]
    assert not list(tmp_path.glob("*.db"))  # nothing started, nothing written
