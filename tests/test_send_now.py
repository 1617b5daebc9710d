"""`send_now` runs an ASGI send at once when it does not wait, and finishes one that waits (a full socket
buffer) in a task; a streamed answer's frames that come meanwhile follow it, in order (`_Stream`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon.api.openai import _Frames, _Job, _Stream
from daemon.api.sse import send_now


class Socket:
    """A send that waits while `paused` (as uvicorn's flow control does) and records what it wrote."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.writable = asyncio.Event()
        self.writable.set()
        self.fail: Exception | None = None

    async def send(self, message: dict[str, Any]) -> None:
        await_needed = not self.writable.is_set()
        if await_needed:
            await self.writable.wait()
        if self.fail is not None:
            raise self.fail
        self.written.append(message["body"])


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
        async def serve(**_: Any) -> Any:
            raise AssertionError

        sock = Socket()
        out = _Stream(_Frames(_Job("r", "m", 1, 0, serve, False, False), chat=False), sock.send)
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
