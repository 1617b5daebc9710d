"""The admin API's reads under /api/v1, which every process answers itself: cluster summary, instances,
requests, one request's timeline, cancel, policies and their history, flips, the predictor. The writes
that change the cluster (cordons, policies, flips, plans) are the controller's (`daemon.controller.admin`);
a front forwards them there (`daemon.front.forward`).

Status-table reads go to the database (writes are batched, so a request may appear there up to one
flush interval after it arrives); while it is unavailable they answer 503 (`store_unavailable`, the
app's handler). A row is written as its request starts and as it ends, so what is in
flight comes from memory: laid over its row, and a listing by an in-flight phase is made from it. Times are the cluster
clock's (model time when the cluster runs scaled); `/cluster` and `/requests` say what it reads now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request

from ..cluster import Cluster, Instance
from ..db.models import Phase, Status
from ..db.store import REQUEST_COLUMNS
from ..db.writer import BatchWriter
from ..inflight import Inflight, Serving
from .auth import require_admin
from .schemas import BulkCancel, errors

log = logging.getLogger(__name__)

# 503: the status table unavailable to a read (`store_unavailable`, the app's handler)
router = APIRouter(prefix="/api/v1", dependencies=[Depends(require_admin)], responses=errors(401, 404, 409, 503))


def _cluster(request: Request) -> Cluster:
    return request.app.state.cluster


def _serving(request: Request) -> Serving | None:
    """The gateway of the process's front room (None: a controller alone serves no requests)."""
    return request.app.state.serving


def _writer(request: Request) -> BatchWriter:
    return request.app.state.writer


def _inflight(request: Request) -> Mapping[str, Inflight]:
    serving = _serving(request)
    return {} if serving is None else serving.inflight


@router.get("/cluster")
async def cluster(request: Request) -> dict[str, Any]:
    cluster, writer, inflight = _cluster(request), _writer(request), _inflight(request)
    store = request.app.state.store
    counts, queued = await writer.read_settled(store.count_by_status)
    for status, change in queued.items():  # finished (or admitted) since the last flush: as the daemon knows it
        counts[status] = counts.get(status, 0) + change
    instances = cluster.instance_dicts()
    by_role: dict[str, dict[str, int]] = {}
    for inst in instances:
        r = by_role.setdefault(str(inst["role"]), {"total": 0, "active": 0})
        r["total"] += 1
        r["active"] += inst["state"] == "active"
    phases: dict[str, int] = {}
    for fl in inflight.values():
        phases[fl.phase.value] = phases.get(fl.phase.value, 0) + 1
    served = sorted(cluster.models())
    return {
        "model": ", ".join(served),  # every served model, for a one-line summary
        "models": served,
        "mode": request.app.state.mode,
        "uptime_s": time.monotonic() - request.app.state.started,
        "now": cluster.clock.now(),
        "time_scale": cluster.clock.scale,
        "instances": by_role,
        "inflight": len(inflight),
        "inflight_by_phase": phases,
        "requests_by_status": counts,
        "latency": request.app.state.metrics.latency(),  # the /metrics histograms, for a dashboard's window
        "max_model_len": cluster.max_model_len(),
        # the status table's writes: up, or the cause; the rows held for it (past buffer_rows: 503s)
        "store": {
            "up": writer.outage is None,
            "error": writer.outage,
            "buffered_rows": writer.buffered,
            "buffer_rows": writer.max_buffered,
        },
    }


@router.get("/instances")
async def instances(request: Request) -> dict[str, Any]:
    return {"instances": _cluster(request).instance_dicts()}


@router.get("/instances/{instance_id}")
async def instance(instance_id: str, request: Request) -> dict[str, Any]:
    return _cluster(request).instance_dict(instance_or_404(request, instance_id))


@router.get("/requests")
async def requests(
    request: Request,
    phase: Phase | None = None,
    status: Status | None = None,
    limit: int = Query(50, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=2**62),
    id_prefix: str | None = Query(None, max_length=64),
) -> dict[str, Any]:
    inflight = _inflight(request)
    if phase is not None and phase != Phase.DONE:  # in flight: the daemon's memory has it, not the table
        rows, total = await _inflight_rows(request, phase, status, limit, offset, id_prefix)
    else:
        rows, total = await asyncio.to_thread(
            request.app.state.store.list_requests,
            phase.value if phase else None,
            status.value if status else None,
            limit,
            offset,
            id_prefix,
        )
    for row in rows:  # in flight: as the daemon knows it now, not as of the last flush
        fl = inflight.get(row["id"])
        if fl is not None:
            row.update(_live(fl))
    return {"requests": rows, "total": total, "limit": limit, "offset": offset, "now": _cluster(request).clock.now()}


async def _inflight_rows(
    request: Request, phase: Phase, status: Status | None, limit: int, offset: int, id_prefix: str | None
) -> tuple[list[dict[str, Any]], int]:
    """A page of the requests in flight in `phase`, ordered as the table's listing (newest arrival first,
    ties by id), each on its row as inserted."""
    if status not in (None, Status.RUNNING):
        return [], 0
    hits = [fl for fl in _inflight(request).values() if fl.phase == phase and fl.id.startswith(id_prefix or "")]
    hits.sort(key=lambda fl: (-fl.arrival, fl.id))
    page = [fl.id for fl in hits[offset : offset + limit]]
    store = request.app.state.store
    stored, pending = await _writer(request).read_with_pending(lambda: store.get_requests(page), page)
    empty = dict.fromkeys(sorted(REQUEST_COLUMNS))
    rows = [empty | {"id": rid} | stored.get(rid, {}) | pending.get(rid, {}) for rid in page]
    return rows, len(hits)


def _live(fl: Inflight) -> dict[str, Any]:
    """An in-flight request's fields from memory (its row has them when it ends)."""
    return {
        "model": fl.model,
        "phase": fl.phase.value,
        "status": Status.RUNNING.value,
        "prefill_instance": fl.prefill_instance,
        "decode_instance": fl.decode_instance,
        "prefill_start_ts": fl.prefill_start_ts,
        "first_token_ts": fl.first_token_ts,
        "ttft_ms": fl.ttft_ms,
        "decode_start_ts": fl.decode_start_ts,
        "migrations": fl.migrations,
        "output_tokens": fl.produced,
        "cached_tokens": fl.cached_tokens,
    }


@router.get("/requests/{request_id}")
async def one_request(request_id: str, request: Request) -> dict[str, Any]:
    store = request.app.state.store
    # and what is written at the next flush (a finished request's last fields), read with it
    row, pending = await _writer(request).read_with_pending(lambda: store.get_request(request_id), [request_id])
    queued = pending.get(request_id)
    fl = _inflight(request).get(request_id)
    if row is None and queued is None and fl is None:
        raise HTTPException(404, detail=f"no request {request_id!r}")
    base = row if row is not None else dict.fromkeys(sorted(REQUEST_COLUMNS)) | {"id": request_id}
    out: dict[str, Any] = base | (queued or {})
    if fl is not None:
        out.update(_live(fl))
        out["timeline"] = [{"phase": p, "ts": ts} for p, ts in fl.timeline]
    else:
        out["timeline"] = _timeline(out)
    return out


def _timeline(row: dict[str, Any]) -> list[dict[str, Any]]:
    points = [
        ("queued", row.get("arrival_ts")),
        ("prefill", row.get("prefill_start_ts")),
        ("first_token", row.get("first_token_ts")),
        ("decode", row.get("decode_start_ts")),
        ("done", row.get("finished_ts")),
    ]
    return [{"phase": p, "ts": ts} for p, ts in points if ts is not None]


@router.post("/requests/cancel")
async def cancel_many(request: Request, body: Annotated[BulkCancel, Body()]) -> dict[str, Any]:
    """Cancel every in-flight request whose id starts with `id_prefix` (`{}`: all of them) at once; the ids
    cancelled. A body is required, so that an empty POST cancels nothing. Finished requests are not
    touched: only what runs can be cancelled. Requests other fronts serve are cancelled through their
    workers (up to 1000 a call: call again for more)."""
    serving = _serving(request)
    ids = [] if serving is None else await serving.cancel_many(body.id_prefix)
    # and those other fronts serve, as the status table knows them (none where no front runs)
    rows, _ = await asyncio.to_thread(
        request.app.state.store.list_requests, None, Status.RUNNING.value, 1000, 0, body.id_prefix or None
    )
    front = None if serving is None else serving.front
    others = [r["id"] for r in rows if (serving is None or r["front"] != front) and r["id"] not in ids]
    found = await asyncio.gather(*(_cancel_elsewhere(request, rid) for rid in others))
    ids = sorted(ids + [rid for rid, ok in zip(others, found, strict=True) if ok])
    return {"cancelled": ids, "count": len(ids)}


@router.post("/requests/{request_id}/cancel")
async def cancel(request_id: str, request: Request) -> dict[str, Any]:
    serving = _serving(request)
    if serving is not None and await serving.cancel(request_id):
        return {"id": request_id, "cancelled": True}
    row = await asyncio.to_thread(request.app.state.store.get_request, request_id)
    if row is None:
        raise HTTPException(404, detail=f"no request {request_id!r}")
    elsewhere = row["status"] == Status.RUNNING and (serving is None or row["front"] != serving.front)
    if elsewhere and await _cancel_elsewhere(request, request_id):  # another front serves it
        return {"id": request_id, "cancelled": True}
    raise HTTPException(409, detail=f"request {request_id!r} is not in flight (status {row['status']})")


# --- policies (hot-swap) ---------------------------------------------------------------------------------
def policies_doc(request: Request) -> dict[str, Any]:
    cluster = _cluster(request)
    return {"version": cluster.policy_version, "policies": cluster.policies.to_dict()}


@router.get("/policies")
async def get_policies(request: Request) -> dict[str, Any]:
    return policies_doc(request)


@router.get("/policies/history")
async def policy_history(request: Request) -> dict[str, Any]:
    return {"changes": await asyncio.to_thread(request.app.state.store.list_policy_changes)}


# --- flips ----------------------------------------------------------------------------------------------
@router.get("/flips")
async def flips(request: Request) -> dict[str, Any]:
    return {"flips": await asyncio.to_thread(request.app.state.store.list_flips)}


# --- length predictor -----------------------------------------------------------------------------------
@router.get("/predictor")
async def predictor(request: Request) -> dict[str, Any]:
    p = _cluster(request).policies
    return {"predictor": p.predictor, "granularity": p.predictor_granularity} | request.app.state.predictor.describe()


@router.post("/predictor/retrain")
async def retrain(request: Request) -> dict[str, Any]:
    """Retrain the learned predictor now from the finished requests in the status table."""
    await request.app.state.writer.flush()
    out: dict[str, Any] = await request.app.state.predictor.retrain(_cluster(request).policies.predictor_granularity)
    return out


async def _cancel_elsewhere(request: Request, rid: str) -> bool:
    """Cancel a request another front serves, through every registered instance."""
    addresses = [i.address for i in _cluster(request).instances.values()]
    return await request.app.state.workers.cancel_anywhere(addresses, rid, timeout=5)


def instance_or_404(request: Request, instance_id: str) -> Instance:
    """The registered instance, or a 404 naming the id."""
    inst = _cluster(request).instances.get(instance_id)
    if inst is None:
        raise HTTPException(404, detail=f"no instance {instance_id!r}")
    return inst
