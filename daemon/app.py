"""The daemon process: FastAPI (OpenAI + admin + metrics + health) and the ControlPlane gRPC service
in one asyncio loop, over the status tables.

Start-up: migrate the database, start the cluster clock (`time_scale`; never behind the latest time in
the status tables), mark requests left in flight by a previous run `interrupted`, start the batched
writer, the gRPC service and the cluster monitor. Every status-table time comes from the cluster clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tetri.clock import ClusterClock
from tetri.config import DaemonSettings, start_policies
from tetri.scheduling.policyset import PolicyError

from .api import admin, openai
from .api.guard import BodyGuard, documented_openapi, validation_param
from .api.schemas import error_body, errors
from .cluster import Cluster, ClusterView, Instance
from .controller_link import FrontLink
from .db.store import Store, make_engine, migrate
from .db.writer import BatchWriter, describe, store_unavailable
from .flips import Flipper, advisor_for
from .fronts import FrontWatch
from .gateway import Gateway, new_request_id
from .grpc_edge import ControlPlaneServer, Tls, bind_control_plane, start_control_plane
from .metrics import Metrics, sample_loop_lag
from .predictor_service import PredictorService
from .served import ServedModels
from .worker_client import WorkerClient

log = logging.getLogger(__name__)


def create_app(
    settings: DaemonSettings,
    mode: str = "disaggregated",
    grpc_server: ControlPlaneServer | None = None,
    role: str = "daemon",
    front: FrontLink | None = None,
) -> FastAPI:
    """The app of a daemon (`role` "daemon": the whole control plane in one process), of a controller
    ("controller": registry, policies, flips; no OpenAI API) or of a front ("front", following `front`'s
    controller: OpenAI API and admin reads; policy changes and flips go to the controller).
    `grpc_server`: the ControlPlane's server already bound (`bind_control_plane`), so a port in use fails
    before anything starts; None binds it at start-up (not a front's: it has none)."""
    tls = Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if front is not None:
            async with _front(app, settings, front):
                yield
            return
        server = grpc_server or bind_control_plane(settings.grpc_host, settings.grpc_port, settings.grpc_token(), tls)
        url = settings.database_url()
        await asyncio.to_thread(migrate, url)
        store = Store(make_engine(url))
        latest = await asyncio.to_thread(store.latest_timestamp)
        clock = ClusterClock(settings.time_scale, origin=max(time.time(), latest or 0.0))
        fronts = FrontWatch(store, clock)
        # the rows of no front (a daemon's own) end now; fronts live on across a restart: their rows end
        # only when they do not come back (`fronts.sweep`)
        recovered = await asyncio.to_thread(store.recover_own, clock.now())
        writer = BatchWriter(store, settings.flush_interval_s, max_buffered=settings.store_buffer_rows)
        await writer.start()
        cluster = Cluster(
            settings.report_interval_s,
            settings.unhealthy_after,
            writer,
            settings.load_sample_every,
            clock,
            dead_after_s=settings.dead_after_s,
        )
        await _start_policies(settings, cluster, store)
        predictor = PredictorService(store, clock.now, from_store=settings.store_prompt_samples)
        gateway = _gateway(settings, cluster, writer, metrics, predictor, tls)
        metrics.watch_predictor(predictor)
        metrics.watch_store(writer)

        def on_register(inst: Instance) -> None:
            _record_instance(store, inst, clock.now())

        def on_removed(inst: Instance) -> None:
            _record_gone(store, inst.id)

        cluster.on_removed = on_removed
        cluster.on_broadcast = metrics.broadcast_delay.observe
        served = ServedModels()
        service = await start_control_plane(
            server, cluster, on_register, served.prepare, metrics.report.observe, fronts.changed
        )
        service.admin_url = app.state.url
        app.state.served = served
        app.state.store, app.state.writer, app.state.gateway = store, writer, gateway
        app.state.cluster, app.state.grpc_port, app.state.recovered = cluster, server.port, recovered
        flipper = Flipper(cluster, gateway.workers, store, advisor_for(settings), writer.pending_fields)
        app.state.flipper = flipper
        tasks = [
            asyncio.create_task(cluster.monitor()),
            # one model second (the simulator's watch interval), no more often than load reports arrive
            asyncio.create_task(flipper.watch(max(settings.report_interval_s, 1.0 / clock.scale))),
            asyncio.create_task(predictor.loop(lambda: cluster.policies, settings.predictor_retrain_s)),
            asyncio.create_task(_retention(store, clock, settings.load_retention_s)),
            asyncio.create_task(sample_loop_lag(metrics.loop_lag)),
        ]
        tasks.append(asyncio.create_task(fronts.sweep()))
        app.state.predictor = predictor
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await flipper.close()
            await server.stop(grace=0.5)  # the fronts' streams end here: their timers start, and are cancelled
            await fronts.close()
            await gateway.close()
            await writer.stop()
            store.close()
            log.info("stopped")

    @asynccontextmanager
    async def _front(app: FastAPI, settings: DaemonSettings, link: FrontLink) -> AsyncIterator[None]:
        """A front's life: the controller's first view (its clock, registry and policies), then the
        status tables (the controller migrated them), the writer and the gateway; the view followed."""
        view = link.first_view or await link.first(settings.front_connect_s)
        clock = ClusterClock(view.time_scale, origin=view.clock_now)
        store = Store(make_engine(settings.database_url()))
        writer = BatchWriter(store, settings.flush_interval_s, max_buffered=settings.store_buffer_rows)
        await writer.start()
        cluster = Cluster(settings.report_interval_s, settings.unhealthy_after, None, clock=clock)
        served = ServedModels()

        async def apply(v: ClusterView) -> None:
            for s in v.instances:  # a model new to this front: its tokenizer first
                known = cluster.instances.get(s.registration.instance_id)
                if known is None or known.address != s.registration.address:
                    refusal = await served.prepare(s.registration)
                    if refusal is not None:
                        log.error("instance %s: %s", s.registration.instance_id, refusal)
            cluster.follow(v)

        await apply(view)
        predictor = PredictorService(store, clock.now, from_store=settings.store_prompt_samples)
        gateway = _gateway(settings, cluster, writer, metrics, predictor, tls, link.front_id)
        metrics.watch_predictor(predictor)
        metrics.watch_store(writer)
        app.state.served, app.state.front = served, link
        app.state.store, app.state.writer, app.state.gateway = store, writer, gateway
        app.state.cluster, app.state.grpc_port, app.state.recovered, app.state.predictor = cluster, 0, 0, predictor
        tasks = [
            asyncio.create_task(link.run(apply)),
            asyncio.create_task(predictor.loop(lambda: cluster.policies, settings.predictor_retrain_s)),
            asyncio.create_task(sample_loop_lag(metrics.loop_lag)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await gateway.close()
            await writer.stop()  # its last rows in before the controller sees this front gone
            await link.close()
            client = getattr(app.state, "controller_http", None)
            if client is not None:
                await client.aclose()
            store.close()
            log.info("stopped")

    app = FastAPI(title="Tetri daemon", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyGuard, max_bytes=settings.max_request_bytes)
    app.openapi = lambda: documented_openapi(app)  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.mode = mode
    app.state.role = role
    app.state.url = ""  # its HTTP API's address, once bound (daemon.main sets it)
    app.state.started = time.monotonic()

    def metrics_source() -> tuple[list[dict[str, Any]], dict[str, int]]:
        gw: Gateway | None = getattr(app.state, "gateway", None)
        if gw is None:
            return [], {}
        phases: dict[str, int] = {}
        for fl in gw.inflight.values():
            phases[fl.phase.value] = phases.get(fl.phase.value, 0) + 1
        return gw.cluster.instance_dicts(), phases

    metrics = Metrics(metrics_source)
    app.state.metrics = metrics
    if role != "controller":  # a controller's clients are its fronts and operators: no OpenAI API
        app.include_router(openai.router)
    app.include_router(admin.router)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":
            param, msg = None, "malformed JSON body"
        else:
            param = validation_param(err.get("loc", ()))
            why = "not a field this server supports" if err.get("type") == "extra_forbidden" else err["msg"]
            msg = f"{param or 'body'}: {why}"
        gw = getattr(app.state, "gateway", None)
        if gw is not None and request.url.path in ("/v1/completions", "/v1/chat/completions"):
            gw.record_rejected(new_request_id(), msg)
        return JSONResponse(error_body(msg, "BadRequestError", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            405: "MethodNotAllowedError",
            409: "ConflictError",
        }.get(exc.status_code, "APIError")
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        return JSONResponse(
            error_body(str(detail["message"]), kind, detail.get("param")),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(SQLAlchemyError)
    async def store_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        """A status-table read (or a write the API makes itself) that failed because the database is
        unavailable: 503 naming the cause, not a 500 (the writer holds the rows meanwhile)."""
        if not store_unavailable(exc):
            raise exc
        writer: BatchWriter | None = getattr(request.app.state, "writer", None)
        held = f"; {writer.buffered} rows buffered" if writer is not None else ""
        return openai.store_refused(f"the status table is unavailable ({describe(exc)}){held}")

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses=errors(503))
    async def readyz(request: Request) -> JSONResponse:
        gw: Gateway | None = getattr(request.app.state, "gateway", None)
        ready = (
            gw is not None
            and not gw.draining
            and bool(
                gw.cluster.healthy("colocated") or (gw.cluster.healthy("prefill") and gw.cluster.healthy("decode"))
            )
        )
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    return app


def _gateway(
    settings: DaemonSettings,
    cluster: Cluster,
    writer: BatchWriter,
    metrics: Metrics,
    predictor: PredictorService,
    tls: Tls,
    front: str | None = None,
) -> Gateway:
    return Gateway(
        cluster,
        writer,
        metrics,
        predictor,
        workers=WorkerClient(settings.grpc_token(), tls),
        max_migrations=settings.max_migrations,
        migration_wait_s=settings.migration_wait_s,
        entry_wait_s=settings.entry_wait_s,
        store_prompt_samples=settings.store_prompt_samples,
        front=front,
    )


async def _start_policies(settings: DaemonSettings, cluster: Cluster, store: Store) -> None:
    """The cluster's first policy version (the workers apply it from the first broadcast): the configured
    policies, or with `resume_policies` those last in force. Each field that differs from what the audit
    trail last says is audited as the configuration's, so the trail always ends in the cluster's state."""
    audited = await asyncio.to_thread(store.latest_policies)
    known = set(cluster.policies.to_dict())
    try:
        last = cluster.policies.changed(**{k: v for k, v in audited.items() if k in known})
    except PolicyError as e:  # a value an older version accepted: the trail starts over from the defaults
        log.warning("the policy audit trail's last values do not apply (%s): starting from the defaults", e)
        last = cluster.policies
    start = last if settings.resume_policies else start_policies(settings)
    if start.to_dict() != cluster.policies.to_dict():
        cluster.set_policies(start)
    before, after = last.to_dict(), start.to_dict()
    for name in (k for k in after if after[k] != before[k]):
        old, new = json.dumps(before[name]), json.dumps(after[name])
        await asyncio.to_thread(store.record_policy_change, cluster.clock.now(), name, old, new, "daemon config")
    # versions never repeat across restarts (a worker or front applies policies when the version differs)
    cluster.policy_version = max(cluster.policy_version, await asyncio.to_thread(store.policy_changes_count))


def _write_behind(what: str, write: Callable[[], object], then: Callable[[], None] | None = None) -> None:
    """Registry changes are rare: write them straight through, in a thread (off the request path); a
    failure is logged, the in-memory registry stays authoritative. `then` runs on the loop once written."""

    def done(fut: asyncio.Future[object]) -> None:
        if fut.exception() is not None:
            log.error("recording %s failed: %s", what, fut.exception())
        elif then is not None:
            then()

    asyncio.get_running_loop().run_in_executor(None, write).add_done_callback(done)


def _record_gone(store: Store, instance_id: str) -> None:
    _write_behind(f"instance {instance_id} gone", partial(store.set_instance_state, instance_id, "gone"))


def _record_instance(store: Store, inst: Instance, registered_ts: float) -> None:
    _write_behind(
        f"instance {inst.id}",
        partial(
            store.upsert_instance,
            id=inst.id,
            role=inst.role,
            state=inst.state,
            address=inst.address,
            model=inst.model,
            kv_capacity_tokens=inst.kv_capacity_tokens,
            registered_ts=registered_ts,
        ),
        partial(setattr, inst, "recorded", True),  # its load samples may refer to the row from now on
    )


async def _retention(store: Store, clock: ClusterClock, keep_s: float) -> None:
    """Delete load samples older than `keep_s` of wall time (`keep_s` × scale on the cluster clock)."""
    while True:
        await asyncio.sleep(min(60.0, keep_s / 2))
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.prune_load_samples, clock.now() - clock.model_seconds(keep_s))
