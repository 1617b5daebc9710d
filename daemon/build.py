"""What both rooms use, made once per process: the status tables (`Store`) and their batched writer, the
length predictor (and its training loop), the worker client, the models' tokenizers, the cluster, and the
metrics' sources. A one-process daemon builds these once and runs the controller's room and the front's
room over them (`daemon.app`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from tetri.config import DaemonSettings
from tetri.proto.security import Tls

from .cluster import Cluster
from .db.store import Store, make_engine, migrate
from .db.writer import BatchWriter
from .metrics import Metrics, sample_loop_lag
from .predictor_service import PredictorService
from .served import ServedModels
from .worker_client import WorkerClient


@dataclass
class Shared:
    settings: DaemonSettings
    metrics: Metrics
    store: Store
    writer: BatchWriter
    predictor: PredictorService
    workers: WorkerClient
    served: ServedModels
    cluster: Cluster


def tls_of(settings: DaemonSettings) -> Tls:
    return Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)


async def open_store(settings: DaemonSettings, migrated: bool = False) -> Store:
    """The status tables; migrated to the latest schema first unless `migrated` (a front's controller did)."""
    url = settings.database_url()
    if not migrated:
        await asyncio.to_thread(migrate, url)
    return Store(make_engine(url))


@contextlib.asynccontextmanager
async def shared(app: FastAPI, store: Store, cluster: Cluster) -> AsyncIterator[Shared]:
    """The pieces both rooms use, over the status tables and the cluster, on `app.state` (what the admin API
    and the metrics read) while the process runs; closed in order at its end: the worker client, the writer
    (its last rows in), the store."""
    settings: DaemonSettings = app.state.settings
    metrics: Metrics = app.state.metrics
    writer = BatchWriter(store, settings.flush_interval_s, max_buffered=settings.store_buffer_rows)
    await writer.start()
    predictor = PredictorService(store, cluster.clock.now, from_store=settings.store_prompt_samples)
    workers = WorkerClient(settings.grpc_token(), tls_of(settings))
    sh = Shared(settings, metrics, store, writer, predictor, workers, ServedModels(), cluster)
    metrics.watch_predictor(predictor)
    metrics.watch_store(writer)
    app.state.store, app.state.writer, app.state.predictor = store, writer, predictor
    app.state.workers, app.state.served, app.state.cluster = sh.workers, sh.served, cluster
    tasks = [
        asyncio.create_task(predictor.loop(lambda: cluster.policies, settings.predictor_retrain_s)),
        asyncio.create_task(sample_loop_lag(metrics.loop_lag)),
    ]
    try:
        yield sh
    finally:
        for task in tasks:
            task.cancel()
        await sh.workers.close()
        await writer.stop()
        store.close()


def metrics_source(app: FastAPI) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """What /metrics reads of the process: each instance, and the requests in flight here by phase."""
    cluster: Cluster | None = getattr(app.state, "cluster", None)
    if cluster is None:
        return [], {}
    phases: dict[str, int] = {}
    serving = app.state.serving
    for fl in [] if serving is None else serving.inflight.values():
        phases[fl.phase.value] = phases.get(fl.phase.value, 0) + 1
    return cluster.instance_dicts(), phases
