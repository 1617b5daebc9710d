"""The daemon's ASGI entry: a valid completion request goes straight to its endpoint; everything else goes
to the FastAPI app.

FastAPI spends about a fifth of the daemon's CPU per streamed completion on its middleware layers, its
routing, dependency solving and body validation, and wraps every SSE chunk's `send` in two more layers
(bench/control_plane_cost.py, docs/vllm.md). For `POST /v1/completions` and `POST /v1/chat/completions`
this front reads the body itself and, when the request is plainly fine — a JSON body within
`max_request_bytes`, no lone surrogate, an accepted API key, a body the route's own model validates —
calls the route's endpoint function with it and sends its answer on the server's own `send`. Any request
it would have to refuse goes to the FastAPI app with its body replayed, and is refused there exactly as
before (one implementation of each error: BodyGuard's, the validation handler's, the API key's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from tetri.config import DaemonSettings

from ..api.auth import api_key_ok
from ..api.guard import Message, Receive, Scope, Send, has_surrogate_escape
from ..api.schemas import ChatCompletionRequest, CompletionRequest
from .openai import chat_completions, completions

Endpoint = Callable[[Any, Request], Awaitable[Response]]
ROUTES: dict[str, tuple[type[BaseModel], Endpoint]] = {
    "/v1/completions": (CompletionRequest, completions),
    "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
}
JSON_TYPES = (b"application/json", b"")


class OpenAIFront:
    def __init__(self, app: FastAPI, settings: DaemonSettings) -> None:
        self.app = app
        self.settings = settings
        self.max_bytes = settings.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        headers = dict(scope["headers"]) if route is not None else {}
        declared = headers.get(b"content-length")
        if route is None or (declared is not None and not (declared.isdigit() and int(declared) <= self.max_bytes)):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more and len(body) <= self.max_bytes:  # past the limit: BodyGuard reads the rest and refuses it
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = bool(msg.get("more_body", False))
        pending: list[Message] = [{"type": "http.request", "body": bytes(body), "more_body": more}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()  # then the disconnect, when it comes

        whole = not more and len(body) <= self.max_bytes
        parsed = self._parsed(route[0], headers, bytes(body)) if whole else None
        if parsed is None:  # anything to refuse: the FastAPI app refuses it, as it always has
            await self.app(scope, replay, send)
            return
        pending.clear()
        scope["app"] = self.app  # as Starlette sets it: the endpoint reads the app's state through it
        response = await route[1](parsed, Request(scope, receive))
        await response(scope, receive, send)

    def _parsed(self, model: type[BaseModel], headers: dict[bytes, bytes], body: bytes) -> BaseModel | None:
        """The validated body, or None when the request is to be refused (by the FastAPI app)."""
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media not in JSON_TYPES or has_surrogate_escape(body):
            return None
        if not api_key_ok(self.settings, headers.get(b"authorization", b"").decode("latin-1")):
            return None
        try:
            return model.model_validate(json.loads(body))  # as FastAPI parses and validates a body
        except (ValueError, RecursionError, ValidationError):
            return None
