"""The HTTP edge's guard on its own (an ASGI app behind it, messages in and out): body-size limit,
Content-Length, lone surrogates, and the field a validation error names."""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemon.api.guard import BodyGuard, validation_param

from .asgi import drive, reader


def call(body: bytes, headers: list[tuple[bytes, bytes]], chunk: int = 1 << 20) -> tuple[int, dict[str, Any], bytes]:
    """(status, error JSON or {}, the body the app behind the guard read)."""
    seen: dict[str, Any] = {}
    guard = BodyGuard(reader(seen), max_bytes=1024)
    sent = drive(guard, {"type": "http", "method": "POST", "headers": headers}, body, chunk)
    status = sent[0]["status"]
    payload = sent[1]["body"]
    return status, (json.loads(payload) if status != 200 else {}), seen.get("body", b"")


def test_a_body_within_the_limit_reaches_the_app_whole():
    body = json.dumps({"prompt": "x" * 900}).encode()
    status, _, seen = call(body, [(b"content-length", str(len(body)).encode())], chunk=100)
    assert status == 200 and seen == body


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_a_413_whether_declared_or_not(declared: bool):
    body = b"x" * 2000
    headers = [(b"content-length", b"2000")] if declared else []
    status, err, seen = call(body, headers, chunk=300)
    assert status == 413 and "max_request_bytes" in err["error"]["message"] and seen == b""


def test_a_content_length_that_is_not_a_number_is_a_400():
    status, err, _ = call(b"{}", [(b"content-length", b"abc")])
    assert status == 400 and err["error"]["param"] == "content-length"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "\\ud800"}', "model"),
        (b'{"tetri": {"request_id": "a\\udfff"}}', "tetri.request_id"),
        (b'{"prompt": ["ok", "\\udc00"]}', "prompt"),
        (b'{"\\ud800": 1}', None),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(raw: bytes, param: str | None):
    status, err, seen = call(raw, [])
    assert status == 400 and err["error"]["param"] == param and seen == b""


def test_a_surrogate_pair_is_fine():
    status, _, _ = call(b'{"prompt": "\\ud83d\\ude00"}', [])
    assert status == 200


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "max_tokens"), "max_tokens"),
        (("body", "prompt", "list[int]", 0), "prompt"),
        (("body", "tetri", "sla_ttft_ms"), "tetri.sla_ttft_ms"),
        (("query", "offset"), "offset"),
        (("body",), None),
    ],
)
def test_validation_param_names_the_field(loc: tuple[Any, ...], param: str | None):
    assert validation_param(loc) == param
