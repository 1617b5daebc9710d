"""The HTTP edge's guards: a body-size limit (413), strings that are valid UTF-8 (a JSON `\\ud800`
escape decodes to a lone surrogate no database or client can store: 400), the error codes the OpenAPI
document states (those really returned, never FastAPI's unused 422), and the `param` an invalid field
is reported under.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .schemas import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_TYPE_LABEL = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


class BodyGuard:
    """ASGI middleware: reads a request body up to `max_bytes` (larger: 413, whatever Content-Length says)
    and refuses JSON whose strings are not valid UTF-8, before any route sees it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _reply(send, 400, "content-length: not a number of bytes", "content-length")
            return
        if declared is not None and int(declared) > self.max_bytes:
            await _reply(send, 413, f"request body over {self.max_bytes} bytes (max_request_bytes)")
            return
        body = bytearray()
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = bool(msg.get("more_body", False))
            if len(body) > self.max_bytes:
                await _reply(send, 413, f"request body over {self.max_bytes} bytes (max_request_bytes)")
                return
        where = _lone_surrogate(bytes(body))
        if where is not None:
            await _reply(send, 400, f"{where or 'body'}: strings must be valid UTF-8 (a lone surrogate)", where or None)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


def has_surrogate_escape(body: bytes) -> bool:
    """Whether the body may hold a lone surrogate (a `\\ud800`-style escape: maybe part of a valid pair)."""
    return _SURROGATE_ESCAPE.search(body) is not None


def _lone_surrogate(body: bytes) -> str | None:
    """The field path of the first string holding a lone surrogate ("" for a top-level one), or None."""
    if not has_surrogate_escape(body):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the route reports it

    def walk(node: Any, path: str) -> str | None:
        if isinstance(node, str):
            return None if _utf8(node) else path
        if isinstance(node, list):
            for v in node:
                hit = walk(v, path)
                if hit is not None:
                    return hit
        if isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else str(k)
                if not _utf8(k):
                    return path
                hit = walk(v, sub)
                if hit is not None:
                    return hit
        return None

    return walk(doc, "")


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _reply(send: Send, status: int, message: str, param: str | None = None) -> None:
    kind = {400: "BadRequestError", 413: "RequestTooLargeError"}[status]
    payload = json.dumps(error_body(message, kind, param)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def validation_param(loc: Sequence[Any]) -> str | None:
    """The field a validation error names: its path without the location (body, query, path) and without
    pydantic's union-member labels and list indexes ("prompt", "tetri.request_id", "offset")."""
    parts = [str(p) for p in loc[1:] if isinstance(p, str) and not _TYPE_LABEL.match(p)] if loc else []
    return ".".join(parts) or None


def documented_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with the error codes really returned: 400 (not 422) for anything validated,
    401 wherever a token can be required, 413 for request bodies; routes declare the rest."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            validated = responses.pop("422", None) is not None or op.get("parameters") or op.get("requestBody")
            if validated:
                responses.setdefault("400", {"description": "Bad request"} | ref)
            if method in ("post", "put", "patch"):
                responses.setdefault("413", {"description": "Request body too large"} | ref)
            if path.startswith(("/v1/", "/api/v1/")):
                responses.setdefault("401", {"description": "Missing or wrong bearer token"} | ref)
    for unused in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(unused, None)
    app.openapi_schema = schema
    return schema
