"""Half-sent requests on a live daemon: headers or a body that stop coming get a 408 in the OpenAI error
shape and the connection closed (`http_header_timeout_s`, `http_body_timeout_s`), and a slow but steady
client is served."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import pytest

from .harness import LiveCluster, start_cluster

pytestmark = pytest.mark.slow
BODY = json.dumps({"model": "tetri-sim", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
LIMIT = 1.0  # both timeouts, seconds


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    env = {"TETRI_DAEMON_HTTP_HEADER_TIMEOUT_S": str(LIMIT), "TETRI_DAEMON_HTTP_BODY_TIMEOUT_S": str(LIMIT)}
    cl = start_cluster(tmp_path_factory.mktemp("slow"), ["prefill", "decode"], env=env)
    yield cl
    cl.stop()


def connect(c: LiveCluster) -> socket.socket:
    host, port = c.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"content-length: %d\r\n\r\n" % length
    )


def expect_408(answer: bytes, what: str, setting: str) -> None:
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer
    err = json.loads(body)["error"]
    assert err["type"] == "RequestTimeoutError" and what in err["message"] and setting in err["message"], err


def test_a_connection_that_sends_nothing_is_closed_with_a_408(c: LiveCluster):
    with connect(c) as s:
        t0 = time.monotonic()
        expect_408(read_all(s), "headers", "http_header_timeout_s")
        assert time.monotonic() - t0 >= LIMIT * 0.9


def test_headers_sent_a_byte_at_a_time_past_the_limit_get_a_408(c: LiveCluster):
    with connect(c) as s:
        for b in head(len(BODY)):  # slowloris: a byte every 0.1 s, each well within any idle limit
            s.sendall(bytes([b]))
            if select.select([s], [], [], 0.1)[0]:  # the daemon answered: stop sending
                break
        expect_408(read_all(s), "headers", "http_header_timeout_s")


def test_a_body_that_stops_coming_gets_a_408_and_the_next_request_is_served(c: LiveCluster):
    with connect(c) as s:
        s.sendall(head(len(BODY)) + BODY[:10])  # then nothing
        expect_408(read_all(s), "body", "http_body_timeout_s")
    with connect(c) as s:  # a slow but steady body: each piece well within the limit
        s.sendall(head(len(BODY)))
        for i in range(0, len(BODY), 20):
            time.sleep(LIMIT / 4)
            s.sendall(BODY[i : i + 20])
        status = s.recv(65536).split(b"\r\n", 1)[0]
        assert status == b"HTTP/1.1 200 OK", status


def test_a_keep_alive_connections_next_request_is_timed_too(c: LiveCluster):
    with connect(c) as s:
        s.sendall(head(len(BODY)) + BODY)  # one whole request, answered
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK"), first
        for b in head(len(BODY)):  # then the next one's headers, a byte every 0.1 s
            s.sendall(bytes([b]))
            if select.select([s], [], [], 0.1)[0]:
                break
        expect_408(read_all(s), "headers", "http_header_timeout_s")
