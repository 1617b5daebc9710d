"""Starting Tetri processes (daemon, workers) as children and reading their one-line ready report."""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tetri.children import StartError, spawn, stop_all, wait_ready

__all__ = ["LocalCluster", "StartError", "spawn", "start_local_cluster", "stop_all", "wait_ready"]


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
    ready: dict[str, Any] = field(default_factory=dict)  # the daemon's ready report
    worker_timeout: float = 60.0  # seconds a worker may take to report ready (a vLLM engine: minutes)

    def start_worker(self, args: list[str]) -> dict[str, Any]:
        proc = spawn("workers.main", args, self.env)
        self.procs.append(proc)
        self.worker_args.append(args)
        info = wait_ready(proc, "worker", self.worker_timeout)
        self.workers.append(info)
        return info

    def restart_worker(self, i: int) -> dict[str, Any]:
        """Start worker `i` again (it exited): a new process on a new port, so a new instance id."""
        old = self.procs[i]
        if old.stdout is not None:
            old.stdout.close()
        proc = spawn("workers.main", self.worker_args[i - 1], self.env)
        self.procs[i] = proc
        info = wait_ready(proc, "worker", self.worker_timeout)
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
    fronts: int = 0,
    stream_interval: int | None = None,
    worker_args: list[str] | None = None,
    worker_timeout: float = 60.0,
    expect_models: list[str] | None = None,
) -> LocalCluster:
    """Start the daemon, then one worker per role, each waited for; on failure nothing is left running.
    Daemon and workers run the same `time_scale` (one cluster clock: docs/cluster.md). `policies`: the
    runtime policies the cluster starts with (the daemon's `--policy FIELD=VALUE`). `log_args`: `--log-level`,
    `--log-file`, `--log-format` flags for every process (they may share one file). `fronts`: N > 0 runs the
    daemon as a controller and N fronts (`daemon.main --fronts N`; its ready report lists them).
    `stream_interval`: an SSE event per N tokens (the daemon's `--stream-interval`). `worker_args`: more
    flags for every worker (`--engine vllm --model DIR …`), which may take `worker_timeout` seconds to start.
    `expect_models`: the models the workers serve, which the daemon answers 503 for (not 404) until they
    register."""
    dargs = ["--port", str(port), "--grpc-port", str(grpc_port), "--state-dir", str(state_dir), "--mode", mode]
    dargs += ["--time-scale", str(time_scale), "--profile", profile]  # the advise flip policy's model
    for name, value in (policies or {}).items():
        dargs += ["--policy", f"{name}={value}"]
    if config is not None:
        dargs += ["--config", str(config)]
    dargs += log_args or []
    if fronts:
        dargs += ["--fronts", str(fronts)]
    if stream_interval is not None:
        dargs += ["--stream-interval", str(stream_interval)]
    for name in expect_models or ():
        dargs += ["--expect-model", name]
    # one random cluster token per cluster: every gRPC call between its processes carries it, so no
    # other local process can drive its workers (the environment, not argv: `ps` shows argv)
    token = secrets.token_urlsafe(24)
    env = {"TETRI_DAEMON_CLUSTER_TOKEN": token, "TETRI_WORKER_TOKEN": token}
    procs = [spawn("daemon.main", dargs, env)]
    try:
        ready = wait_ready(procs[0], "daemon")
        cluster = LocalCluster(ready["url"], ready["grpc"], procs, env=env, ready=ready, worker_timeout=worker_timeout)
        for role in roles:
            wargs = ["--role", role, "--daemon", ready["grpc"], "--profile", profile, "--time-scale", str(time_scale)]
            if config is not None:
                wargs += ["--config", str(config)]
            wargs += (log_args or []) + (worker_args or [])
            cluster.start_worker(wargs)
        for front in ready.get("fronts", []):  # each has the workers in its view of the controller's
            _wait_ready_http(front["url"], f"front {front['name']}")
    except BaseException:
        stop_all(procs)
        raise
    return cluster


def _wait_ready_http(url: str, what: str, timeout: float = 30.0) -> None:
    """Until `url`/readyz answers 200 (the process can serve a request); StartError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise StartError(f"{what} at {url} was not ready within {timeout:.0f} s")
        time.sleep(0.05)
