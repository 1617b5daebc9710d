"""`send_now` runs an ASGI send at once when it does not wait, and finishes one that waits (a full socket
buffer) in a task; a streamed answer's frames that come meanwhile follow it, in order (`_Stream`)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from daemon.api.sse import StreamSend, send_now
from daemon.front.openai import _Frames, _Job, _Stream


class Socket:
    """A send that waits while `paused` (as uvicorn's flow control does) and records what it wrote."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.writable = asyncio.Event()
        self.writable.set()
        self.fail: Exception | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.start":
            return
        await_needed = not self.writable.is_set()
        if await_needed:
            await self.writable.wait()
        if self.fail is not None:
            raise self.fail
        self.written.append(message["body"])


def _stream(sock: Socket, interval: int = 1, with_ids: bool = False) -> _Stream:
    """A completion stream writing to `sock` (its job is never served: the tests feed tokens by hand)."""

    async def serve(**_: Any) -> Any:
        raise AssertionError

    job = _Job("r", "m", 1, 0, serve, False, with_ids)
    return _Stream(_Frames(job, chat=False), StreamSend(sock.send, []), interval)  # not uvicorn: no write_now


def test_a_send_that_need_not_wait_is_done_at_once() -> None:
    async def main() -> None:
        sock = Socket()
        assert send_now(sock.send, {"body": b"a"}) is None
        assert sock.written == [b"a"]

    asyncio.run(main())


def test_a_send_that_waits_is_finished_by_a_task_and_its_failure_kept() -> None:
    async def main() -> None:
        sock = Socket()
        sock.writable.clear()
        pending = send_now(sock.send, {"body": b"a"})
        assert pending is not None and sock.written == []
        await asyncio.sleep(0.01)
        assert not pending.done()
        sock.writable.set()
        await pending
        assert sock.written == [b"a"]
        sock.writable.clear()
        sock.fail = RuntimeError("gone")
        pending = send_now(sock.send, {"body": b"b"})
        assert pending is not None
        sock.writable.set()
        with pytest.raises(RuntimeError, match="gone"):
            await pending

    asyncio.run(main())


def test_frames_behind_a_waiting_send_follow_it_in_order() -> None:
    async def main() -> None:
        sock = Socket()
        out = _stream(sock)
        out.tokens([1], "one")
        sock.writable.clear()
        out.tokens([2], "two")  # waits
        out.tokens([3], "three")  # behind it
        out.tokens([4], "four")
        assert len(sock.written) == 1 and out.buffer
        sock.writable.set()
        await out.flush()
        assert out.waiting is None and out.take() == b""
        text = b"".join(sock.written)
        assert [text.index(w) for w in (b'"one"', b'"two"', b'"three"', b'"four"')] == sorted(
            text.index(w) for w in (b'"one"', b'"two"', b'"three"', b'"four"')
        )
        assert out.count == 4 and len(sock.written) == 3  # one, two, then three and four together

    asyncio.run(main())


def test_a_stream_interval_frames_the_first_token_at_once_then_every_n() -> None:
    """As vLLM's --stream-interval: the first token's frame at once, then one per N tokens carrying them
    all; what is held at the end comes out with the response's end (`take`), the text unchanged."""

    async def main() -> None:
        sock = Socket()
        out = _stream(sock, interval=4, with_ids=True)
        for i in range(10):  # an engine step each
            out.tokens([i], f"t{i} ")
        await out.flush()
        tail = out.take()
        frames = [orjson.loads(f.removeprefix(b"data: ")) for f in sock.written]
        assert [f["choices"][0]["token_ids"] for f in frames] == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]
        assert orjson.loads(tail.removeprefix(b"data: "))["choices"][0]["token_ids"] == [9]
        text = "".join(f["choices"][0]["text"] for f in frames) + orjson.loads(tail[6:])["choices"][0]["text"]
        assert text == "".join(f"t{i} " for i in range(10)) and out.count == 10 and out.take() == b""

    asyncio.run(main())


def test_a_stream_interval_waits_for_text_before_its_first_frame() -> None:
    """Tokens with no text yet (a character's first bytes) are not a first frame: the first text is."""

    async def main() -> None:
        sock = Socket()
        out = _stream(sock, interval=3)
        out.tokens([1], "")
        assert sock.written == []
        out.tokens([2], "é")  # the first text: at once, with the token before it
        out.tokens([3], "a")
        out.tokens([4], "b")
        assert [orjson.loads(f[6:])["choices"][0]["text"] for f in sock.written] == ["é"]
        out.tokens([5], "c")  # three tokens since the last frame
        assert [orjson.loads(f[6:])["choices"][0]["text"] for f in sock.written] == ["é", "abc"]

    asyncio.run(main())
