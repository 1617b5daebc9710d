"""`python -m daemon.main --fronts N` (`tetrictl daemon start --fronts N`, `tetrictl up --fronts N`): the
control plane as one controller and N fronts on this host, each its own process, kept running.

The fronts share the HTTP port (SO_REUSEPORT: the kernel spreads connections over them) and each also
listens on a port of its own (its `url` in the ready report). The controller serves the workers' gRPC
port and the admin API on a port of its own. A child that dies is started again: a front under a new
incarnation id (the controller ends its predecessor's running rows), the controller on the same ports with
the policies last in force (`--resume-policies`), its fronts serving on their last view meanwhile and the
workers re-registering by themselves. This process only watches: it serves nothing, so killing it stops
the cluster (its children die with it) but no request passes through it.

Prints one JSON line `{"event": "ready", "url": …, "grpc": …, "controller": {…}, "fronts": [{…}, …]}`
once every child is ready, then `{"event": "restarted", …}` for each child started again.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from tetri.children import StartError, spawn, stop_all, wait_ready

MAX_RESTARTS = 10  # restarts within RESTART_WINDOW_S after which the supervisor gives up
RESTART_WINDOW_S = 60.0


def reserve_shared_port(host: str, port: int) -> socket.socket:
    """Hold `host:port` (0: a free one) for the fronts: a socket bound with SO_REUSEPORT but not listening,
    so it takes no connection, and no process of another user can take the port between front restarts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:  # free, not merely shareable: another cluster's fronts on it would take half the connections
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class Child:
    kind: str  # "controller" | "front"
    name: str
    args: list[str]
    proc: subprocess.Popen[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)

    def start(self, timeout: float = 120.0) -> dict[str, Any]:
        self.proc = spawn("daemon.main", self.args)
        self.ready = wait_ready(self.proc, f"{self.kind} {self.name}", timeout)
        return self.ready

    def summary(self) -> dict[str, Any]:
        assert self.proc is not None
        out = {"name": self.name, "pid": self.proc.pid, "url": self.ready.get("front_url") or self.ready["url"]}
        if self.kind == "controller":
            out["grpc"] = self.ready["grpc"]
        return out


class Supervisor:
    def __init__(self, common: list[str], fronts: int, host: str, port: int, grpc_port: int, grace_s: float) -> None:
        self.common = common
        self.grace_s = grace_s
        self.n = fronts
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self.stopping = False
        self.children: list[Child] = []
        self.restarts: list[float] = []

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        try:
            shared = reserve_shared_port(self.host, self.port)
        except OSError as e:
            _say({"event": "error", "error": f"HTTP: cannot serve on {self.host}:{self.port} ({e.strerror})"})
            return 2
        port = shared.getsockname()[1]
        controller = Child("controller", "controller", [*self.common, "--role", "controller", "--port", "0"])
        controller.args += ["--grpc-port", str(self.grpc_port)]
        try:
            ready = controller.start()
            self.children.append(controller)
            # a restarted controller takes the same ports: the workers and fronts find it where it was
            ctl_port = ready["url"].rsplit(":", 1)[1]
            grpc = ready["grpc"]
            controller.args = [*self.common, "--role", "controller", "--resume-policies"]
            controller.args += ["--port", ctl_port, "--grpc-port", grpc.rsplit(":", 1)[1]]
            for i in range(self.n):
                front = Child("front", f"front-{i}", [*self.common, "--role", "front", "--controller", grpc])
                front.args += ["--front-name", f"front-{i}", "--port", str(port), "--front-port", "0"]
                front.start()
                self.children.append(front)
        except StartError as e:
            _say({"event": "error", "error": str(e)})
            self._shutdown()
            return 2
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        scheme = ready["url"].split(":", 1)[0]
        _say(
            {
                "event": "ready",
                "url": f"{scheme}://{host}:{port}",
                "grpc": grpc,
                "controller": controller.summary(),
                "fronts": [c.summary() for c in self.children if c.kind == "front"],
                "time_scale": ready.get("time_scale"),
                "event_loop": ready.get("event_loop"),
                "recovered_interrupted": 0,
            }
        )
        code = self._watch()
        self._shutdown()
        shared.close()
        return code

    def _watch(self) -> int:
        while not self.stopping:
            for child in self.children:
                assert child.proc is not None
                if self.stopping or child.proc.poll() is None:
                    continue
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if t > now - RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    _say({"event": "error", "error": f"{len(self.restarts)} restarts in {RESTART_WINDOW_S:.0f} s"})
                    return 1
                code = child.proc.returncode
                if child.proc.stdout is not None:
                    child.proc.stdout.close()
                try:
                    child.start()
                except StartError as e:
                    _say({"event": "error", "error": f"restarting {child.name}: {e}"})
                    time.sleep(min(5.0, 0.5 * len(self.restarts)))  # then again, within the restart budget
                    continue
                _say({"event": "restarted", "kind": child.kind, "exit_code": code} | child.summary())
            time.sleep(0.1)
        return 0

    def _shutdown(self) -> None:
        """The fronts first (each drains its in-flight requests), then the controller."""
        fronts = [c.proc for c in self.children if c.kind == "front" and c.proc is not None]
        stop_all(fronts, grace=self.grace_s + 5)
        stop_all([c.proc for c in self.children if c.kind == "controller" and c.proc is not None])


def _say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)
