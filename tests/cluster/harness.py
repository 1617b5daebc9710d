"""Real processes on loopback for end-to-end tests: a daemon and sim workers on free ports."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from daemon.db.store import Store, make_engine
from tetrictl.procs import spawn, stop_all, wait_ready


def wait_for(predicate, timeout: float = 20.0) -> None:
    """Poll `predicate` every 50 ms until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def all_rows(db_url: str) -> dict[str, dict]:
    """Every request row in the status table at `db_url`, by id."""
    store = Store(make_engine(db_url))
    try:
        return {r["id"]: r for r in store.list_requests(None, None, 100_000, 0)[0]}
    finally:
        store.close()


@dataclass
class LiveCluster:
    url: str
    grpc: str
    state_dir: Path
    daemon: subprocess.Popen[str]
    workers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)  # instance id -> process
    token: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every process started
    ready: dict = field(default_factory=dict)  # the daemon's ready line
    worker_ready: dict[str, dict] = field(default_factory=dict)  # instance id -> the worker's ready line
    db: str | None = None  # the daemon's --db-url; None: SQLite in the state directory

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{(self.state_dir / 'tetri.db').as_posix()}"

    def add_worker(
        self,
        role: str,
        profile: str = "tiny",
        time_scale: float = 50.0,
        token: str | None = None,
        expect_ready: bool = True,
        extra: list[str] | None = None,
    ) -> tuple[subprocess.Popen[str], dict]:
        args = ["--role", role, "--daemon", self.grpc, "--profile", profile, "--time-scale", str(time_scale)]
        tok = token if token is not None else self.token
        if tok:
            args += ["--token", tok]
        p = spawn("workers.main", args + (extra or []), self.env)
        if not expect_ready:
            return p, {}
        info = wait_ready(p, f"{role} worker")
        self.workers[info["instance_id"]] = p
        self.worker_ready[info["instance_id"]] = info
        return p, info

    def started_as(self, role: str) -> list[str]:
        """Ids (sorted) of the workers started in `role`; ids name no role, the ready lines do."""
        return sorted(i for i in self.workers if self.worker_ready[i]["role"] == role)

    def stop(self) -> None:
        stop_all([self.daemon, *self.workers.values()])


def start_cluster(
    state_dir: Path,
    roles: list[str],
    *,
    mode: str = "disaggregated",
    profile: str = "tiny",
    time_scale: float = 50.0,
    token: str | None = None,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    daemon_stderr: IO[str] | None = None,
    daemon_profile: bool = True,
    db_url: str | None = None,
    daemon_args: list[str] | None = None,
) -> LiveCluster:
    args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(state_dir), "--mode", mode, "--host", host]
    args += daemon_args or []
    if db_url is not None:
        args += ["--db-url", db_url]
    args += ["--time-scale", str(time_scale)]  # one cluster clock: the daemon runs the workers' scale
    if daemon_profile:  # the workers' profile, as `tetrictl up` passes it (the advise flip policy's model)
        args += ["--profile", profile]
    if token:
        args += ["--token", token]
    daemon = spawn("daemon.main", args, env, daemon_stderr)
    ready = wait_ready(daemon, "daemon")
    cluster = LiveCluster(
        ready["url"], ready["grpc"], state_dir, daemon, token=token, env=dict(env or {}), ready=ready, db=db_url
    )
    try:
        for role in roles:
            cluster.add_worker(role, profile, time_scale)
    except Exception:
        cluster.stop()
        raise
    return cluster


def tetrictl_up(args: list[str], timeout: float = 60.0) -> tuple[subprocess.Popen[str], dict]:
    """`tetrictl up … --json` in a child process and its JSON document (url, mode, workers …)."""
    p = spawn("tetrictl.app", ["up", *args, "--json"])
    text = ""
    deadline = time.monotonic() + timeout
    try:
        while True:
            text += p.stdout.readline()  # type: ignore[union-attr]
            try:
                return p, json.loads(text)
            except json.JSONDecodeError:
                assert time.monotonic() < deadline and p.poll() is None, text
    except BaseException:
        stop_up(p)
        raise


def stop_up(p: subprocess.Popen[str]) -> None:
    """SIGTERM first: `up` stops its children (SIGKILL would orphan them)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if p.stdout is not None:
        p.stdout.close()
