"""Starting Tetri processes (daemon, workers) as children and reading their one-line ready report."""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass
class LocalCluster:
    """A daemon and its workers started as children on this host (`tetrictl up`, the benches).
    `procs[0]` is the daemon; `procs[i]` (i ≥ 1) runs `worker_args[i - 1]`."""

    url: str
    grpc: str
    procs: list[subprocess.Popen[str]]
    workers: list[dict[str, Any]] = field(default_factory=list)  # each worker's ready report
    worker_args: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the cluster token, passed to every child

    def start_worker(self, args: list[str]) -> dict[str, Any]:
        proc = spawn("workers.main", args, self.env)
        self.procs.append(proc)
        self.worker_args.append(args)
        info = wait_ready(proc, "worker")
        self.workers.append(info)
        return info

    def restart_worker(self, i: int) -> dict[str, Any]:
        """Start worker `i` again (it exited): a new process on a new port, so a new instance id."""
        old = self.procs[i]
        if old.stdout is not None:
            old.stdout.close()
        proc = spawn("workers.main", self.worker_args[i - 1], self.env)
        self.procs[i] = proc
        info = wait_ready(proc, "worker")
        self.workers[i - 1] = info
        return info

    def stop(self, drain_s: float = 35.0) -> None:
        """The daemon first: SIGTERM makes it drain (in-flight requests finish on the still-running
        workers, up to its drain_grace_s), waited for up to `drain_s`; then the workers."""
        stop_all(self.procs[:1], grace=drain_s)
        stop_all(self.procs[1:])


def start_local_cluster(
    roles: list[str],
    *,
    state_dir: Path,
    profile: str,
    time_scale: float,
    mode: str = "disaggregated",
    port: int = 0,
    grpc_port: int = 0,
    config: Path | None = None,
    policies: dict[str, str] | None = None,
    log_args: list[str] | None = None,
) -> LocalCluster:
    """Start the daemon, then one worker per role, each waited for; on failure nothing is left running.
    Daemon and workers run the same `time_scale` (one cluster clock: docs/cluster.md). `policies`: the
    runtime policies the cluster starts with (the daemon's `--policy FIELD=VALUE`). `log_args`: `--log-level`,
    `--log-file`, `--log-format` flags for every process (they may share one file)."""
    dargs = ["--port", str(port), "--grpc-port", str(grpc_port), "--state-dir", str(state_dir), "--mode", mode]
    dargs += ["--time-scale", str(time_scale), "--profile", profile]  # the advise flip policy's model
    for name, value in (policies or {}).items():
        dargs += ["--policy", f"{name}={value}"]
    if config is not None:
        dargs += ["--config", str(config)]
    dargs += log_args or []
    # one random cluster token per cluster: every gRPC call between its processes carries it, so no
    # other local process can drive its workers (the environment, not argv: `ps` shows argv)
    token = secrets.token_urlsafe(24)
    env = {"TETRI_DAEMON_CLUSTER_TOKEN": token, "TETRI_WORKER_TOKEN": token}
    procs = [spawn("daemon.main", dargs, env)]
    try:
        ready = wait_ready(procs[0], "daemon")
        cluster = LocalCluster(ready["url"], ready["grpc"], procs, env=env)
        for role in roles:
            wargs = ["--role", role, "--daemon", ready["grpc"], "--profile", profile, "--time-scale", str(time_scale)]
            if config is not None:
                wargs += ["--config", str(config)]
            wargs += log_args or []
            cluster.start_worker(wargs)
    except BaseException:
        stop_all(procs)
        raise
    return cluster
