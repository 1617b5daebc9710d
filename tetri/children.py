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


PARENT_ENV = "TETRI_DIE_WITH_PARENT"  # the pid of the process a child started by `spawn` dies with


def die_with_parent() -> None:
    """In a child `spawn` started (its `__main__` calls this first), on Linux: SIGTERM when the parent
    dies, even by SIGKILL, so a killed `tetrictl up` (or test run) never leaves a cluster behind. Asked for
    here, after exec, not between fork and exec: Python code there (a preexec_fn) can run finalizers of the
    parent's gRPC objects in the forked copy, and gRPC aborts it (a worker that exits with SIGABRT before
    it is ready, once in a while, when the parent holds gRPC channels)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(
    module: str, args: list[str], env_extra: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> subprocess.Popen[str]:
    """`python -m module args…` with a pipe on stdout, in its own process group; it dies with this process
    (`die_with_parent`, which the module's `__main__` calls)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env[PARENT_ENV] = str(os.getpid())
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        process_group=0,
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
