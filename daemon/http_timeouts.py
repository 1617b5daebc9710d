"""Server-side timeouts for half-sent requests: a client that sends its headers or its body slowly (or not
at all: slowloris) holds a connection and a parser forever otherwise; uvicorn times only idle keep-alive
connections. As nginx does (client_header_timeout, client_body_timeout, 60 s each by default): a
connection's request headers must arrive whole within `http_header_timeout_s` of its first byte (of the
connection, for the first request; a keep-alive connection's next request too), and between two reads
of a body at most `http_body_timeout_s` may pass; past either the daemon answers 408 in the OpenAI error
shape and closes the connection. A request whose body arrived is the app's: these timers stop there.
While the daemon itself is not reading (a response in progress, with a pipelined request waiting behind
it) a timer that runs out starts again: a 408 never lands inside another request's response.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .api.schemas import error_body


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header and a body timer (class attributes: `timed_protocol`)."""

    header_timeout_s = 60.0
    body_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tetri_timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, what: str, setting: str) -> None:
        self._disarm()
        self._tetri_timer = self.loop.call_later(seconds, self._expired, what, seconds, setting)

    def _disarm(self) -> None:
        if self._tetri_timer is not None:
            self._tetri_timer.cancel()
            self._tetri_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, "headers", "http_header_timeout_s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._tetri_timer is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout_s, "headers", "http_header_timeout_s")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        headers = dict(self.headers)
        length = headers.get(b"content-length", b"0")
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower() or (length.isdigit() and int(length) > 0):
            self._arm(self.body_timeout_s, "body", "http_body_timeout_s")

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._tetri_timer is not None:
            self._arm(self.body_timeout_s, "body", "http_body_timeout_s")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _expired(self, what: str, seconds: float, setting: str) -> None:
        self._tetri_timer = None
        if self.transport.is_closing():
            return
        # the server is the one not reading (a response in progress: a pipelined request waits for it, and
        # uvicorn pauses reading meanwhile): time from when it reads again, never a 408 inside a response
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if answering or self.pipeline or self.flow.read_paused:
            self._arm(seconds, what, setting)
            return
        message = f"the request's {what} did not arrive within {seconds:g} s ({setting})"
        payload = json.dumps(error_body(message, "RequestTimeoutError", None, "request_timeout")).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(payload)
            + payload
        )
        self.transport.close()


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedHttpProtocol]:
    """The protocol class uvicorn runs (its `http=`), with these timeouts."""
    return type(
        "TimedHttpProtocol",
        (TimedHttpProtocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
