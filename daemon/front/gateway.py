"""The front's gateway (TetriInfer §3.2's global scheduler, its serving half): admit each request (its
prediction, its row), run it (`daemon.front.run.Run`: routed by `daemon.front.route.Router`, followed through
prefill → transfer → decode, its tokens streamed back), and record its end in the status table (batched,
off the streaming path).

A request runs in its caller's task (`serve`): its tokens go to the caller's `Output` as they come
(one object per request, no generator or task per token), and it ends with `Finished`
or, when it fails (the worker died, no instance, …), `Failed`. Cancellation: `cancel(id)` asks the worker
serving it to abort; a client that disconnects cancels the caller's task, which leaves its worker call.

Every time recorded here comes from the cluster clock (`Cluster.clock`): TTFT and JCT are model time
when the cluster runs scaled (docs/cluster.md, "Timestamps: one clock per cluster").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from sqlalchemy.exc import SQLAlchemyError

from tetri.sampling import GREEDY, Sampling

from ..cluster import Cluster
from ..db.models import Phase, Status
from ..db.writer import BatchWriter, describe, store_unavailable
from ..inflight import Inflight
from ..metrics import Metrics
from ..predictor_service import PROMPT_SAMPLE, PredictorService
from ..worker_client import WorkerCallError, WorkerClient
from .route import Router
from .run import Failed, Finished, Output, Run, RunHost
from .textstream import TextStream

log = logging.getLogger(__name__)


RESERVATION_S = 30.0  # a reserved id whose stream never started (client gone) is free again after this


class Gateway:
    def __init__(
        self,
        cluster: Cluster,
        writer: BatchWriter,
        metrics: Metrics,
        predictor: PredictorService | None = None,
        *,
        workers: WorkerClient,
        max_migrations: int = 3,
        migration_wait_s: float = 30.0,
        entry_wait_s: float = 5.0,
        store_prompt_samples: bool = False,
        front: str | None = None,
    ) -> None:
        self.front = front  # the front's incarnation id every row it inserts carries (None: a daemon)
        self.predictor = predictor
        self.store_prompt_samples = store_prompt_samples
        self.draining = False
        self.cluster = cluster
        self.writer = writer
        self.metrics = metrics
        self.clock = cluster.clock
        self.workers = workers  # the process's (`daemon.build`): not the gateway's to close
        self.router = Router(cluster, metrics, entry_wait_s, migration_wait_s)
        self.host = RunHost(self.clock, self.router, self.workers, metrics, max_migrations)
        self.inflight: dict[str, Inflight] = {}
        # client-chosen ids admitted but not yet in flight (monotonic time of the reservation)
        self.reserved: dict[str, float] = {}

    # --- recording ---------------------------------------------------------------------------------
    def record_rejected(
        self, rid: str, message: str, prompt_tokens: int = 0, max_tokens: int = 0, model: str = ""
    ) -> None:
        """A refused request's row (`rejected`); not written past the status table's buffer (`store_buffer_rows`
        rows held while it is unavailable), which new rows must not grow."""
        if self.writer.refusal() is not None:
            self.metrics.requests.labels(status=Status.REJECTED).inc()
            return
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
            front=self.front,
        )
        self.metrics.requests.labels(status=Status.REJECTED).inc()

    # --- the request ---------------------------------------------------------------------------------
    async def serve(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        out: Output,
        sla_ttft_ms: float | None = None,
        sla_jct_ms: float | None = None,
        pin: str | None = None,
        sampling: Sampling = GREEDY,
        text: TextStream | None = None,
    ) -> Finished | Failed:
        """Serve one request in the caller's task, its tokens to `out` as they come; ``pin`` pins its decode
        phase to that decode instance. With ``text``, tokens carry their text, and a stop token or stop
        string ends the request (`Finished("stop")`, the worker's call left); the held-back text is the
        output's last. Cancelled (the client left, or a shutdown), the request ends as cancelled or
        interrupted, and the cancellation goes on."""
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
            front=self.front,
        )
        end: Finished | Failed | None = None
        try:
            end = await Run(self.host, fl, out, text).drive(prompt_ids, pin)
        except asyncio.CancelledError:
            if fl.interrupted:
                end = Failed(fl.interrupted, Status.INTERRUPTED)
            else:
                end = Failed("client disconnected", Status.CANCELLED)
            raise
        finally:
            end = end or Failed("stream ended without a result")
            self._finish(fl, end)
        if isinstance(end, Finished):
            end.cached_tokens = fl.cached_tokens
        return end

    def _finish(self, fl: Inflight, end: Finished | Failed) -> None:
        self.inflight.pop(fl.id, None)
        now = self.clock.now()
        jct_ms = (now - fl.arrival) * 1000
        self.router.release(fl)
        fl.timeline.append(("done", now))
        if isinstance(end, Finished):
            status = Status.CANCELLED if end.reason == "cancelled" else Status.FINISHED
            if status == Status.FINISHED and self.predictor is not None:
                self.predictor.observe(fl.predicted, fl.produced, fl.prompt_head)
            reason, error = end.reason, None
            if status == Status.FINISHED:
                self.metrics.jct.observe(jct_ms / 1000)
        else:
            status = end.status
            reason = {Status.CANCELLED: "cancelled", Status.REJECTED: "rejected"}.get(end.status, "error")
            error = end.message[:500]
        self.metrics.requests.labels(status=status).inc()
        # the row's one update (its insert is the other): everything the request's run learned
        self.writer.submit_request_update(
            fl.id,
            phase=Phase.DONE.value,
            status=status.value,
            prefill_instance=fl.prefill_instance,
            decode_instance=fl.decode_instance,
            prefill_start_ts=fl.prefill_start_ts,
            first_token_ts=fl.first_token_ts,
            ttft_ms=fl.ttft_ms,
            decode_start_ts=fl.decode_start_ts,
            kv_loaded_tokens=fl.kv_loaded_tokens,
            cached_tokens=fl.cached_tokens,
            migrations=fl.migrations,
            migrated_from=",".join(fl.migrated_from)[-256:] or None,
            finished_ts=now,
            jct_ms=jct_ms,
            output_tokens=fl.produced,
            finish_reason=reason,
            error=error,
        )

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

    async def reserve(self, rid: str) -> str | None:
        """Hold a client-chosen id until its request is in flight (or `release_id`): None when it is free,
        else why not — "taken" (in flight, being admitted, queued for or in the status table) or the status
        table's unavailability (its lookup failed). The one owner of the id lookup."""
        if self.id_taken(rid):
            return "taken"
        self.reserved[rid] = time.monotonic()  # a second request with this id meanwhile is refused too
        try:
            taken = await asyncio.to_thread(self.writer.store.get_request, rid)
        except SQLAlchemyError as e:
            self.reserved.pop(rid, None)
            if not store_unavailable(e):
                raise
            return f"the status table is unavailable ({describe(e)}): tetri.request_id {rid!r} cannot be checked"
        if taken:
            self.reserved.pop(rid, None)
            return "taken"
        return None

    def release_id(self, rid: str) -> None:
        """A reserved id whose request was refused before it started: free again."""
        self.reserved.pop(rid, None)

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
