"""Driving an ASGI app by hand (messages in and out, no server), for the HTTP edge's own tests."""

from __future__ import annotations

import asyncio
from typing import Any

ASGIApp = Any


def drive(app: ASGIApp, scope: dict[str, Any], body: bytes, chunk: int) -> list[dict[str, Any]]:
    """Run one request through `app`, its body in `chunk`-byte messages; the messages it sent."""
    sent: list[dict[str, Any]] = []
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent


def reader(seen: dict[str, Any], status: int = 200, reply: bytes = b"{}") -> ASGIApp:
    """An app that reads the whole body, records it (and the path) in `seen`, and answers `status`."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got, more = b"", True
        while more:
            msg = await receive()
            got += msg.get("body", b"")
            more = msg.get("more_body", False)
        seen["path"], seen["body"] = scope.get("path"), got
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": reply})

    return app
