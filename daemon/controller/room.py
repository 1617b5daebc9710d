"""The controller's room, started over the shared pieces (`daemon.build`): the registry's first policies
and records, the ControlPlane gRPC service (workers register and report; fronts follow), the flips and
their watcher, the health monitor, the fronts' watch and the load samples' retention.

Start-up, before this room: the status tables migrated, the cluster clock started (never behind the latest
time in the tables: `clock_for`), the requests a previous run left in flight marked `interrupted`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI

from tetri.clock import ClusterClock
from tetri.config import DaemonSettings, start_policies
from tetri.scheduling.policyset import PolicyError

from ..build import Shared
from ..cluster import Instance
from ..db.store import Store
from .edge import ControlPlaneServer, start_control_plane
from .flips import Flipper, advisor_for
from .fronts import FrontWatch
from .registry import Registry

log = logging.getLogger(__name__)


async def clock_for(store: Store, settings: DaemonSettings) -> ClusterClock:
    """The cluster clock at `time_scale`, never behind the latest time the status tables hold."""
    latest = await asyncio.to_thread(store.latest_timestamp)
    return ClusterClock(settings.time_scale, origin=max(time.time(), latest or 0.0))


def registry_for(settings: DaemonSettings, clock: ClusterClock) -> Registry:
    return Registry(
        settings.report_interval_s,
        settings.unhealthy_after,
        None,  # its writer, once the shared pieces are made (`controller`)
        settings.load_sample_every,
        clock,
        dead_after_s=settings.dead_after_s,
    )


@contextlib.asynccontextmanager
async def controller(app: FastAPI, sh: Shared, server: ControlPlaneServer) -> AsyncIterator[None]:
    """The controller's life, on a bound ControlPlane server: its tasks start here, and stop in order at its
    end (the flips, the gRPC service: the fronts' streams end there, then their watch)."""
    registry, store, settings, clock = sh.cluster, sh.store, sh.settings, sh.cluster.clock
    assert isinstance(registry, Registry)
    registry.writer = sh.writer
    await _start_policies(settings, registry, store)
    fronts = FrontWatch(store, clock)
    registry.on_removed = partial(_record_gone, store)
    registry.on_broadcast = sh.metrics.broadcast_delay.observe
    on_register = partial(_record_instance, store, clock.now)
    service = await start_control_plane(
        server, registry, on_register, sh.served.prepare, sh.metrics.report.observe, fronts.changed
    )
    service.admin_url = app.state.url
    flipper = Flipper(registry, sh.workers, store, advisor_for(settings), sh.writer.pending_fields)
    app.state.flipper, app.state.grpc_port = flipper, server.port
    tasks = [
        asyncio.create_task(registry.monitor()),
        # one model second (the simulator's watch interval), no more often than load reports arrive
        asyncio.create_task(flipper.watch(max(settings.report_interval_s, 1.0 / clock.scale))),
        asyncio.create_task(_retention(store, clock, settings.load_retention_s)),
        asyncio.create_task(fronts.sweep()),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await flipper.close()
        await server.stop(grace=0.5)  # the fronts' streams end here: their timers start, and are cancelled
        await fronts.close()


async def _start_policies(settings: DaemonSettings, cluster: Registry, store: Store) -> None:
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


def _record_gone(store: Store, inst: Instance) -> None:
    _write_behind(f"instance {inst.id} gone", partial(store.set_instance_state, inst.id, "gone"))


def _record_instance(store: Store, now: Callable[[], float], inst: Instance) -> None:
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
            registered_ts=now(),
        ),
        partial(setattr, inst, "recorded", True),  # its load samples may refer to the row from now on
    )


async def _retention(store: Store, clock: ClusterClock, keep_s: float) -> None:
    """Delete load samples older than `keep_s` of wall time (`keep_s` × scale on the cluster clock)."""
    while True:
        await asyncio.sleep(min(60.0, keep_s / 2))
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.prune_load_samples, clock.now() - clock.model_seconds(keep_s))
