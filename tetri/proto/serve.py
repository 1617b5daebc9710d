"""The caller's side of a worker's Serve stream: calls multiplexed on one long-lived stream per worker.

The daemon's calls to a worker (Generate, Attach) and a prefill worker's calls to a decode worker (Accept)
are each a call on the caller's one `Serve` stream to that worker (not a gRPC call each): a call costs a
`ServeUp` to start it, and every `ServeUp` queued while the previous message was being written goes out in
one `ServeUps` message. The worker answers every call's ready tokens, ends (`TokenChunk`) and replies
(`AcceptReply`) together in one `ServeDown` (workers.service): one message per engine step, its tokens
packed. Each call has a `Receiver`, called from the stream's reader as a message is read: `tokens` with the
call's new ids (a plain list: no protobuf object, no queue, no task per call and step), `answer` with its
end, its reply, or `StreamBroken` when the stream breaks; the next call opens another stream.
`AnswerQueue` is a receiver that queues its answers for a task to await.

Used by the gRPC edges only (daemon.worker_client, workers.service): protobuf stays there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

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


class Receiver(Protocol):
    """Where a call's answers go: called from the stream's reader task, one message at a time. It must not
    raise (the reader serves every call on its stream) nor wait."""

    def tokens(self, ids: list[int]) -> None:
        """Tokens the call produced since its previous answer (the call goes on)."""

    def answer(self, item: Answer | StreamBroken) -> None:
        """The call's end chunk (finished, the hand-off, an error; it may carry tokens too), an Accept
        call's reply, or the stream breaking."""


class AnswerQueue(LoopQueue[Answer | StreamBroken]):
    """A receiver that queues a call's answers (an Accept call's one reply) for a task to await; tokens,
    which such a call never has, would come as a chunk."""

    def answer(self, item: Answer | StreamBroken) -> None:
        self.put_nowait(item)

    def tokens(self, ids: list[int]) -> None:
        self.put_nowait(pb.TokenChunk(token_ids=ids))


class ServeStream:
    """One caller's Serve stream to one worker."""

    def __init__(self, peers: Peers, address: str) -> None:
        self._up: LoopQueue[pb.ServeUp | None] = LoopQueue()
        self.calls: dict[int, Receiver] = {}
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
        calls = self.calls
        try:
            async for down in self._call:
                counts = down.token_counts
                if counts:  # one engine step's tokens: a slice of the one packed list per call
                    tokens = list(down.tokens)
                    at = 0
                    for call, n in zip(down.token_calls, counts, strict=True):
                        receiver = calls.get(call)
                        if receiver is not None:  # a call the caller left meanwhile: dropped
                            receiver.tokens(tokens[at : at + n])
                        at += n
                for answers in (down.chunks, down.replies):
                    for a in answers:
                        receiver = calls.get(a.call)
                        if receiver is not None:
                            receiver.answer(a)
        except grpc.aio.AioRpcError as e:
            broken = StreamBroken(e.code().name, e.details() or "")
        except asyncio.CancelledError:
            broken = StreamBroken("CANCELLED", "the caller closed the stream")
            raise
        finally:
            self.broken = broken
            self._up.put_nowait(None)  # nothing more to write: gRPC's task writing the stream ends too
            for receiver in list(calls.values()):
                receiver.answer(broken)

    def open(self, receiver: Receiver, **op: pb.GenerateRequest | pb.AttachRequest | pb.AcceptRequest) -> int:
        """Start a call whose answers go to `receiver`; on a broken stream it gets `StreamBroken` (soon,
        not from inside this call)."""
        self._next += 1
        self.calls[self._next] = receiver
        if self.broken is not None:
            asyncio.get_running_loop().call_soon(receiver.answer, self.broken)
        else:
            self._up.put_nowait(pb.ServeUp(call=self._next, **op))
        return self._next

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

    def discard(self) -> None:
        """Let a broken stream go (its reader has ended): end its request iterator and its call, so that
        gRPC's task writing it ends too (dropped pending, it was garbage-collected mid-await: "Task was
        destroyed but it is pending" and "aclose(): asynchronous generator is already running")."""
        self._up.put_nowait(None)
        self._call.cancel()


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
            if s is not None:
                s.discard()
            s = self._streams[address] = ServeStream(self._peers, address)
        return s

    async def close(self) -> None:
        for s in self._streams.values():
            await s.close()
        self._streams.clear()
