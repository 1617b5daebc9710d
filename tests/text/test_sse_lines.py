"""An SSE event whose text holds Unicode line breaks (NEL, U+2028, U+2029: JSON leaves them raw) stays one
line for readers that split on them — httpx's `aiter_lines`, as the serving bench's client reads — and
decodes to the same text."""

from __future__ import annotations

import json

import httpx

from daemon.front.openai import sse_data

TEXTS = ["a\u2028b", "\u2029", "x\x85y", "plain", "é\u2028ü\x85\u2029 end", "\u2027\u202a"]


def test_each_event_is_one_line_and_decodes_to_its_text() -> None:
    for text in TEXTS:
        body = {"choices": [{"index": 0, "text": text}]}
        event = sse_data(body)
        lines = [x for x in httpx.Response(200, content=event).iter_lines() if x]
        assert len(lines) == 1, (text, lines)
        assert lines[0].startswith("data: ")
        assert json.loads(lines[0][6:]) == body


def test_a_stream_of_events_splits_into_its_events() -> None:
    bodies = [{"choices": [{"text": t}]} for t in TEXTS]
    stream = b"".join(sse_data(b) for b in bodies)
    lines = [x for x in httpx.Response(200, content=stream).iter_lines() if x]
    assert [json.loads(x[6:]) for x in lines] == bodies
