"""The global scheduler (TetriInfer §3.2): route each request to the least-loaded prefill (or
colocated) instance, follow it through prefill → transfer → decode, stream its tokens back, and record
it in the status table (batched, off the streaming path).

A request's stream yields `Tokens` events and ends with one `Finished` event; failures end it with
`Failed` (the worker died, no instance, …). Cancellation: `cancel(id)` asks the worker serving it to
abort; a client that disconnects cancels its calls to the workers (`daemon.worker_client`).

Every time recorded here comes from the cluster clock (`Cluster.clock`): TTFT and JCT are model time
when the cluster runs scaled (docs/cluster.md, "Timestamps: one clock per cluster").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from tetri.sampling import GREEDY, Sampling

from .cluster import Cluster, Instance
from .db.models import Phase, Status
from .db.writer import BatchWriter
from .metrics import Metrics
from .predictor_service import PROMPT_SAMPLE, PredictorService
from .textstream import TextStream
from .worker_client import Handoff, TokenChunk, WorkerCallError, WorkerClient

log = logging.getLogger(__name__)


@dataclass
class Tokens:
    ids: list[int]
    text: str = ""  # the ids' text as far as it can be sent yet (`TextStream`), when the request asked for text


@dataclass
class Finished:
    reason: str  # "length" | "stop" | "cancelled"
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: Status = Status.FAILED


@dataclass
class Lost:
    """The instance serving the request died or became unreachable mid-stream: migrate the request."""

    instance_id: str
    message: str


@dataclass
class Refused:
    """An entry instance started nothing (draining, flipping, another role now): serve it elsewhere."""

    reason: str


RESERVATION_S = 30.0  # a reserved id whose stream never started (client gone) is free again after this
ENTRY_ATTEMPTS = 3  # entry instances tried when they refuse before starting anything


@dataclass
class Inflight:
    id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    phase: Phase = Phase.QUEUED
    prefill_instance: str | None = None
    decode_instance: str | None = None
    first_token_ts: float | None = None
    decode_start_ts: float | None = None
    produced: int = 0
    cancelled: bool = False
    predicted: tuple[int, int] | None = None
    serving: tuple[str, str] | None = None  # (instance id, address) currently producing tokens
    counted: Instance | None = None  # the registry entry whose `inflight` counts this request
    timeline: list[tuple[str, float]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)  # tokens streamed so far (a migration re-prefills them)
    migrations: int = 0
    migrated_from: list[str] = field(default_factory=list)
    interrupted: str | None = None  # why the daemon ended it (shutdown): the row says `interrupted`
    prompt_head: list[int] | None = None  # the predictor's features, kept in memory
    sampling: Sampling = GREEDY


class NoInstance(RuntimeError):
    pass


def new_request_id(prefix: str = "cmpl-") -> str:
    return prefix + os.urandom(12).hex()  # 24 random hex digits (uuid4's formatting costs 5× as much)


class Gateway:
    def __init__(
        self,
        cluster: Cluster,
        writer: BatchWriter,
        metrics: Metrics,
        predictor: PredictorService | None = None,
        *,
        workers: WorkerClient | None = None,
        max_migrations: int = 3,
        migration_wait_s: float = 30.0,
        entry_wait_s: float = 5.0,
        store_prompt_samples: bool = False,
    ) -> None:
        self.predictor = predictor
        self.max_migrations = max_migrations
        self.migration_wait_s = migration_wait_s
        self.entry_wait_s = entry_wait_s
        self.store_prompt_samples = store_prompt_samples
        self.draining = False
        self.cluster = cluster
        self.writer = writer
        self.metrics = metrics
        self.clock = cluster.clock
        self.workers = workers or WorkerClient()
        self.inflight: dict[str, Inflight] = {}
        # client-chosen ids admitted but not yet in flight (monotonic time of the reservation)
        self.reserved: dict[str, float] = {}

    # --- routing -----------------------------------------------------------------------------------
    def vocab_size(self, model: str) -> int | None:
        """The smallest vocabulary among the model's registered instances (None: none says)."""
        entry = self.cluster.catalog().get(model)
        return None if entry is None else entry.vocab_size

    def max_model_len(self, model: str | None = None) -> int | None:
        """The model's context (the smallest its instances announce); without a model, any model's."""
        catalog = self.cluster.catalog()
        lens = [e.known_context for m, e in catalog.items() if e.known_context and (model is None or m == model)]
        return min(lens) if lens else None

    def pick_entry(self, model: str, exclude: frozenset[str] = frozenset()) -> Instance:
        started = time.perf_counter()
        inst = self.cluster.entry(model, exclude)
        if inst is None:
            raise NoInstance("no healthy instance can serve the request (need prefill + decode, or colocated)")
        self.metrics.route.observe(time.perf_counter() - started)
        return inst

    # --- recording ---------------------------------------------------------------------------------
    def record_rejected(
        self, rid: str, message: str, prompt_tokens: int = 0, max_tokens: int = 0, model: str = ""
    ) -> None:
        now = self.clock.now()
        self.writer.submit_request_insert(
            id=rid,
            model=model[:128],
            phase=Phase.DONE,
            status=Status.REJECTED,
            arrival_ts=now,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            finished_ts=now,
            error=message[:500],
        )
        self.metrics.requests.labels(status=Status.REJECTED).inc()

    def _update(self, fl: Inflight, **fields: object) -> None:
        self.writer.submit_request_update(fl.id, **fields)

    def _phase(self, fl: Inflight, phase: Phase, **fields: object) -> None:
        fl.phase = phase
        fl.timeline.append((phase.value, self.clock.now()))
        self._update(fl, phase=phase.value, **fields)

    # --- the request ---------------------------------------------------------------------------------
    async def run(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        sla_ttft_ms: float | None = None,
        sla_jct_ms: float | None = None,
        pin: str | None = None,
        sampling: Sampling = GREEDY,
        text: TextStream | None = None,
    ) -> AsyncIterator[Tokens | Finished | Failed]:
        """Serve one request; ``pin`` pins its decode phase to that decode instance. With ``text``, each
        `Tokens` carries its text, and a stop token or stop string ends the request (`Finished("stop")`,
        the worker's stream cancelled); the held-back text comes in a last `Tokens` before `Finished`."""
        now = self.clock.now()
        fl = Inflight(rid, model, len(prompt_ids), max_tokens, now, timeline=[("queued", now)], sampling=sampling)
        if self.predictor is not None:
            fl.predicted = self.predictor.predict(self.cluster.policies, prompt_ids, rid, max_tokens)
            fl.prompt_head = prompt_ids[:PROMPT_SAMPLE]
        self.inflight[rid] = fl
        self.reserved.pop(rid, None)
        self.writer.submit_request_insert(
            id=rid,
            model=model,
            phase=Phase.QUEUED.value,
            status=Status.RUNNING.value,
            arrival_ts=now,
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            sla_ttft_ms=sla_ttft_ms,
            sla_jct_ms=sla_jct_ms,
            predicted_lo=fl.predicted[0] if fl.predicted else None,
            predicted_hi=fl.predicted[1] if fl.predicted else None,
            prompt_sample=json.dumps(prompt_ids[:PROMPT_SAMPLE]) if self.store_prompt_samples else None,
        )
        end: Finished | Failed | None = None
        events = self._serve(fl, prompt_ids, pin)
        try:
            async for ev in events:
                if not isinstance(ev, Tokens):
                    end = ev
                    break
                if text is None:
                    yield ev
                    continue
                delta = text.feed(ev.ids)
                if delta.stopped:  # a stop token or string: this request ends here, the worker stops
                    fl.produced -= len(ev.ids) - len(delta.ids)  # tokens after the stop do not count
                    end = Finished("stop", fl.produced)
                yield Tokens(delta.ids, delta.text)
                if end is not None:
                    break
            if text is not None and isinstance(end, Finished) and not text.stopped:
                rest = text.rest()
                if rest:
                    yield Tokens([], rest)
        except asyncio.CancelledError:
            if fl.interrupted:
                end = Failed(fl.interrupted, Status.INTERRUPTED)
            else:
                end = Failed("client disconnected", Status.CANCELLED)
            raise
        finally:
            await events.aclose()  # a stop mid-stream: closing it cancels the worker's call
            end = end or Failed("stream ended without a result")
            self._finish(fl, end)
        yield end

    def _finish(self, fl: Inflight, end: Finished | Failed) -> None:
        self.inflight.pop(fl.id, None)
        now = self.clock.now()
        jct_ms = (now - fl.arrival) * 1000
        self._release(fl)
        fl.timeline.append(("done", now))
        if isinstance(end, Finished):
            status = Status.CANCELLED if end.reason == "cancelled" else Status.FINISHED
            if status == Status.FINISHED and self.predictor is not None:
                self.predictor.observe(fl.predicted, fl.produced, fl.prompt_head)
            self._update(
                fl,
                phase=Phase.DONE.value,
                status=status.value,
                finished_ts=now,
                jct_ms=jct_ms,
                output_tokens=fl.produced,
                finish_reason=end.reason,
            )
            self.metrics.requests.labels(status=status).inc()
            if status == Status.FINISHED:
                self.metrics.jct.observe(jct_ms / 1000)
        else:
            self._update(
                fl,
                phase=Phase.DONE.value,
                status=end.status.value,
                finished_ts=now,
                jct_ms=jct_ms,
                output_tokens=fl.produced,
                finish_reason="cancelled" if end.status == Status.CANCELLED else "error",
                error=end.message[:500],
            )
            self.metrics.requests.labels(status=end.status).inc()

    def _release(self, fl: Inflight) -> None:
        if fl.counted is not None:  # that entry, even if re-registered since
            self.cluster.routed(fl.counted, -1)
        fl.counted = None
        fl.serving = None

    def _serve_on(self, fl: Inflight, inst: Instance) -> None:
        self._release(fl)
        fl.serving = (inst.id, inst.address)
        fl.counted = inst
        self.cluster.routed(inst, +1)

    async def _serve(
        self, fl: Inflight, prompt_ids: list[int], pin: str | None = None
    ) -> AsyncGenerator[Tokens | Finished | Failed, None]:
        """Run the request, migrating it when the instance serving it is lost: before its first token it
        starts again on another entry instance; later, the prompt plus the tokens already streamed is
        prefilled again and the stream continues where it stopped (nothing repeated, nothing skipped)."""
        while True:
            lost: Lost | None = None
            async for ev in self._attempt(fl, prompt_ids + fl.output, pin):
                if isinstance(ev, Lost):
                    lost = ev
                    break
                yield ev
                if not isinstance(ev, Tokens):
                    return
            if lost is None:
                yield Failed("stream ended without a result")
                return
            if fl.interrupted:
                yield Failed(fl.interrupted, Status.INTERRUPTED)
                return
            if fl.cancelled:
                yield Finished("cancelled", fl.produced)
                return
            self.cluster.suspect(lost.instance_id)
            if fl.produced >= fl.max_tokens:  # the last token arrived, its end did not
                yield Finished("length", fl.produced)
                return
            if fl.migrations >= self.max_migrations:
                yield Failed(f"{lost.message} (not migrated: {fl.migrations} of {self.max_migrations} tries used)")
                return
            fl.migrations += 1
            fl.migrated_from.append(lost.instance_id)
            pin = None if pin == lost.instance_id else pin
            self._update(fl, migrations=fl.migrations, migrated_from=",".join(fl.migrated_from)[-256:])
            self.metrics.migrations.inc()
            log.warning(
                "request %s: %s; migrating after %d tokens (try %d)", fl.id, lost.message, fl.produced, fl.migrations
            )

    def registered(self, model: str) -> bool:
        """Whether instances of the model that could serve a request together are registered, whatever
        their state now (colocated, or prefill and decode)."""
        entry = self.cluster.catalog().get(model)
        roles = frozenset() if entry is None else entry.roles
        return "colocated" in roles or {"prefill", "decode"} <= roles

    async def _entry(self, fl: Inflight, exclude: frozenset[str]) -> Instance | str:
        """The entry instance for this attempt, or why there is none. A migrating request waits up to
        `migration_wait_s` for one (a worker restarting); a new request up to `entry_wait_s` while its
        model's instances are registered but none can take it now (a load report late on a busy host, a
        flip, a drain), and not at all when they are not."""
        start = time.monotonic()
        while True:
            try:
                return self.pick_entry(fl.model, exclude)
            except NoInstance as e:
                wait = self.migration_wait_s if fl.migrations else self.entry_wait_s * self.registered(fl.model)
                if time.monotonic() - start >= wait or fl.cancelled or fl.interrupted:
                    return str(e)
            await asyncio.sleep(0.05)

    async def _attempt(
        self, fl: Inflight, prompt: list[int], pin: str | None
    ) -> AsyncIterator[Tokens | Finished | Failed | Lost]:
        """One try on one entry instance (and the decode instance it hands over to). `prompt` ends with
        the output tokens already streamed when the request is migrating."""
        resumed = len(fl.output)
        max_tokens = fl.max_tokens - resumed
        predicted = fl.predicted
        if predicted is not None and resumed:
            predicted = (max(1, predicted[0] - resumed), max(1, predicted[1] - resumed))
        refused: list[str] = []
        handoff: Handoff | None = None
        while handoff is None:
            # a lost instance is out of routing (unhealthy) until it reports again: a worker restarted under
            # the same id is a candidate again
            entry = await self._entry(fl, frozenset(refused))
            if fl.interrupted:
                yield Failed(fl.interrupted, Status.INTERRUPTED)
                return
            if isinstance(entry, str):
                yield Failed(f"{entry}; refused by {', '.join(refused)}" if refused else entry)
                return
            self._serve_on(fl, entry)
            fl.prefill_instance = entry.id
            if fl.migrations:
                self._phase(fl, Phase.PREFILL, prefill_instance=entry.id)
            else:
                self._phase(fl, Phase.PREFILL, prefill_instance=entry.id, prefill_start_ts=self.clock.now())
            stream = self.workers.generate(
                entry.address, fl.id, prompt, max_tokens, predicted, pin or "", resumed, fl.sampling
            )
            async for ev in self._stream(fl, entry.id, stream):
                if isinstance(ev, Handoff):
                    handoff = ev
                    break
                if isinstance(ev, Refused) and len(refused) < ENTRY_ATTEMPTS - 1:
                    # it started nothing (it began draining after we chose it, or changed role): elsewhere
                    refused.append(entry.id)
                    break
                yield ev if not isinstance(ev, Refused) else Failed(f"instance {entry.id}: {ev.reason}")
                if not isinstance(ev, Tokens):
                    return
            else:
                yield Lost(entry.id, f"instance {entry.id} ended the stream without a result")
                return
        decode = self.cluster.instances.get(handoff.decode_instance_id)
        fl.decode_instance = handoff.decode_instance_id
        self._phase(fl, Phase.TRANSFER, decode_instance=handoff.decode_instance_id)
        if decode is not None:
            self._serve_on(fl, decode)
        else:
            self._release(fl)
            fl.serving = (handoff.decode_instance_id, handoff.decode_address)
        call = self.workers.attach(handoff.decode_address, fl.id)
        async for ev in self._stream(fl, handoff.decode_instance_id, call):
            if isinstance(ev, Handoff):
                yield Failed("decode instance tried to hand over again")
                return
            if isinstance(ev, Refused):
                yield Failed(f"instance {handoff.decode_instance_id}: {ev.reason}")
                return
            yield ev
            if not isinstance(ev, Tokens):
                return

    async def _stream(
        self, fl: Inflight, name: str, call: AsyncGenerator[TokenChunk, None]
    ) -> AsyncIterator[Tokens | Finished | Failed | Handoff | Refused | Lost]:
        """Follow one worker stream (`name`: the instance serving it) until it ends or hands over. The
        worker lost at the transport (died, unreachable) ends it with `Lost`."""
        last = self.clock.now()
        got = 0  # tokens from this stream
        try:
            async for chunk in call:
                now = self.clock.now()
                if chunk.token_ids:
                    n = len(chunk.token_ids)
                    if fl.produced == 0:
                        fl.first_token_ts = now
                        ttft = (now - fl.arrival) * 1000
                        self._update(fl, first_token_ts=now, ttft_ms=ttft)
                        self.metrics.ttft.observe(ttft / 1000)
                    else:
                        self.metrics.itl.observe((now - last) / n)
                        if fl.phase == Phase.TRANSFER:
                            fl.decode_start_ts = now
                            self._phase(fl, Phase.DECODE, decode_start_ts=now)
                    fl.produced += n
                    got += n
                    fl.output.extend(chunk.token_ids)
                    self.writer.submit_progress(fl.id, fl.produced)  # current: a crash loses one flush at most
                    self.metrics.tokens.inc(n)
                    last = now
                    yield Tokens(chunk.token_ids)
                if chunk.handoff is not None:
                    yield chunk.handoff
                    return
                if chunk.finished:
                    if fl.phase in (Phase.TRANSFER, Phase.DECODE) and chunk.kv_loaded_tokens >= 0:
                        self._update(fl, kv_loaded_tokens=chunk.kv_loaded_tokens)
                    if fl.interrupted:
                        yield Failed(fl.interrupted, Status.INTERRUPTED)
                    elif chunk.finish_reason == "abort" or fl.cancelled:  # however the worker reports the abort
                        yield Finished("cancelled", fl.produced)
                    elif chunk.finish_reason == "refused" and got == 0:
                        yield Refused(chunk.error)
                    elif chunk.finish_reason == "error":
                        yield Failed(f"instance {name}: {chunk.error}")
                    else:
                        yield Finished(chunk.finish_reason or "length", fl.produced)
                    return
        except WorkerCallError as e:
            if fl.interrupted:
                yield Failed(fl.interrupted, Status.INTERRUPTED)
            elif fl.cancelled:
                yield Finished("cancelled", fl.produced)
            else:
                yield Lost(name, f"instance {name} failed mid-request: {e.code}")
            return
        finally:
            await call.aclose()  # closing the stream cancels the call on the worker
        yield Lost(name, f"instance {name} closed the stream early")

    async def cancel(self, rid: str) -> bool:
        """Abort an in-flight request on the instance serving it. False if it is not in flight."""
        fl = self.inflight.get(rid)
        if fl is None:
            return False
        fl.cancelled = True
        await self._stop(fl, timeout=5)
        return True

    async def cancel_many(self, prefix: str = "") -> list[str]:
        """Abort every in-flight request whose id starts with ``prefix`` (all, for ""), on their instances
        at once; the ids, sorted."""
        flights = [fl for rid, fl in list(self.inflight.items()) if rid.startswith(prefix) and not fl.cancelled]
        for fl in flights:
            fl.cancelled = True
        await asyncio.gather(*(self._stop(fl, timeout=5) for fl in flights))
        return sorted(fl.id for fl in flights)

    async def _stop(self, fl: Inflight, timeout: float) -> None:
        """Tell the instance serving a request to stop it (its stream then ends as cancelled)."""
        if fl.serving is not None:
            with contextlib.suppress(WorkerCallError):
                await self.workers.cancel(fl.serving[1], fl.id, timeout=timeout)

    def id_taken(self, rid: str) -> bool:
        """Whether a client-chosen id is in flight, being admitted, or queued for the status table."""
        if rid in self.inflight or self.writer.inserting(rid):
            return True
        at = self.reserved.get(rid)
        return at is not None and time.monotonic() - at < RESERVATION_S

    # --- graceful drain --------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Stop admitting requests (the API answers 503 with Retry-After); in-flight ones run on."""
        self.draining = True

    async def interrupt_all(self, reason: str) -> int:
        """End every in-flight request now: each stream ends with an error event, each row is marked
        `interrupted` with `reason` and its true output count. Returns how many were interrupted."""
        flights = list(self.inflight.values())
        for fl in flights:
            fl.interrupted = reason
            fl.cancelled = True

        await asyncio.gather(*(self._stop(fl, timeout=2) for fl in flights))
        return len(flights)

    async def close(self) -> None:
        await self.workers.close()
