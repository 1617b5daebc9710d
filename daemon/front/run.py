"""One request in flight, as one object: the gateway's `Run` follows it through prefill → transfer →
decode (and a migration when an instance is lost), fed by the worker calls it opens, writing its output.

Two paths, so a token costs no task switch and no generator of its own:
- tokens: the Serve stream's reader calls `tokens(ids)` for each engine step's tokens of this request. It
  counts them (TTFT, the phase, the metrics), detokenizes them incrementally (`TextStream`) and hands them
  to the request's `Output`, which writes their frame there and then (one write per request and step).
- control: a call's end (finished, the hand-off, an error) and a lost worker are events the request's task
  takes in order (`_next`), in `drive`: the sequence of calls, refusals and migrations, written once as
  straight-line code.

It must not read the wall clock for a timestamp (the cluster clock: `host.clock`), nor know HTTP or gRPC.
What it needs of the front is `RunHost`, passed in: it calls nothing back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tetri.clock import Clock

from ..db.models import Phase, Status
from ..inflight import Inflight
from ..metrics import Metrics
from ..worker_client import Call, Handoff, TokenChunk, WorkerCallError, WorkerClient
from .route import Router
from .textstream import TextStream

log = logging.getLogger(__name__)
ENTRY_ATTEMPTS = 3  # entry instances tried when they refuse before starting anything


@dataclass(frozen=True)
class RunHost:
    """What a `Run` needs of the front serving it, passed in (the gateway makes one): the cluster clock, the
    router (entry instances and the count of what runs where), the worker client, the metrics and the
    migration limit. A run calls nothing else of the front."""

    clock: Clock
    router: Router
    workers: WorkerClient
    metrics: Metrics
    max_migrations: int


@dataclass
class Finished:
    reason: str  # "length" | "stop" | "cancelled"
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens its prefill found in the prefix cache (None: not known)


@dataclass
class Failed:
    message: str
    status: Status = Status.FAILED


class Output(Protocol):
    """Where a request's output goes (an SSE stream, a whole completion)."""

    def tokens(self, ids: list[int], text: str) -> None:
        """Tokens that count (and their text, when the request asked for text): send or keep them. Called
        from the Serve stream's reader: it must not wait, nor raise."""


@dataclass
class _Lost:
    """The instance serving the request died or became unreachable mid-stream: migrate the request."""

    instance_id: str
    message: str


@dataclass
class _Refused:
    """An entry instance started nothing (draining, flipping, another role now): serve it elsewhere."""

    reason: str


class Run:
    """A request's calls to workers and what they answer; `drive()` runs in the request's own task."""

    def __init__(self, host: RunHost, fl: Inflight, out: Output, text: TextStream | None) -> None:
        self.host = host
        self.fl = fl
        self.out = out
        self.text = text
        self.call: Call | None = None  # the worker call open now
        self.got = 0  # tokens from that call
        self.last = 0.0  # cluster time of the last tokens
        self.stopped: Finished | Failed | None = None  # a stop token or string (or a fault) ended the output
        self._events: deque[TokenChunk | WorkerCallError | Finished | Failed] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()

    # --- the token path (the Serve stream's reader calls these) -------------------------------------------
    def tokens(self, ids: list[int]) -> None:
        """A step's tokens. A fault here ends this request alone (the reader serves every call on its
        stream): it fails, and leaves its worker call."""
        if self.stopped is not None:
            return
        try:
            self._tokens(ids)
        except Exception as e:
            log.exception("request %s: its output failed", self.fl.id)
            self.stopped = Failed(f"the daemon failed on this request's output: {type(e).__name__}: {e}")
            self._leave()
            self._events.append(self.stopped)
            self._notify()

    def _tokens(self, ids: list[int]) -> None:
        fl, host = self.fl, self.host
        now = host.clock.now()
        n = len(ids)
        if fl.produced == 0:
            fl.first_token_ts = now
            host.metrics.ttft.observe(now - fl.arrival)
        else:
            host.metrics.itl.observe((now - self.last) / n)
            if fl.phase is Phase.TRANSFER:
                fl.decode_start_ts = now
                fl.enter(Phase.DECODE, now)
        fl.produced += n
        self.got += n
        fl.output += ids
        host.metrics.tokens.inc(n)
        self.last = now
        text = self.text
        if text is None:
            self.out.tokens(ids, "")
        else:
            delta = text.feed(ids)
            if delta.stopped:  # a stop token or string: the request ends here and the worker stops
                fl.produced -= n - len(delta.ids)  # tokens after the stop do not count
                self.stopped = Finished("stop", fl.produced)
                self._leave()
                self._events.append(self.stopped)
            if delta.ids or delta.text:
                self.out.tokens(delta.ids, delta.text)
            if delta.stopped:
                self._notify()

    def end(self, chunk: TokenChunk) -> None:
        self.call = None  # over (its Serve stream has let it go)
        if chunk.token_ids:
            self.tokens(chunk.token_ids)
        if self.stopped is None:
            self._events.append(chunk)
            self._notify()

    def lost(self, error: WorkerCallError) -> None:
        self.call = None
        if self.stopped is None:
            self._events.append(error)
            self._notify()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _leave(self) -> None:
        """Leave the open call (the worker stops it unless it is over)."""
        if self.call is not None:
            self.call.leave()
            self.call = None

    # --- control (the request's task) ------------------------------------------------------------------
    async def _next(self) -> TokenChunk | WorkerCallError | Finished | Failed:
        """The open call's next event (its end, a hand-off, a stop, the worker lost)."""
        while True:
            if self._events:
                return self._events.popleft()
            self._wake = self._loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    async def drive(self, prompt: list[int], pin: str | None) -> Finished | Failed:
        """Serve the request to its end, migrating it when the instance serving it is lost: before its first
        token it starts again on another entry instance; later, the prompt plus the tokens already streamed
        is prefilled again and the stream continues where it stopped (nothing repeated, nothing skipped).
        Cancelled (the client left, the daemon shutting down), it leaves its open call."""
        fl, host = self.fl, self.host
        try:
            while True:
                got = await self._attempt(prompt + fl.output, pin)
                if not isinstance(got, _Lost):
                    break
                if fl.interrupted:
                    return Failed(fl.interrupted, Status.INTERRUPTED)
                if fl.cancelled:
                    return Finished("cancelled", fl.produced)
                host.router.suspect(got.instance_id)
                if fl.produced >= fl.max_tokens:  # the last token arrived, its end did not
                    return Finished("length", fl.produced)
                if fl.migrations >= host.max_migrations:
                    return Failed(f"{got.message} (not migrated: {fl.migrations} of {host.max_migrations} tries used)")
                fl.migrations += 1
                fl.migrated_from.append(got.instance_id)
                pin = None if pin == got.instance_id else pin
                host.metrics.migrations.inc()
                log.warning(
                    "request %s: %s; migrating after %d tokens (try %d)",
                    fl.id,
                    got.message,
                    fl.produced,
                    fl.migrations,
                )
        finally:
            self._leave()
        text = self.text
        if text is not None and self.stopped is None and isinstance(got, Finished):
            rest = text.rest()
            if rest:
                self.out.tokens([], rest)
        return got

    async def _attempt(self, prompt: list[int], pin: str | None) -> Finished | Failed | _Lost:
        """One try on one entry instance (and the decode instance it hands over to). `prompt` ends with
        the output tokens already streamed when the request is migrating."""
        fl, host = self.fl, self.host
        resumed = len(fl.output)
        predicted = fl.predicted
        if predicted is not None and resumed:
            predicted = (max(1, predicted[0] - resumed), max(1, predicted[1] - resumed))
        refused: list[str] = []
        ev: Finished | Failed | Handoff | _Refused | _Lost
        while True:
            # a lost instance is out of routing (unhealthy) until it reports again: a worker restarted under
            # the same id is a candidate again
            entry = await host.router.entry(fl, frozenset(refused), prompt, predicted, split=bool(pin))
            if fl.interrupted:
                return Failed(fl.interrupted, Status.INTERRUPTED)
            if isinstance(entry, str):
                return Failed(f"{entry}; refused by {', '.join(refused)}" if refused else entry)
            host.router.serve_on(fl, entry)
            fl.prefill_instance = entry.id
            now = host.clock.now()
            if not fl.migrations:
                fl.prefill_start_ts = now
            fl.enter(Phase.PREFILL, now)
            self.got = 0
            self.call = host.workers.generate(
                entry.address,
                fl.id,
                prompt,
                fl.max_tokens - resumed,
                predicted,
                pin or "",
                resumed,
                fl.sampling,
                receiver=self,
            )
            ev = await self._follow(entry.id)
            if isinstance(ev, Handoff):
                break
            if isinstance(ev, _Refused):
                if len(refused) < ENTRY_ATTEMPTS - 1:
                    # it started nothing (it began draining after we chose it, or changed role): elsewhere
                    refused.append(entry.id)
                    continue
                return Failed(f"instance {entry.id}: {ev.reason}")
            return ev
        handoff = ev
        decode = host.router.cluster.instances.get(handoff.decode_instance_id)
        fl.decode_instance = handoff.decode_instance_id
        fl.enter(Phase.TRANSFER, host.clock.now())
        if decode is not None:
            host.router.serve_on(fl, decode)
        else:
            host.router.release(fl)
            fl.serving = (handoff.decode_instance_id, handoff.decode_address)
        self.got = 0
        self.call = host.workers.attach(handoff.decode_address, fl.id, receiver=self)
        ev = await self._follow(handoff.decode_instance_id)
        if isinstance(ev, Handoff):
            return Failed("decode instance tried to hand over again")
        if isinstance(ev, _Refused):
            return Failed(f"instance {handoff.decode_instance_id}: {ev.reason}")
        return ev

    async def _follow(self, name: str) -> Finished | Failed | Handoff | _Refused | _Lost:
        """The open call (`name`: the instance serving it) to its end or hand-over. The worker lost at the
        transport (died, unreachable) ends it with `_Lost`."""
        fl = self.fl
        ev = await self._next()
        if isinstance(ev, WorkerCallError):
            if fl.interrupted:
                return Failed(fl.interrupted, Status.INTERRUPTED)
            if fl.cancelled:
                return Finished("cancelled", fl.produced)
            return _Lost(name, f"instance {name} failed mid-request: {ev.code}")
        if not isinstance(ev, TokenChunk):
            return ev  # a stop token or string (or a fault in its output) ended it
        if fl.phase is Phase.PREFILL and ev.cached_tokens >= 0:  # the entry call's end (colocated, or the hand-off)
            fl.cached_tokens = ev.cached_tokens
        if ev.handoff is not None:
            return ev.handoff
        if fl.phase in (Phase.TRANSFER, Phase.DECODE) and ev.kv_loaded_tokens >= 0:
            fl.kv_loaded_tokens = ev.kv_loaded_tokens
        if fl.interrupted:
            return Failed(fl.interrupted, Status.INTERRUPTED)
        if ev.finish_reason == "abort" or fl.cancelled:  # however the worker reports the abort
            return Finished("cancelled", fl.produced)
        if ev.finish_reason == "refused" and self.got == 0:
            return _Refused(ev.error)
        if ev.finish_reason == "error":
            return Failed(f"instance {name}: {ev.error}")
        if ev.finish_reason == "rejected":  # before its first token; after one (a bug) it is a failure
            return Failed(f"instance {name}: {ev.error}", Status.REJECTED if fl.produced == 0 else Status.FAILED)
        return Finished(ev.finish_reason or "length", fl.produced)
