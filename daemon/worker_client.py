"""The daemon's gRPC edge, worker side: the calls the daemon makes to workers (Generate and Attach over
each worker's one Serve stream; Cancel, Flip, SetPlan, Info) over cached channels, with their answers as
plain data. A failed call raises `WorkerCallError` naming the gRPC status, so the rest of the daemon never
sees gRPC or protobuf.

A token stream (`generate`, `attach`) is a `Call` whose answers go to a `CallReceiver` as the worker's
messages are read: `tokens(ids)` for each engine step's tokens, `end(chunk)` once, `lost(error)` when the
stream breaks. `Call.leave()` before its end cancels it on the worker. Every token stream to one worker is
a call multiplexed on one long-lived `Serve` stream (`tetri.proto.serve`): a request costs part of a
message each way, not a gRPC call, and a token no task switch of its own (docs/cluster.md, "The Serve
stream"). The stream breaking ends each call on it with `WorkerCallError`; the next call opens another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from tetri.proto import pb
from tetri.proto.peers import Peers
from tetri.proto.security import NO_TLS, Tls
from tetri.proto.serve import Answer, ServeStream, ServeStreams, StreamBroken
from tetri.sampling import GREEDY, Sampling

from .cluster import LoadReport
from .wire import load_from_pb


class WorkerCallError(Exception):
    """A call to a worker failed (unreachable, died mid-stream, timed out…); `code` is the gRPC status name."""

    def __init__(self, code: str, details: str = "") -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code


def sampling_to_pb(s: Sampling) -> pb.Sampling:
    return pb.Sampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
    )


@dataclass(frozen=True)
class Handoff:
    decode_instance_id: str
    decode_address: str


@dataclass(slots=True)  # one per chunk of tokens: not frozen (a frozen dataclass's __init__ costs 4×)
class TokenChunk:
    """Tokens a worker produced since its previous chunk; the last chunk says why the stream ended, or
    (a prefill worker's) where the request continues."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""  # "length" | "stop" | "abort" | "error" | "refused" (nothing done: retry elsewhere)
    handoff: Handoff | None = None
    error: str = ""
    kv_loaded_tokens: int = 0  # decode worker's last chunk: prompt tokens whose KV came with the hand-over; -1 unknown
    cached_tokens: int = -1  # an entry call's end (colocated, or the hand-off): prompt tokens its prefix cache held


@dataclass(frozen=True)
class Reply:
    """A worker's yes/no answer (Flip, SetPlan) and its reason."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class WorkerInfo:
    instance_id: str
    role: str
    model: str
    max_model_len: int
    load: LoadReport


def _chunk(c: pb.TokenChunk) -> TokenChunk:
    handoff = Handoff(c.handoff.decode_instance_id, c.handoff.decode_address) if c.HasField("handoff") else None
    return TokenChunk(
        c.request_id,
        list(c.token_ids),
        c.finished,
        c.finish_reason,
        handoff,
        c.error,
        c.kv_loaded_tokens,
        c.cached_tokens,
    )


class CallReceiver(Protocol):
    """Where a token stream's answers go (called as the worker's messages are read, one at a time)."""

    def tokens(self, ids: list[int]) -> None:
        """Tokens the worker produced since the previous answer."""

    def end(self, chunk: TokenChunk) -> None:
        """The call's last chunk: finished, or (a prefill worker's) the hand-off; it may carry tokens."""

    def lost(self, error: WorkerCallError) -> None:
        """The worker was lost at the transport (died, unreachable): the call is over."""


class Call:
    """A token stream on a worker's Serve stream (`WorkerClient.generate`/`attach`)."""

    __slots__ = ("_id", "_left", "_receiver", "_stream", "tokens")

    def __init__(self, stream: ServeStream, receiver: CallReceiver, op: dict[str, object]) -> None:
        self._stream = stream
        self._receiver = receiver
        self._left = False
        self.tokens = receiver.tokens  # the Serve stream's reader calls the receiver's directly
        self._id = stream.open(self, **op)  # type: ignore[arg-type]

    def answer(self, item: Answer | StreamBroken) -> None:
        if isinstance(item, StreamBroken):
            self._close(True)
            self._receiver.lost(WorkerCallError(item.code, item.details))
        elif not isinstance(item, pb.TokenChunk):  # the daemon makes no Accept calls
            self._close(True)
            self._receiver.lost(WorkerCallError("INTERNAL", f"a {type(item).__name__} on a token stream"))
        elif item.finished or item.HasField("handoff"):
            self._close(True)
            self._receiver.end(_chunk(item))
        elif item.token_ids:  # tokens sent as a chunk (not packed): the same as packed ones
            self._receiver.tokens(list(item.token_ids))

    def leave(self) -> None:
        """Done with the call: one not over yet is cancelled on the worker; its answers stop."""
        self._close(False)

    def _close(self, finished: bool) -> None:
        if not self._left:
            self._left = True
            self._stream.leave(self._id, finished)


def _error(e: grpc.aio.AioRpcError) -> WorkerCallError:
    return WorkerCallError(e.code().name, e.details() or "")


class WorkerClient:
    """Calls to workers; each carries the cluster token (and runs over TLS when configured)."""

    def __init__(self, token: str | None = None, tls: Tls = NO_TLS) -> None:
        self._peers = Peers(token, tls)
        self._serving = ServeStreams(self._peers)

    def generate(
        self,
        address: str,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        predicted: tuple[int, int] | None = None,
        decode_instance_id: str = "",
        resumed_tokens: int = 0,
        sampling: Sampling = GREEDY,
        *,
        receiver: CallReceiver,
    ) -> Call:
        """Run a request from its prompt, its answers to `receiver`; `resumed_tokens` > 0: a migrated
        request whose last that many prompt tokens are outputs already streamed."""
        lo, hi = predicted or (0, 0)
        req = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            predicted_lo=lo,
            predicted_hi=hi,
            decode_instance_id=decode_instance_id,
            resumed_tokens=resumed_tokens,
            sampling=sampling_to_pb(sampling),
        )
        return Call(self._serving.to(address), receiver, {"generate": req})

    def attach(self, address: str, request_id: str, *, receiver: CallReceiver) -> Call:
        """A decode worker's tokens of a handed-over request (after the first), its answers to `receiver`."""
        return Call(self._serving.to(address), receiver, {"attach": pb.AttachRequest(request_id=request_id)})

    async def cancel(self, address: str, request_id: str, timeout: float) -> bool:
        """Abort the request on that worker; True if the worker had it."""
        try:
            reply = await self._peers.worker(address).Cancel(
                pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self._peers.metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return bool(reply.found)

    async def cancel_anywhere(self, addresses: Sequence[str], request_id: str, timeout: float) -> bool:
        """Abort a request another front serves: every address given is asked to (the front serving it
        sees its stream end as cancelled). Whether one had it."""

        async def one(address: str) -> bool:
            try:
                return await self.cancel(address, request_id, timeout)
            except WorkerCallError:
                return False

        return any(await asyncio.gather(*(one(a) for a in addresses)))

    async def flip(self, address: str, to_role: str, timeout: float) -> Reply:
        try:
            reply = await self._peers.worker(address).Flip(
                pb.FlipRequest(to_role=to_role), timeout=timeout, metadata=self._peers.metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Reply(reply.ok, reply.reason)

    async def set_plan(self, address: str, order: Sequence[str] | None, timeout: float) -> Reply:
        """Load a Sorted-F plan's admission order into a decode worker; None clears it."""
        msg = pb.PlanRequest(clear=True) if order is None else pb.PlanRequest(order=order)
        try:
            reply = await self._peers.worker(address).SetPlan(msg, timeout=timeout, metadata=self._peers.metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Reply(reply.ok, reply.reason)

    async def info(self, address: str, timeout: float) -> WorkerInfo:
        try:
            r = await self._peers.worker(address).Info(pb.InfoRequest(), timeout=timeout, metadata=self._peers.metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return WorkerInfo(r.instance_id, r.role, r.model, r.max_model_len, load_from_pb(r.load))

    async def close(self) -> None:
        await self._serving.close()
        await self._peers.close()
