"""The daemon's ASGI front (daemon/front/asgi.py) on its own: which requests it answers itself (valid
completions) and that everything else reaches the app behind it unchanged — the body replayed byte for
byte, BodyGuard's limit still applied. End to end (a live daemon: the answers, and every refusal in the
error shape) it is covered by tests/cluster (test_e2e, test_hostile, test_schemathesis)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI

from daemon.api.guard import BodyGuard
from daemon.api.schemas import ChatCompletionRequest, CompletionRequest
from daemon.front.asgi import OpenAIFront
from tetri.config import DaemonSettings

from .asgi import drive, reader

OK = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
JSON = (b"content-type", b"application/json")


def front(api_keys: list[str] | None = None) -> OpenAIFront:
    return OpenAIFront(FastAPI(), DaemonSettings(api_keys=api_keys or [], max_request_bytes=1024))


def parsed(f: OpenAIFront, body: Any, headers: dict[bytes, bytes] | None = None, model: Any = CompletionRequest) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return f._parsed(model, {b"content-type": b"application/json"} if headers is None else headers, raw)


def test_a_valid_completion_is_answered_by_the_front():
    got = parsed(front(), OK)
    assert isinstance(got, CompletionRequest) and got.prompt == [1, 2, 3] and got.max_tokens == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert isinstance(parsed(front(), chat, model=ChatCompletionRequest), ChatCompletionRequest)
    assert parsed(front(), OK, headers={}) is not None  # no content type: FastAPI takes it as JSON too
    assert parsed(front(["k1", "k2"]), OK, {JSON[0]: JSON[1], b"authorization": b"Bearer k2"}) is not None


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (OK | {"max_tokens": "3"}, None),  # the model refuses it
        (OK | {"frobnicate": 1}, None),
        (b'{"model": "m", "prompt": ', None),  # not JSON
        (b"[" * 5000 + b"]" * 5000, None),
        (b'{"model": "m", "prompt": "\\ud800", "max_tokens": 3}', None),  # a lone surrogate
        (OK, {b"content-type": b"text/plain"}),
    ],
)
def test_anything_to_refuse_goes_to_the_app(body: Any, headers: dict[bytes, bytes] | None):
    assert parsed(front(), body, headers) is None


def test_a_wrong_or_missing_api_key_goes_to_the_app():
    f = front(["k1"])
    assert parsed(f, OK) is None
    assert parsed(f, OK, {JSON[0]: JSON[1], b"authorization": b"Bearer nope"}) is None


def call(f: OpenAIFront, path: str, body: bytes, headers: list[tuple[bytes, bytes]], chunk: int = 100) -> dict:
    """Run one request through the front over BodyGuard and a recording app; what the app saw, and the
    status sent."""
    seen: dict[str, Any] = {}
    f.app = BodyGuard(reader(seen, status=299), max_bytes=f.max_bytes)  # type: ignore[assignment]
    sent = drive(f, {"type": "http", "method": "POST", "path": path, "headers": headers}, body, chunk)
    return {"seen": seen, "status": sent[0]["status"]}


def test_a_refused_request_reaches_the_app_with_its_body_whole():
    body = json.dumps(OK | {"max_tokens": "3", "pad": "x" * 500}).encode()
    got = call(front(), "/v1/completions", body, [JSON])
    assert got["status"] == 299 and got["seen"] == {"path": "/v1/completions", "body": body}


def test_other_paths_pass_untouched():
    got = call(front(), "/api/v1/policies", b'{"a": 1}', [JSON])
    assert got["seen"] == {"path": "/api/v1/policies", "body": b'{"a": 1}'}


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_still_bodyguards_413(declared: bool):
    body = json.dumps(OK | {"prompt": "x" * 3000}).encode()
    headers = [JSON, (b"content-length", str(len(body)).encode())] if declared else [JSON]
    got = call(front(), "/v1/completions", body, headers, chunk=300)
    assert got["status"] == 413 and got["seen"] == {}
