"""The caller's side of a worker's Serve stream: calls multiplexed on one long-lived stream per worker.

The daemon's calls to a worker (Generate, Attach) and a prefill worker's calls to a decode worker (Accept)
are each a call on the caller's one `Serve` stream to that worker (not a gRPC call each): a call costs a
`ServeUp` to start it, and every `ServeUp` queued while the previous message was being written goes out in
one `ServeUps` message; the worker answers every call's ready chunks (`TokenChunk`) and replies
(`AcceptReply`) together in one `ServeDown` (workers.service). Each call has a queue its answers are sorted
into; the stream breaking puts `StreamBroken` into every call's queue, and the next call opens another
stream.

Used by the gRPC edges only (daemon.worker_client, workers.service): protobuf stays there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from ..loopqueue import LoopQueue
from . import pb
from .peers import Peers

Answer = pb.TokenChunk | pb.AcceptReply


@dataclass(frozen=True)
class StreamBroken:
    """The stream carrying a call ended (the worker died or is unreachable, or the caller closed it)."""

    code: str  # the gRPC status name
    details: str = ""


class ServeStream:
    """One caller's Serve stream to one worker."""

    def __init__(self, peers: Peers, address: str) -> None:
        self._up: LoopQueue[pb.ServeUp | None] = LoopQueue()
        self.calls: dict[int, LoopQueue[Answer | StreamBroken]] = {}
        self.broken: StreamBroken | None = None
        self._next = 0
        self._call = peers.worker(address).Serve(self._ups(), metadata=peers.metadata)
        self._reader = asyncio.create_task(self._read(), name="tetri-serve-reader")

    async def _ups(self) -> AsyncIterator[pb.ServeUps]:
        while (first := await self._up.get()) is not None:
            ups = [first]
            while not self._up.empty():  # queued while the previous message was written: one message
                up = self._up.get_nowait()
                if up is None:
                    yield pb.ServeUps(ups=ups)
                    return
                ups.append(up)
            yield pb.ServeUps(ups=ups)

    async def _read(self) -> None:
        broken = StreamBroken("UNAVAILABLE", "the worker ended its Serve stream")
        try:
            async for down in self._call:
                for answers in (down.chunks, down.replies):
                    for a in answers:
                        queue = self.calls.get(a.call)
                        if queue is not None:  # a call the caller left meanwhile: dropped
                            queue.put_nowait(a)
        except grpc.aio.AioRpcError as e:
            broken = StreamBroken(e.code().name, e.details() or "")
        except asyncio.CancelledError:
            broken = StreamBroken("CANCELLED", "the caller closed the stream")
            raise
        finally:
            self.broken = broken
            for queue in self.calls.values():
                queue.put_nowait(broken)

    def open(
        self, **op: pb.GenerateRequest | pb.AttachRequest | pb.AcceptRequest
    ) -> tuple[int, LoopQueue[Answer | StreamBroken]]:
        """Start a call; its answers (or `StreamBroken`) arrive in the returned queue."""
        self._next += 1
        queue: LoopQueue[Answer | StreamBroken] = LoopQueue()
        self.calls[self._next] = queue
        if self.broken is not None:
            queue.put_nowait(self.broken)
        else:
            self._up.put_nowait(pb.ServeUp(call=self._next, **op))
        return self._next, queue

    def leave(self, call: int, finished: bool) -> None:
        """The caller is done with a call; one it leaves unfinished is stopped on the worker."""
        self.calls.pop(call, None)
        if not finished and self.broken is None:
            self._up.put_nowait(pb.ServeUp(call=call, close=True))

    async def close(self) -> None:
        self._up.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class ServeStreams:
    """A caller's Serve streams, one per worker address (a broken one is replaced by the next call)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers
        self._streams: dict[str, ServeStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def to(self, address: str) -> ServeStream:
        s = self._streams.get(address)
        if s is None or s.broken is not None:
            s = self._streams[address] = ServeStream(self._peers, address)
        return s

    async def close(self) -> None:
        for s in self._streams.values():
            await s.close()
        self._streams.clear()
