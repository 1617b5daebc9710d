"""The daemon process: ``python -m daemon.main [--port 8000] …`` (or ``tetrictl daemon start``).

Prints one JSON line ``{"event": "ready", "url": …, "grpc": …}`` on stdout once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from tetri import eventloop
from tetri.children import die_with_parent
from tetri.config import ConfigError, DaemonSettings, check_daemon_settings, load_daemon_settings
from tetri.gcheap import freeze_startup_heap
from tetri.logsetup import configure_logging

from .app import create_app
from .build import tls_of
from .controller.edge import PortInUse, bind_control_plane
from .db.store import ensure_sqlite_parent_dir
from .front.asgi import OpenAIFront
from .front.gateway import Gateway
from .front.link import ControllerUnreachable, FrontLink, front_incarnation
from .http_timeouts import timed_protocol
from .supervisor import Supervisor

log = logging.getLogger("tetri.daemon")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM/SIGINT: admission stops (503 + Retry-After),
    in-flight requests run on for up to `grace_s`, the rest are interrupted (an error event on their
    stream, rows `interrupted: daemon shutdown`), then the server stops. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.draining = False
        self.drain: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gateway = getattr(self.app.state, "gateway", None)
        if self.draining or gateway is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self._captured_signals.append(sig)  # uvicorn re-raises it once stopped, as it does itself
        # a signal handler runs between any two bytecodes: hand over to the loop the safe way
        self.loop.call_soon_threadsafe(self._start_drain, gateway)

    def _start_drain(self, gateway: Gateway) -> None:
        self.drain = self.loop.create_task(self._drain(gateway))

    async def _drain(self, gateway: Gateway) -> None:
        try:
            await self._drain_requests(gateway)
        except Exception:
            log.exception("drain failed; stopping now")
        finally:
            self.should_exit = True

    async def _drain_requests(self, gateway: Gateway) -> None:
        gateway.begin_drain()
        await asyncio.sleep(0.1)  # requests admitted just before the flag reach `inflight`
        if gateway.inflight:
            log.warning("draining: %d request(s) in flight, up to %g s", len(gateway.inflight), self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while gateway.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if gateway.inflight:
            n = await gateway.interrupt_all("daemon shutdown")
            log.warning("drain grace over: interrupted %d request(s)", n)
            end = time.monotonic() + 5
            while gateway.inflight and time.monotonic() < end:
                await asyncio.sleep(0.02)


def _listen(host: str, port: int, shared: bool = False) -> socket.socket:
    """A listening TCP socket on host:port (as uvicorn would bind it; OSError when it cannot). `shared`:
    with SO_REUSEPORT, so the fronts on a host take the same port (the kernel spreads connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _error(message: str) -> None:
    print(json.dumps({"event": "error", "error": message}), flush=True)


@dataclass(frozen=True)
class Role:
    """What this process is: "daemon" (the whole control plane: both rooms), "controller" or "front"
    (`daemon.controller`, `daemon.front`). A front follows the controller at `controller` (gRPC host:port),
    named `front_name`, and listens on a port of its own (`front_port`, 0: any) besides the shared one."""

    name: str = "daemon"
    controller: str | None = None
    front_name: str = "front"
    front_port: int = 0


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"HTTP: cannot serve on {host}:{port} (in use); choose another port with --port"
    return f"HTTP: cannot serve on {host}:{port} ({(e.strerror or str(e)).lower()})"


async def serve(settings: DaemonSettings, mode: str = "disaggregated", role: Role = Role()) -> int:
    tls = tls_of(settings)
    front = role.name == "front"
    link = None
    if front:  # a front listens once it has the controller's view: without one, one line and exit 2
        assert role.controller is not None
        link = FrontLink(role.controller, front_incarnation(role.front_name), settings.grpc_token(), tls)
        try:
            await link.first(settings.front_connect_s)
        except ControllerUnreachable as e:
            await link.close()
            _error(str(e))
            return 2
    grpc_server = None
    if not front:
        try:  # bind the gRPC port first: one in use is an error before anything starts
            grpc_server = bind_control_plane(settings.grpc_host, settings.grpc_port, settings.grpc_token(), tls)
        except PortInUse as e:
            _error(f"control-plane gRPC: {e}")
            return 2
    socks: list[socket.socket] = []
    try:  # and the HTTP port(s), ourselves: uvicorn reports a busy port with a traceback
        socks.append(_listen(settings.host, settings.port, shared=front))
        if front:
            socks.append(_listen(settings.host, role.front_port))
    except OSError as e:
        for sock in socks:
            sock.close()
        if grpc_server is not None:
            await grpc_server.stop(0)
        if link is not None:
            await link.close()
        _error(_bind_error(settings.host, role.front_port if socks else settings.port, e))
        return 2
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    scheme = "https" if settings.tls_cert_file else "http"
    urls = [f"{scheme}://{host}:{sock.getsockname()[1]}" for sock in socks]
    app = create_app(settings, mode, grpc_server, role.name, link)
    app.state.url = urls[-1]
    config = uvicorn.Config(
        app if role.name == "controller" else OpenAIFront(app, settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go where ours go (--log-file, --log-format)
        lifespan="on",
        access_log=False,
        http=timed_protocol(settings.http_header_timeout_s, settings.http_body_timeout_s),
        timeout_graceful_shutdown=2,
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
    )
    server = DrainingServer(config, app, settings.drain_grace_s)

    async def run_server() -> None:
        with contextlib.suppress(SystemExit):  # uvicorn exits the process when its start-up fails: not here
            await server.serve(sockets=socks)

    task = asyncio.create_task(run_server())
    while not server.started:
        if task.done():  # the start-up failed (the lifespan logged why)
            for sock in socks:
                sock.close()
            if grpc_server is not None:
                await grpc_server.stop(0)
            _error(f"the {role.name}'s start-up failed (the log says why)")
            return 2
        await asyncio.sleep(0.02)
    freeze_startup_heap()
    ready: dict[str, Any] = {"event": "ready", "url": urls[0], "role": role.name}
    if front:
        assert link is not None
        ready |= {"front_url": urls[1], "front": link.front_id, "controller": role.controller}
        ready["time_scale"] = app.state.cluster.clock.scale
    else:
        ready["grpc"] = f"{settings.grpc_host}:{app.state.grpc_port}"
        ready["time_scale"] = settings.time_scale
    ready |= {"recovered_interrupted": app.state.recovered, "event_loop": eventloop.running()}
    print(json.dumps(ready), flush=True)
    if front:
        log.info("serving on %s and %s (a front of the controller at %s)", urls[0], urls[1], role.controller)
    else:
        log.info("serving on %s (gRPC %s; %s)", urls[0], ready["grpc"], role.name)
    await task  # (uvicorn re-raises a captured SIGTERM after this: the lifespan logs the stop)
    return 0


def _policy_args(args: list[str]) -> dict[str, Any]:
    """`--policy FIELD=VALUE` flags as a dict; a VALUE that reads as JSON (a number, true) is that value."""
    out: dict[str, Any] = {}
    for arg in args:
        field, eq, value = arg.partition("=")
        if not eq or not field.strip():
            raise ConfigError(f"--policy {arg!r}: expected FIELD=VALUE")
        try:
            out[field.strip()] = json.loads(value)
        except ValueError:
            out[field.strip()] = value
    return out


_OWN_FLAGS = {"--fronts", "--port", "--grpc-port", "--role"}  # the supervisor sets these per child (one value each)


def _passed_on(argv: list[str] | None) -> list[str]:
    """The command line without the flags the supervisor sets for each child."""
    args, out = list(sys.argv[1:] if argv is None else argv), []
    while args:
        arg = args.pop(0)
        flag = arg.split("=", 1)[0]
        if flag in _OWN_FLAGS:
            if "=" not in arg:
                del args[:1]
            continue
        out.append(arg)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Run the Tetri control-plane daemon.")
    ap.add_argument("--config", type=Path)
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--grpc-host")
    ap.add_argument("--grpc-port", type=int)
    ap.add_argument("--state-dir", type=Path)
    ap.add_argument("--db-url")
    ap.add_argument("--token")
    ap.add_argument("--time-scale", type=float, help="The cluster clock: model seconds per wall second.")
    ap.add_argument(
        "--stream-interval", type=int, help="Streamed answers: an SSE event per N tokens (default 1: every step)."
    )
    ap.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated", "hybrid"])
    ap.add_argument(
        "--fronts",
        type=int,
        metavar="N",
        help="Run the control plane as a controller and N fronts sharing the HTTP port (docs/cluster.md).",
    )
    ap.add_argument("--role", default="daemon", choices=["daemon", "controller", "front"], help=argparse.SUPPRESS)
    ap.add_argument("--controller", metavar="HOST:PORT", help="A front: the controller's gRPC address.")
    ap.add_argument("--front-name", default="front", help="A front: its name (its rows carry NAME.PID.RANDOM).")
    ap.add_argument("--front-port", type=int, default=0, help="A front: its own HTTP port besides --port (0: any).")
    ap.add_argument("--resume-policies", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="A runtime policy the cluster starts with (repeatable), e.g. colocated_schedule=vllm-v1.",
    )
    ap.add_argument(
        "--expect-model",
        action="append",
        metavar="NAME",
        help="A model this cluster is starting (repeatable): until it registers, requests for it get 503, not 404.",
    )
    ap.add_argument("--log-level", help="debug, info, warning (the default) or error.")
    ap.add_argument("--log-file", help="Append the log to this file (default: stderr).")
    ap.add_argument("--log-format", help="text (the default) or json: one object a line.")
    ap.add_argument("--profile", help="The cluster's cost profile: what the advise flip policy simulates.")
    ap.add_argument("--profiles-file", help="Read --profile from this file (`tetrictl profile` writes one).")
    ap.add_argument(
        "--slo",
        action="append",
        metavar="SPEC",
        help="SLOs the advise flip policy scores against (repeatable): ttft=1,tpot=0.1 or HPLD:ttft=5.",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        settings = load_daemon_settings(
            a.config,
            host=a.host,
            port=a.port,
            grpc_host=a.grpc_host,
            grpc_port=a.grpc_port,
            state_dir=a.state_dir,
            db_url=a.db_url,
            token=a.token,
            time_scale=a.time_scale,
            stream_interval=a.stream_interval,
            expect_models=a.expect_model,
            profile=a.profile,
            profiles_file=a.profiles_file,
            slo=a.slo,
            log_level=a.log_level,
            log_file=a.log_file,
            log_format=a.log_format,
            resume_policies=a.resume_policies or None,
        )
        if a.policy:  # over the configured ones, as every flag is
            settings = settings.model_copy(update={"policies": settings.policies | _policy_args(a.policy)})
            check_daemon_settings(settings)
        try:
            ensure_sqlite_parent_dir(settings.database_url())
        except OSError as e:
            raise ConfigError(f"[daemon] state_dir: cannot create the database's directory: {e.strerror}") from None
        loop = eventloop.chosen()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.fronts is not None:
        if a.fronts < 1:
            print("error: --fronts must be at least 1", file=sys.stderr)
            return 2
        ports = (settings.host, settings.port, settings.grpc_port)
        return Supervisor(_passed_on(argv), a.fronts, *ports, settings.drain_grace_s).run()
    if a.role == "front" and not a.controller:
        print("error: a front needs --controller HOST:PORT (the controller's gRPC address)", file=sys.stderr)
        return 2
    role = Role(a.role, a.controller, a.front_name, a.front_port)
    try:
        configure_logging(settings.log_level, settings.log_file, settings.log_format, a.role)
    except OSError as e:
        print(f"error: [daemon] log_file: cannot open {settings.log_file}: {e.strerror}", file=sys.stderr)
        return 2
    code = 0
    with contextlib.suppress(KeyboardInterrupt):
        code = eventloop.run(serve(settings, a.mode, role), loop)
    return code


if __name__ == "__main__":
    die_with_parent()
    raise SystemExit(main())
