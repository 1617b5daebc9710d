"""Child processes of Tetri's own (a daemon's fronts, `tetrictl up`'s daemon and workers): started with
a pipe on stdout, dying with their parent, and read until their one-line JSON ready report."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import IO, Any


class StartError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the process that started it dies, even by SIGKILL, so a
    killed `tetrictl up` (or test run) never leaves a cluster behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(
    module: str, args: list[str], env_extra: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        process_group=0,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def wait_ready(proc: subprocess.Popen[str], what: str, timeout: float = 60.0) -> dict[str, Any]:
    """Read the child's stdout until its {"event": "ready"} line (or an error / exit / timeout)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                raise StartError(f"{what} exited with code {proc.wait()} before it was ready")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "ready":
                return dict(msg)
            if msg.get("event") == "error":
                raise StartError(f"{what}: {msg.get('error')}")
        raise StartError(f"{what} was not ready within {timeout:.0f} s")
    finally:
        sel.close()


def stop_all(procs: list[subprocess.Popen[str]], grace: float = 5.0) -> None:
    """SIGTERM every child (workers first, daemon last), then SIGKILL what is left after `grace`."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()
