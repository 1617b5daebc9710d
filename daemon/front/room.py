"""The front's room, started over the shared pieces (`daemon.build`): the gateway that admits, routes and
relays requests and writes their status rows; in a front of its own, the controller's view followed.

A front alone first takes the controller's view (its clock, registry and policies: `first_view`); the
status tables are the controller's (migrated there). A one-process daemon runs this room over the
controller's registry itself: no view to follow."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from tetri.clock import ClusterClock
from tetri.config import DaemonSettings

from ..build import Shared
from ..cluster import Cluster, ClusterView
from .gateway import Gateway
from .link import FrontLink

log = logging.getLogger(__name__)


async def first_view(link: FrontLink, settings: DaemonSettings) -> Cluster:
    """The controller's first view, as the cluster this front routes on (not yet followed: `front` does)."""
    view = link.first_view or await link.first(settings.front_connect_s)
    link.first_view = view
    clock = ClusterClock(view.time_scale, origin=view.clock_now)
    return Cluster(settings.report_interval_s, settings.unhealthy_after, clock)


@contextlib.asynccontextmanager
async def front(app: FastAPI, sh: Shared, link: FrontLink | None = None) -> AsyncIterator[None]:
    """The front's life: its gateway; with `link`, the controller's view followed from its first. At its
    end, the writer's last rows go in before the controller sees this front gone (its link closed)."""
    settings = sh.settings
    if link is not None:
        assert link.first_view is not None
        await _follow(sh, link.first_view)
    gateway = Gateway(
        sh.cluster,
        sh.writer,
        sh.metrics,
        sh.predictor,
        workers=sh.workers,
        max_migrations=settings.max_migrations,
        migration_wait_s=settings.migration_wait_s,
        entry_wait_s=settings.entry_wait_s,
        store_prompt_samples=settings.store_prompt_samples,
        front=None if link is None else link.front_id,
    )
    app.state.serving = app.state.gateway = gateway
    app.state.front = link  # a front's writes for the controller go through it (`daemon.front.forward`)
    following = None if link is None else asyncio.create_task(link.run(lambda v: _follow(sh, v)))
    try:
        yield
    finally:
        if following is not None:
            following.cancel()
        app.state.serving = None
        if link is not None:
            await sh.writer.stop()  # its last rows in before the controller sees this front gone
            await link.close()
            client = getattr(app.state, "controller_http", None)
            if client is not None:
                await client.aclose()


async def _follow(sh: Shared, view: ClusterView) -> None:
    """Take a view of the controller's: a model new to this front gets its tokenizer first."""
    cluster = sh.cluster
    for s in view.instances:
        known = cluster.instances.get(s.registration.instance_id)
        if known is None or known.address != s.registration.address:
            refusal = await sh.served.prepare(s.registration)
            if refusal is not None:
                log.error("instance %s: %s", s.registration.instance_id, refusal)
    cluster.follow(view)
