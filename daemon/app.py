"""A daemon process's app: FastAPI (the OpenAI API, the admin API, metrics and health) and, in a controller,
the ControlPlane gRPC service, in one asyncio loop over the status tables. Only assembly is here: the
shared pieces (`daemon.build`), the controller's room (`daemon.controller.room`) and the front's
(`daemon.front.room`). A one-process daemon ("daemon", the default) runs both rooms over one registry; a
controller, its own; a front, its own, following its controller's view.

Every status-table time comes from the cluster clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import FastAPI

from tetri.config import DaemonSettings

from .api import errors, reads
from .api.guard import BodyGuard, documented_openapi
from .build import metrics_source, open_store, shared, tls_of
from .controller import admin
from .controller.edge import ControlPlaneServer, bind_control_plane
from .controller.room import clock_for, controller, registry_for
from .front import forward, openai
from .front.link import FrontLink
from .front.room import first_view, front
from .metrics import Metrics

log = logging.getLogger(__name__)


def create_app(
    settings: DaemonSettings,
    mode: str = "disaggregated",
    grpc_server: ControlPlaneServer | None = None,
    role: str = "daemon",
    link: FrontLink | None = None,
) -> FastAPI:
    """The app of a daemon (`role` "daemon": the whole control plane in one process), of a controller
    ("controller": registry, policies, flips; no OpenAI API) or of a front ("front", following `link`'s
    controller: OpenAI API and admin reads; the controller's writes are forwarded there).
    `grpc_server`: the ControlPlane's server already bound (`bind_control_plane`), so a port in use fails
    before anything starts; None binds it at start-up (not a front's: it has none)."""
    app = FastAPI(title="Tetri daemon", version="0.1.0", lifespan=partial(_life, grpc_server=grpc_server, link=link))
    app.add_middleware(BodyGuard, max_bytes=settings.max_request_bytes)
    app.openapi = lambda: documented_openapi(app)  # type: ignore[method-assign]
    app.state.settings, app.state.mode, app.state.role = settings, mode, role
    app.state.url = ""  # its HTTP API's address, once bound (daemon.main sets it)
    app.state.started = time.monotonic()
    app.state.serving = app.state.cluster = None  # the front room's gateway and the cluster, once started
    app.state.recovered, app.state.grpc_port = 0, 0
    app.state.metrics = Metrics(partial(metrics_source, app))
    errors.install(app)
    app.include_router(errors.router)
    if role != "controller":  # a controller's clients are its fronts and operators: no OpenAI API
        app.include_router(openai.router)
    app.include_router(reads.router)
    app.include_router(forward.router if role == "front" else admin.router)
    return app


@contextlib.asynccontextmanager
async def _life(app: FastAPI, grpc_server: ControlPlaneServer | None, link: FrontLink | None) -> AsyncIterator[None]:
    """The process's rooms over the shared pieces: a front's, a controller's, or both (a daemon)."""
    settings: DaemonSettings = app.state.settings
    if link is not None:
        cluster = await first_view(link, settings)
        async with shared(app, await open_store(settings, migrated=True), cluster) as sh, front(app, sh, link):
            yield
        log.info("stopped")
        return
    token, tls = settings.grpc_token(), tls_of(settings)
    server = grpc_server or bind_control_plane(settings.grpc_host, settings.grpc_port, token, tls)
    store = await open_store(settings)
    clock = await clock_for(store, settings)
    # the rows of no front (a daemon's own) end now; fronts live on across a restart: their rows end
    # only when they do not come back (`daemon.controller.fronts`)
    app.state.recovered = await asyncio.to_thread(store.recover_own, clock.now())
    async with shared(app, store, registry_for(settings, clock)) as sh, controller(app, sh, server):
        if app.state.role == "daemon":
            async with front(app, sh):
                yield
        else:
            yield
    log.info("stopped")
