"""The Worker gRPC service over an `Engine`: prefill with KV hand-over, decode, colocated.

A thin shell: the engine computes, `tetri.scheduling.routing` chooses the decode instance, this module
moves messages. A token takes one queue from the engine to the wire: the task reading a request's engine
iterator (a colocated Generate call's own task; a decode job's, from its Accept) appends it to its call's
entry on the `out` queue of the Serve stream the call is on (`_Feed`: an entry per call and engine step),
and the stream's writer sends what it finds there as one `ServeDown` per engine step. So a call's tokens of
one step go together, and every call's go out together, packed (`Tokens`: a plain list of ids; only a
call's end is a `TokenChunk`). A decode job's tokens wait in its feed until its Attach call arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from tetri.gcheap import freeze_startup_heap
from tetri.loopqueue import LoopQueue
from tetri.proto import pb, rpc
from tetri.proto.peers import Peers
from tetri.proto.serve import Answer, AnswerQueue, ServeStreams, StreamBroken
from tetri.sampling import GREEDY, Sampling
from tetri.scheduling.dispatch import DecodeLoad, DispatchView
from tetri.scheduling.flip import flip_refusal
from tetri.scheduling.instance import HEAVY_DECODE
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import LengthPredictor, make_predictor

from .engines.base import Engine, EngineError, EngineRequest, KVHandle, Rejected

log = logging.getLogger(__name__)
_CANCELLED = StreamBroken("CANCELLED", "the request was cancelled here")  # a hand-over stopped by our Cancel


ACCEPT_ATTEMPTS = 3  # decode instances tried before a hand-over fails
TARGET_WAIT_S = 3.0  # how long a hand-over waits for a decode instance to appear in the broadcast view


@dataclass
class DecodeView:
    """The decode load the daemon last broadcast (`instances`), and what this instance dispatches on: the
    same loads plus what it sent since (`tetri.scheduling.dispatch.DispatchView`)."""

    instances: dict[str, tuple[str, DecodeLoad]] = field(default_factory=dict)  # id -> (address, load)
    view: DispatchView = field(default_factory=DispatchView)
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def update(self, decodes: list[tuple[str, str, DecodeLoad]]) -> None:
        """A new broadcast: (address, state, load) of each decode instance of this instance's model; only
        active ones are candidates."""
        self.instances = {load.instance_id: (address, load) for address, state, load in decodes if state == "active"}
        self.view = DispatchView(load for _, load in self.instances.values())
        self.updated.set()
        self.updated = asyncio.Event()

    def choose(
        self, policy: str = "least-kv", predicted_lo: int | None = None, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, str] | None:
        pick = self.view.choose(policy, predicted_lo, self.rng, exclude, HEAVY_DECODE)
        return None if pick is None else (pick, self.instances[pick][0])


def decode_loads(msg: pb.DecodeLoadBroadcast, model: str | None = None) -> list[tuple[str, str, DecodeLoad]]:
    """The daemon's broadcast of `model`'s decode instances (None: all), as `DecodeView.update` takes it
    (the edge: protobuf stops here)."""
    return [
        (
            d.address,
            d.load.state,
            DecodeLoad(
                d.instance_id,
                d.load.kv_used_tokens,
                d.load.kv_capacity_tokens,
                d.load.heavy,
                d.load.light,
                d.load.predicted_growth_tokens,
            ),
        )
        for d in msg.instances
        if model is None or d.model == model
    ]


Tokens = list[int]  # a call's tokens of one engine step (its entry on `_Out`); the call goes on


class _Out(LoopQueue[tuple[int, Tokens] | pb.TokenChunk | pb.AcceptReply | None]):
    """A Serve stream's answers, in order, for its writer: calls' token entries (`_Feed`), calls' ends,
    Accept calls' replies; None: the caller closed the stream. `turn` counts the event loop's turns that
    brought tokens: a call's tokens of one turn (one engine step's) share an entry, and those of the next
    start another, even when the writer, still writing the previous message, takes both at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.turn = 0
        self._call_soon = loop.call_soon
        self._sealing = False

    def seal_soon(self) -> None:
        """This turn brought tokens: the next turn's go in new entries."""
        if not self._sealing:
            self._sealing = True
            self._call_soon(self._seal)

    def _seal(self) -> None:
        self._sealing = False
        self.turn += 1


class _Feed:
    """Where one Generate or Attach call's answers go: the `out` queue of the Serve stream it is on, tagged
    with the call. The task producing its tokens appends each to the call's entry of this turn on `out`
    (`pending`), opening one when there is none; the stream's writer takes entries whole, emptying them.
    A decode job's feed is made at Accept, unbound: its tokens, and its end, wait here until its Attach
    call binds it to a stream."""

    __slots__ = ("call", "end", "n", "out", "pending", "turn")

    def __init__(self, call: int = 0, out: _Out | None = None) -> None:
        self.call = call
        self.out = out  # None: unbound (no call yet, the caller left, or the end went out)
        self.pending: Tokens = []  # bound: the call's latest entry on `out`; unbound: every token since
        self.turn = -1  # the `out.turn` that opened `pending`
        self.end: pb.TokenChunk | None = None  # the call's last chunk, once it ended
        self.n = 0  # tokens put here

    def extend(self, tokens: list[int], /) -> None:
        """Tokens of the call (an engine step's): on `out` with the call's others of this turn."""
        self.n += len(tokens)
        out = self.out
        if out is None or (self.turn == out.turn and self.pending):  # this turn's, not taken (taken: emptied)
            self.pending += tokens
        else:
            self._open(out, list(tokens))

    def finish(self, chunk: pb.TokenChunk) -> None:
        """End the call with `chunk`, which takes the tokens of this turn not taken yet (unbound: all; their
        entry on `out` is then empty: the writer skips it); the first end stands, and nothing goes out after
        it."""
        if self.end is not None:
            return
        out = self.out
        if self.pending and (out is None or self.turn == out.turn):
            chunk.token_ids[:0] = self.pending
            self.pending.clear()
        self.end = chunk
        if out is not None:
            self._send_end(out, chunk)

    def bind(self, call: int, out: _Out) -> None:
        """Answer `call` on `out` from now on: what waited here goes out at once."""
        self.call, self.out = call, out
        if self.end is not None:
            self._send_end(out, self.end)
        elif self.pending:
            self._open(out, self.pending)

    def unbind(self) -> None:
        """The caller left: nothing more goes out (tokens already on `out` still do)."""
        self._detach()

    def _open(self, out: _Out, tokens: Tokens) -> None:
        self.pending, self.turn = tokens, out.turn
        out.put_nowait((self.call, tokens))
        out.seal_soon()

    def _send_end(self, out: _Out, end: pb.TokenChunk) -> None:
        end.call = self.call
        out.put_nowait(end)
        self._detach()

    def _detach(self) -> None:
        self.out = None
        self.pending = []  # a fresh list: the one on `out`, if any, gets nothing more


@dataclass
class _DecodeJob:
    req: EngineRequest
    feed: _Feed = field(default_factory=_Feed)  # unbound until its Attach call
    task: asyncio.Task[None] | None = None
    kv_tokens: int = 0  # prompt tokens in the handed-over KV


def _stopped(rid: str, e: EngineError) -> pb.TokenChunk:
    """The last chunk of a request its engine stopped: rejected, aborted, or an error."""
    reason = "rejected" if isinstance(e, Rejected) else "abort" if str(e) == "aborted" else "error"
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason=reason, error=str(e))


async def _stream(rid: str, run: Awaitable[None], feed: _Feed, produced: int, limit: int) -> pb.TokenChunk:
    """Run an engine's `generate_to` or `decode_to`, which puts the tokens on `feed` as they come; returns
    the call's end, which says why it ended (`produced`: output tokens before the engine's first; `limit`:
    max_tokens)."""
    try:
        await run
    except EngineError as e:
        return _stopped(rid, e)
    produced += feed.n
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="length" if produced >= limit else "stop")


def _down(batch: list[tuple[int, Tokens] | pb.TokenChunk | pb.AcceptReply]) -> pb.ServeDown | None:
    """One Serve stream message for what its `out` queue held: the token entries, taken (each emptied:
    its call opens another for its next token), packed into one list; the ends and replies as they are.
    None: nothing to send (the tokens there went with their calls' ends)."""
    token_calls: list[int] = []
    counts: list[int] = []
    tokens: list[int] = []
    chunks: list[pb.TokenChunk] = []
    replies: list[pb.AcceptReply] = []
    for item in batch:
        if type(item) is tuple:
            toks = item[1]
            if toks:
                token_calls.append(item[0])
                counts.append(len(toks))
                tokens += toks
                toks.clear()
        elif isinstance(item, pb.TokenChunk):
            chunks.append(item)
        elif isinstance(item, pb.AcceptReply):
            replies.append(item)
    if not (tokens or chunks or replies):
        return None
    return pb.ServeDown(chunks=chunks, replies=replies, token_calls=token_calls, token_counts=counts, tokens=tokens)


def _sampling(r: pb.GenerateRequest) -> Sampling:
    if not r.HasField("sampling"):
        return GREEDY
    s = r.sampling
    return Sampling(
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def _error_chunk(rid: str, error: str) -> pb.TokenChunk:
    """The last chunk of a request that failed: finish_reason "error" and a one-line reason."""
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="error", error=error)


def _aborted_chunk(rid: str) -> pb.TokenChunk:
    """The last chunk of a request stopped here (`Cancel`, or its caller gone): finish_reason "abort"."""
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="abort", error="aborted")


def _refused_chunk(rid: str, reason: str) -> pb.TokenChunk:
    """The only chunk of a request this instance will not start (draining, flipping, another role now):
    nothing was done, so the caller can send it elsewhere."""
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="refused", error=reason)


class WorkerService(rpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        role: str,
        instance_id: str,
        peers: Peers,
        token: str | None = None,
        engine_factory: Callable[[str], Engine] | None = None,
    ) -> None:
        self.engine = engine
        self.role = role
        self.instance_id = instance_id
        self.peers = peers
        self.token = token
        self.engine_factory = engine_factory  # builds an engine for another role (instance flip)
        self.decode_view = DecodeView(rng=random.Random(instance_id))
        self.jobs: dict[str, _DecodeJob] = {}  # decode: accepted requests
        # colocated: calls in progress -> the call's feed and the task putting the engine's tokens on it
        self.generating: dict[str, tuple[_Feed, asyncio.Task[None]]] = {}
        # prefill: requests waiting for a decode instance to take their KV -> the Accept call's answer queue
        self.handing_over: dict[str, LoopQueue[Answer | StreamBroken]] = {}
        self.serving = ServeStreams(peers)  # prefill: this worker's Serve streams to decode workers
        self.prefilling = 0  # prefill: generate calls in progress
        self.state = "active"
        self.policies = PolicySet()
        self.policy_version = 0
        self.predictor: LengthPredictor | None = None
        self.plan_loaded = False  # decode: admitting in the order of a Sorted-F plan (SetPlan)
        # the prefix cache's events on the report stream (`cache_events`): the stream's epoch, the last
        # batch's number, and whether the next batch must be the engine's whole cache
        self._cache_epoch, self._cache_seq, self._cache_reset = 0, -1, True

    # --- policies (hot-swap) -------------------------------------------------------------------------
    def on_broadcast(self, msg: pb.DecodeLoadBroadcast) -> None:
        """The daemon's broadcast: decode load for the dispatcher, and the policies when they changed."""
        self.decode_view.update(decode_loads(msg, self.engine.model_name))
        if msg.policy_version != self.policy_version and msg.policies_json:
            self.apply_policies(PolicySet(**json.loads(msg.policies_json)), msg.policy_version)

    def apply_policies(self, policies: PolicySet, version: int = 0) -> None:
        old = self.policies
        self.policies, self.policy_version = policies, version
        if (policies.predictor, policies.predictor_accuracy, policies.predictor_granularity) != (
            old.predictor,
            old.predictor_accuracy,
            old.predictor_granularity,
        ) or (self.predictor is None and policies.predictor != "none"):
            self.predictor = make_predictor(
                policies.predictor, policies.predictor_accuracy, policies.predictor_granularity, seed=0
            )
        configure = getattr(self.engine, "configure", None)
        if configure is not None:  # a loaded Sorted-F plan keeps this instance on `plan` admission
            configure(policies.changed(decode_admission="plan") if self.plan_loaded else policies)

    @staticmethod
    def _req(r: pb.GenerateRequest) -> EngineRequest:
        pred = (r.predicted_lo, r.predicted_hi) if r.predicted_lo > 0 else None
        sampling = _sampling(r)
        return EngineRequest(r.request_id, tuple(r.prompt_token_ids), r.max_tokens, pred, r.resumed_tokens, sampling)

    # --- the Serve stream: the daemon's calls, and a prefill worker's hand-overs ------------------------
    async def Serve(
        self, request_iterator: AsyncIterator[pb.ServeUps], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ServeDown]:
        """Every call one caller makes on this worker, multiplexed (`tetri.proto.serve`): each
        `generate`/`attach` runs as its own task, and the task reading the call's engine iterator puts its
        tokens, then its end (tagged with the call), straight onto this stream's `out` queue (`_Feed`); one
        message goes out for all tokens, chunks and replies ready; an `accept` is answered by one
        `AcceptReply`; `close` cancels a call (as a client leaving a stream would); the stream ending cancels
        them all."""
        loop = asyncio.get_running_loop()  # once: looking it up costs a system call on 3.11 (tetri.loopqueue)
        out = _Out(loop)
        calls: dict[int, asyncio.Task[None]] = {}

        async def answer(call: int, request: pb.AcceptRequest) -> None:
            try:
                reply = await self._accept(request)
            except Exception as e:  # a fault in this call ends it alone, with the reason
                log.exception("call %d (accept of %s) failed", call, request.request.request_id)
                reply = pb.AcceptReply(accepted=False, reason=f"worker {self.instance_id}: {type(e).__name__}: {e}")
            finally:
                calls.pop(call, None)
            reply.call = call
            out.put_nowait(reply)

        async def run(call: int, rid: str, work: Callable[[], Awaitable[None]]) -> None:
            try:
                await work()  # made here: a call closed before its task starts leaves no coroutine unawaited
            except Exception as e:  # a fault in this call ends it alone, with the reason
                log.exception("call %d (request %s) failed", call, rid)
                chunk = _error_chunk(rid, f"worker {self.instance_id}: {type(e).__name__}: {e}")
                chunk.call = call
                out.put_nowait(chunk)
            finally:
                calls.pop(call, None)

        def start(up: pb.ServeUp) -> None:
            op, call = up.WhichOneof("op"), up.call
            if op == "generate":
                generate = up.generate
                calls[call] = loop.create_task(
                    run(call, generate.request_id, lambda: self.generate(generate, call, out))
                )
            elif op == "attach":
                attach = up.attach
                calls[call] = loop.create_task(run(call, attach.request_id, lambda: self.attach(attach, call, out)))
            elif op == "accept":
                calls[call] = loop.create_task(answer(call, up.accept))
            else:  # close
                task = calls.get(call)
                if task is not None:
                    task.cancel()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    for up in message.ups:
                        start(up)
            finally:
                out.put_nowait(None)  # the caller closed the stream

        reader = asyncio.create_task(read())
        try:
            while True:
                first = await out.get()
                if first is None:
                    return
                batch, end = [first], False
                await asyncio.sleep(0)  # the other calls woken by this engine step add theirs: one message
                while not out.empty():
                    item = out.get_nowait()
                    if item is None:
                        end = True
                        break
                    batch.append(item)
                down = _down(batch)
                if down is not None:
                    yield down
                if end:
                    return
        finally:
            reader.cancel()
            running = list(calls.values())
            for task in running:
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def generate(self, request: pb.GenerateRequest, call: int, out: _Out) -> None:
        """A Generate call, answered on `out`: colocated, every token; prefill, the first token then the
        hand-off chunk."""
        req = self._req(request)
        feed = _Feed(call, out)
        if self.state != "active":
            feed.finish(_refused_chunk(req.request_id, f"instance {self.instance_id} is {self.state}"))
        elif self.role == "colocated":
            await self._colocated(req, feed)
        elif self.role != "prefill":
            feed.finish(_refused_chunk(req.request_id, f"instance {self.instance_id} is a {self.role} instance"))
        else:
            self.prefilling += 1
            try:
                await self._prefill(request, req, feed)
            finally:
                self.prefilling -= 1

    async def _colocated(self, req: EngineRequest, feed: _Feed) -> None:
        """A colocated Generate call: this task puts the engine's tokens on the call's feed, then its end,
        which says how much of the prompt the prefix cache held. `Cancel` ends the call with "abort" and
        cancels this task; the caller leaving (a client, or a daemon that moved the request) cancels it too.
        Either way the engine drops the request."""
        rid = req.request_id
        task = asyncio.current_task()  # once per request: Cancel stops it
        assert task is not None
        self.generating[rid] = (feed, task)
        done = False
        try:
            end = await _stream(rid, self.engine.generate_to(req, feed), feed, 0, req.max_tokens)
            done = True
        finally:
            self.generating.pop(rid, None)
            if not done:
                if feed.end is None:  # not our Cancel
                    log.info("request %s: its caller left; aborted", rid)
                await self.engine.abort(rid)
        if feed.end is None:
            end.cached_tokens = self._cached(rid)
            feed.finish(end)

    async def _prefill(self, request: pb.GenerateRequest, req: EngineRequest, feed: _Feed) -> None:
        rid = req.request_id
        if self.predictor is not None and not request.predicted_lo:
            # the length predictor runs beside the prefill (TetriInfer §3.3.2); the sim engine's
            # "true" output length is max_tokens, which the oracle predictor is allowed to see
            lo, hi = self.predictor.predict(request.prompt_token_ids, rid, true_output=request.max_tokens)
            predicted = pb.GenerateRequest()
            predicted.CopyFrom(request)
            predicted.predicted_lo, predicted.predicted_hi = lo, hi
            request = predicted
        try:
            out = await self.engine.prefill(req)
        except Rejected as e:  # waited past the TTFT target (`ttft_miss` reject): the daemon answers 429
            feed.finish(pb.TokenChunk(request_id=rid, finished=True, finish_reason="rejected", error=str(e)))
            return
        except EngineError as e:
            feed.finish(_error_chunk(rid, str(e)))
            return
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        cached = self._cached(rid)
        if req.max_tokens <= 1 or out.first_token in req.sampling.stop_token_ids:
            await self.engine.release_kv(rid)
            reason = "length" if out.first_token not in req.sampling.stop_token_ids else "stop"
            feed.finish(
                pb.TokenChunk(
                    request_id=rid,
                    token_ids=[out.first_token],
                    finished=True,
                    finish_reason=reason,
                    cached_tokens=cached,
                )
            )
            return
        try:  # from here the prompt's KV is held here until the hand-over ends, however it ends
            feed.extend([out.first_token])
            end = await self._hand_over(request, rid, out.first_token, out.kv)
            end.cached_tokens = cached
            feed.finish(end)
        finally:
            await self.engine.release_kv(rid)

    async def _hand_over(self, request: pb.GenerateRequest, rid: str, first_token: int, kv: KVHandle) -> pb.TokenChunk:
        """After the first token: a decode instance takes the KV (its Accept is answered once its admission
        pulled it); returns the hand-off chunk, or the reason none did. `Cancel` meanwhile ends it with
        "abort"."""
        accept = pb.AcceptRequest(
            request=request,
            first_token=first_token,
            kv=pb.KVHandle(
                request_id=rid,
                num_tokens=kv.num_tokens,
                num_bytes=kv.num_bytes,
                source_instance_id=kv.source_instance_id,
                params=kv.params,
            ),
        )
        refused: list[str] = []
        last_reason = ""
        for _ in range(ACCEPT_ATTEMPTS):  # a refusal (draining, flipping, gone) tries another instance
            target = await self._target(request, frozenset(refused))
            if target is None:
                break
            decode_id, address = target
            # an Accept call on this worker's Serve stream to the decode worker, answered once the decode
            # instance has taken the KV (its admission pulled it), which may wait behind its queue: no
            # deadline. Leaving the call unanswered drops the request there too.
            stream = self.serving.to(address)
            answers = AnswerQueue()
            call = stream.open(answers, accept=accept)
            self.handing_over[rid] = answers
            got: object = None
            try:
                got = await answers.get()
            finally:
                self.handing_over.pop(rid, None)
                stream.leave(call, finished=isinstance(got, pb.AcceptReply))
            if got is _CANCELLED:  # our Cancel RPC
                return _aborted_chunk(rid)
            if isinstance(got, StreamBroken):
                reply = pb.AcceptReply(accepted=False, reason=f"decode instance {decode_id} unreachable: {got.code}")
            else:
                assert isinstance(got, pb.AcceptReply)
                reply = got
            if reply.accepted:
                return pb.TokenChunk(
                    request_id=rid, handoff=pb.Handoff(decode_instance_id=decode_id, decode_address=address)
                )
            refused.append(decode_id)
            last_reason = reply.reason
        error = last_reason if refused else "no healthy decode instance to hand over to"
        return _error_chunk(rid, error)

    async def _target(self, request: pb.GenerateRequest, exclude: frozenset[str]) -> tuple[str, str] | None:
        """The decode instance to hand over to (the pinned one, or the dispatcher's pick), or None. The view
        is the daemon's last broadcast, which lags its registry (a decode instance that just registered,
        or one whose reports are late on a busy host): without a candidate, later broadcasts are awaited
        for up to `TARGET_WAIT_S` (one was not always enough: a broadcast already on its way is stale)."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            if request.decode_instance_id:
                hit = self.decode_view.instances.get(request.decode_instance_id)
                target = (
                    (request.decode_instance_id, hit[0]) if hit and request.decode_instance_id not in exclude else None
                )
            else:
                target = self.decode_view.choose(self.policies.dispatch, request.predicted_lo or None, exclude)
            left = deadline - time.monotonic()
            if target is not None or left <= 0:
                return target
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.decode_view.updated.wait(), timeout=left)

    async def _accept(self, request: pb.AcceptRequest) -> pb.AcceptReply:
        """An Accept call (decode): take over a prefilled request; answered once the engine has taken its
        KV (or why not). Cancelled (the prefill side left the call), the request is dropped here."""
        if self.role != "decode":
            return pb.AcceptReply(accepted=False, reason=f"instance {self.instance_id} is a {self.role} instance")
        if self.state != "active":
            return pb.AcceptReply(accepted=False, reason=f"instance {self.instance_id} is {self.state}")
        req = self._req(request.request)
        if req.request_id in self.jobs:
            return pb.AcceptReply(accepted=False, reason=f"request {req.request_id} already here")
        kv = KVHandle(
            request.kv.request_id,
            request.kv.num_tokens,
            request.kv.num_bytes,
            request.kv.source_instance_id,
            dict(request.kv.params),
        )
        job = _DecodeJob(req, kv_tokens=kv.num_tokens)
        taken: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        job.task = asyncio.create_task(self._decode(job, kv, request.first_token, taken))
        self.jobs[req.request_id] = job
        try:
            error = await taken  # the engine took the KV (None) or could not (why)
        except asyncio.CancelledError:  # the prefill side gave up on the hand-over: drop it here too
            self.jobs.pop(req.request_id, None)
            job.task.cancel()
            await self.engine.abort(req.request_id)
            raise
        if error is not None:
            self.jobs.pop(req.request_id, None)
            return pb.AcceptReply(accepted=False, reason=error)
        return pb.AcceptReply(accepted=True)

    async def _decode(self, job: _DecodeJob, kv: KVHandle, first_token: int, taken: asyncio.Future[str | None]) -> None:
        """A decode job's task: the engine takes the KV (`taken` says whether it did), then this task puts its
        tokens on the job's feed, which holds them until the Attach call binds it to a stream. Cancelled
        (`Cancel`, its caller gone, the prefill side gone), the job ends with "abort"."""
        rid = job.req.request_id
        try:
            await self.engine.load_kv(job.req, kv)
            if not taken.done():
                taken.set_result(None)
            feed = job.feed
            end = await _stream(rid, self.engine.decode_to(job.req, first_token, feed), feed, 1, job.req.max_tokens)
        except EngineError as e:  # the engine could not take the KV
            if not taken.done():
                taken.set_result(str(e))
            end = _stopped(rid, e)
        except asyncio.CancelledError:  # cancelled before the KV was taken, while it arrives, or decoding
            if not taken.done():
                taken.set_result(f"request {rid} cancelled")
            self._decoded(job, _aborted_chunk(rid))
            raise
        self._decoded(job, end)

    def _decoded(self, job: _DecodeJob, end: pb.TokenChunk) -> None:
        """A decode job's end, which says how much of the prompt came with the hand-over."""
        end.kv_loaded_tokens = self._kv_loaded(job.req.request_id, job)
        job.feed.finish(end)

    async def attach(self, request: pb.AttachRequest, call: int, out: _Out) -> None:
        """An Attach call (decode), answered on `out`: the job's feed is bound to it, so the tokens decoded
        since Accept go at once, and the rest as the job's task produces them, until its end."""
        rid = request.request_id
        job = self.jobs.get(rid)
        if job is None or job.task is None:
            _Feed(call, out).finish(_error_chunk(rid, f"unknown request {rid}"))
            return
        task = job.task
        job.feed.bind(call, out)
        try:
            await asyncio.wait((task,))  # not `await task`: this call's cancellation would reach it first
        finally:
            self.jobs.pop(rid, None)
            if not task.done():  # the caller left: nothing more goes out on its call, and the request stops
                job.feed.unbind()
                log.info("request %s: its caller left; aborted", rid)
                task.cancel()
                await self.engine.abort(rid)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelReply:
        rid = request.request_id
        job = self.jobs.pop(rid, None)
        if job is not None and job.task is not None:  # its task ends the job with "abort"
            job.task.cancel()
        stream = self.generating.get(rid)
        if stream is not None:  # the colocated call ends with "abort", not as a short "stop"
            feed, task = stream
            end = _aborted_chunk(rid)
            end.cached_tokens = self._cached(rid)
            feed.finish(end)
            task.cancel()
        handover = self.handing_over.pop(rid, None)
        if handover is not None:  # prefilled, waiting for a decode instance to pull the KV: stop that
            handover.put_nowait(_CANCELLED)
        await self.engine.abort(rid)
        return pb.CancelReply(found=job is not None or stream is not None or handover is not None)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        return pb.InfoReply(
            instance_id=self.instance_id,
            role=self.role,
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            load=self.load_report(0.0),
        )

    async def Flip(self, request: pb.FlipRequest, context: grpc.aio.ServicerContext) -> pb.FlipReply:
        """Instance flip (TetriInfer §3.5): stop taking new work, drain what is queued and running,
        then change role on a fresh engine. Peers stop sending here as soon as the daemon's broadcast
        says draining; a hand-over that still arrives is refused and the prefill tries elsewhere."""
        to = request.to_role
        refusal = flip_refusal(self.instance_id, self.role, self.state, to, None)  # the daemon counts instances
        if refusal is not None:
            return pb.FlipReply(ok=False, reason=refusal.reason)
        if self.engine_factory is None:
            return pb.FlipReply(ok=False, reason="this worker cannot build an engine for another role")
        self.state = "draining"
        while self.prefilling or self.jobs or self.generating or self._engine_busy():
            await asyncio.sleep(0.01)
        drained = asyncio.get_running_loop().time()
        self.state = "flipping"
        set_role = getattr(self.engine, "set_role", None)
        if set_role is not None and set_role(to):  # the engine plays both roles (vLLM with kv_both)
            self.role = to
            self.apply_policies(self.policies, self.policy_version)
        else:
            old = self.engine
            new = self.engine_factory(to)
            await new.start()
            freeze_startup_heap()  # the new engine's heap too
            self.engine, self.role = new, to
            self._cache_reset = True  # a new engine, a new (empty) prefix cache: the next batch says so
            self.apply_policies(self.policies, self.policy_version)
            await old.stop()
        self.state = "active"
        return pb.FlipReply(ok=True, drained_at=drained)

    async def SetPlan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext) -> pb.PlanReply:
        """Load (or clear) a Sorted-F plan: this decode instance admits in the plan's order while the
        plan's future fits its KV capacity (M = the engine's capacity)."""
        set_plan = getattr(self.engine, "set_plan", None)
        if self.role != "decode":
            return pb.PlanReply(ok=False, reason=f"instance {self.instance_id} is a {self.role} instance")
        if set_plan is None:
            return pb.PlanReply(ok=False, reason="this engine has no plan admission")
        self.plan_loaded = not request.clear
        set_plan([] if request.clear else list(request.order))
        self.apply_policies(self.policies, self.policy_version)
        return pb.PlanReply(ok=True)

    def _kv_loaded(self, rid: str, job: _DecodeJob) -> int:
        """Prompt tokens this decode took from the hand-over rather than recomputing; -1 when unknown."""
        loaded = getattr(self.engine, "kv_loaded", None)
        if loaded is not None:
            n = loaded(rid)
            return -1 if n is None else int(n)
        return job.kv_tokens  # the sim engine loads the whole handle

    def _engine_busy(self) -> bool:
        u = self.engine.usage()
        return bool(u.running or u.waiting)

    def _cached(self, rid: str) -> int:
        """Prompt tokens of the request its prefill found in the prefix cache; -1 when unknown."""
        n = self.engine.cached_tokens(rid)
        return -1 if n is None else int(n)

    def cache_stream(self, epoch: int) -> None:
        """A new report stream (a new connection to the daemon): its first batch is the whole cache."""
        self._cache_epoch, self._cache_seq, self._cache_reset = epoch, -1, True

    def cache_events(self) -> pb.CacheEvents | None:
        """The next batch of prefix-cache events for the report stream: the engine's whole cache when the
        stream is new or the engine is (a flip built another), else what changed since the last batch
        (None: nothing)."""
        engine = self.engine
        if self._cache_reset:
            engine.cache_delta()  # what the whole cache says already
            stored, removed, reset = engine.cache_keys(), list[int](), True
        else:
            stored, removed = engine.cache_delta()
            reset = False
            if not stored and not removed:
                return None
        self._cache_reset = False
        self._cache_seq += 1
        return pb.CacheEvents(
            epoch=self._cache_epoch,
            seq=self._cache_seq,
            reset=reset,
            stored=stored,
            removed=removed,
            block_size=engine.block_size,
        )

    def load_report(self, now: float, cache: bool = False) -> pb.LoadReport:
        """This instance's load; with `cache` (the report stream's), the prefix cache's next batch of events."""
        u = self.engine.usage()
        report = pb.LoadReport(
            instance_id=self.instance_id,
            role=self.role,
            state=self.state,
            queued=u.waiting,
            running=u.running,
            kv_used_tokens=u.kv_used_tokens,
            kv_capacity_tokens=u.kv_capacity_tokens,
            tokens_per_s=u.tokens_per_s,
            preemptions=u.preemptions,
            timestamp=now,
            heavy=u.heavy,
            light=u.light,
            predicted_growth_tokens=u.predicted_growth_tokens,
            held_kv_tokens=u.held_tokens,
            policy_version=self.policy_version,
            prefix_query_tokens=u.prefix_query_tokens,
            prefix_hit_tokens=u.prefix_hit_tokens,
        )
        events = self.cache_events() if cache else None
        if events is not None:
            report.cache.CopyFrom(events)
        return report

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
                with contextlib.suppress(BaseException):
                    await job.task
        self.jobs.clear()
        await self.serving.close()
