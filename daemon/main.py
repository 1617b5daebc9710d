"""The daemon process: ``python -m daemon.main [--port 8000] …`` (or ``tetrictl daemon start``).

Prints one JSON line ``{"event": "ready", "url": …, "grpc": …}`` on stdout once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path

import uvicorn

from tetri.config import ConfigError, DaemonSettings, load_daemon_settings

from .app import create_app


async def serve(settings: DaemonSettings, mode: str = "disaggregated") -> None:
    app = create_app(settings, mode)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            raise SystemExit(1)
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(
        json.dumps(
            {
                "event": "ready",
                "url": f"http://{host}:{port}",
                "grpc": f"{settings.grpc_host}:{app.state.grpc_port}",
                "recovered_interrupted": app.state.recovered,
                "time_scale": settings.time_scale,
            }
        ),
        flush=True,
    )
    await task


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the Tetri control-plane daemon.")
    ap.add_argument("--config", type=Path)
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--grpc-host")
    ap.add_argument("--grpc-port", type=int)
    ap.add_argument("--state-dir", type=Path)
    ap.add_argument("--db-url")
    ap.add_argument("--token")
    ap.add_argument("--model")
    ap.add_argument("--time-scale", type=float, help="The cluster clock: model seconds per wall second.")
    ap.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    a = ap.parse_args(argv)
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
            model=a.model,
            time_scale=a.time_scale,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, a.mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
