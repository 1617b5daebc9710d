"""The admin API under /api/v1: cluster summary, instances (and their cordons), requests, one request's
timeline, cancel, policies, flips.

Status-table reads go to the database (writes are batched, so a request may appear there up to one
flush interval after it arrives); while it is unavailable they answer 503 (`store_unavailable`, the
app's handler). A row is written as its request starts and as it ends, so what is in
flight comes from memory: laid over its row, and a listing by an in-flight phase is made from it. Times are the cluster
clock's (model time when the cluster runs scaled); `/cluster` and `/requests` say what it reads now.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request

from tetri.planner.planfile import parse_plan
from tetri.planner.workload import WorkloadError
from tetri.scheduling.policyset import PolicyError

from ..db.models import Phase, Status
from ..db.store import REQUEST_COLUMNS
from ..flips import FlipError
from ..gateway import Gateway, Inflight
from .auth import identity, require_admin
from .forward import at_front, to_controller
from .schemas import BulkCancel, errors

log = logging.getLogger(__name__)

# 503: the status table unavailable to a read (`store_unavailable`, the app's handler)
router = APIRouter(prefix="/api/v1", dependencies=[Depends(require_admin)], responses=errors(401, 404, 409, 503))


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


@router.get("/cluster")
async def cluster(request: Request) -> dict[str, Any]:
    gw = _gw(request)
    store = request.app.state.store
    counts, queued = await gw.writer.read_settled(store.count_by_status)
    for status, change in queued.items():  # finished (or admitted) since the last flush: as the daemon knows it
        counts[status] = counts.get(status, 0) + change
    instances = gw.cluster.instance_dicts()
    by_role: dict[str, dict[str, int]] = {}
    for inst in instances:
        r = by_role.setdefault(str(inst["role"]), {"total": 0, "active": 0})
        r["total"] += 1
        r["active"] += inst["state"] == "active"
    phases: dict[str, int] = {}
    for fl in gw.inflight.values():
        phases[fl.phase.value] = phases.get(fl.phase.value, 0) + 1
    served = sorted(gw.cluster.models())
    return {
        "model": ", ".join(served),  # every served model, for a one-line summary
        "models": served,
        "mode": request.app.state.mode,
        "uptime_s": time.monotonic() - request.app.state.started,
        "now": gw.clock.now(),
        "time_scale": gw.clock.scale,
        "instances": by_role,
        "inflight": len(gw.inflight),
        "inflight_by_phase": phases,
        "requests_by_status": counts,
        "latency": request.app.state.metrics.latency(),  # the /metrics histograms, for a dashboard's window
        "max_model_len": gw.max_model_len(),
        # the status table's writes: up, or the cause; the rows held for it (past buffer_rows: 503s)
        "store": {
            "up": gw.writer.outage is None,
            "error": gw.writer.outage,
            "buffered_rows": gw.writer.buffered,
            "buffer_rows": gw.writer.max_buffered,
        },
    }


@router.get("/instances")
async def instances(request: Request) -> dict[str, Any]:
    return {"instances": _gw(request).cluster.instance_dicts()}


@router.get("/instances/{instance_id}")
async def instance(instance_id: str, request: Request) -> dict[str, Any]:
    return _gw(request).cluster.instance_dict(_instance(request, instance_id))


# --- cordons --------------------------------------------------------------------------------------------
@router.post("/instances/{instance_id}/cordon")
async def cordon(instance_id: str, request: Request) -> dict[str, Any]:
    """Send the instance no new work (no new prompts; no new hand-overs to a decode instance) until it is
    uncordoned; what runs there runs to completion, and it stays registered and reporting. Refused (409)
    when it is the last instance that keeps its model served, as a flip is. Held in the controller's memory
    (a daemon restart forgets it). The instance, `changed`: whether it was not cordoned yet."""
    if at_front(request):
        return await to_controller(request, None)
    cluster = _gw(request).cluster
    inst = _instance(request, instance_id)
    refusal = cluster.cordon_refusal(inst)
    if refusal is not None:
        raise HTTPException(409, detail={"message": f"not cordoned: {refusal}", "param": None})
    changed = cluster.cordon(inst)
    if changed:
        log.warning("instance %s (%s) cordoned by %s", inst.id, inst.role, identity(request))
    return cluster.instance_dict(inst) | {"changed": changed}


@router.post("/instances/{instance_id}/uncordon")
async def uncordon(instance_id: str, request: Request) -> dict[str, Any]:
    """Routing may send the instance new work again. The instance, `changed`: whether it was cordoned."""
    if at_front(request):
        return await to_controller(request, None)
    cluster = _gw(request).cluster
    inst = _instance(request, instance_id)
    changed = cluster.uncordon(inst)
    if changed:
        log.warning("instance %s (%s) uncordoned by %s", inst.id, inst.role, identity(request))
    return cluster.instance_dict(inst) | {"changed": changed}


@router.get("/requests")
async def requests(
    request: Request,
    phase: Phase | None = None,
    status: Status | None = None,
    limit: int = Query(50, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=2**62),
    id_prefix: str | None = Query(None, max_length=64),
) -> dict[str, Any]:
    gw = _gw(request)
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
        fl = gw.inflight.get(row["id"])
        if fl is not None:
            row.update(_live(fl))
    return {"requests": rows, "total": total, "limit": limit, "offset": offset, "now": gw.clock.now()}


async def _inflight_rows(
    request: Request, phase: Phase, status: Status | None, limit: int, offset: int, id_prefix: str | None
) -> tuple[list[dict[str, Any]], int]:
    """A page of the requests in flight in `phase`, ordered as the table's listing (newest arrival first,
    ties by id), each on its row as inserted."""
    gw = _gw(request)
    if status not in (None, Status.RUNNING):
        return [], 0
    hits = [fl for fl in gw.inflight.values() if fl.phase == phase and fl.id.startswith(id_prefix or "")]
    hits.sort(key=lambda fl: (-fl.arrival, fl.id))
    page = [fl.id for fl in hits[offset : offset + limit]]
    store = request.app.state.store
    stored, pending = await gw.writer.read_with_pending(lambda: store.get_requests(page), page)
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
    gw = _gw(request)
    store = request.app.state.store
    # and what is written at the next flush (a finished request's last fields), read with it
    row, pending = await gw.writer.read_with_pending(lambda: store.get_request(request_id), [request_id])
    queued = pending.get(request_id)
    fl = gw.inflight.get(request_id)
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
    gw = _gw(request)
    ids = await gw.cancel_many(body.id_prefix)
    # and those other fronts serve, as the status table knows them (none where no front runs)
    rows, _ = await asyncio.to_thread(
        request.app.state.store.list_requests, None, Status.RUNNING.value, 1000, 0, body.id_prefix or None
    )
    others = [r["id"] for r in rows if r["front"] != gw.front and r["id"] not in ids]
    found = await asyncio.gather(*(gw.cancel_on_workers(rid) for rid in others))
    ids = sorted(ids + [rid for rid, ok in zip(others, found, strict=True) if ok])
    return {"cancelled": ids, "count": len(ids)}


@router.post("/requests/{request_id}/cancel")
async def cancel(request_id: str, request: Request) -> dict[str, Any]:
    gw = _gw(request)
    if await gw.cancel(request_id):
        return {"id": request_id, "cancelled": True}
    row = await asyncio.to_thread(request.app.state.store.get_request, request_id)
    if row is None:
        raise HTTPException(404, detail=f"no request {request_id!r}")
    elsewhere = row["status"] == Status.RUNNING and row["front"] != gw.front
    if elsewhere and await gw.cancel_on_workers(request_id):  # another front serves it
        return {"id": request_id, "cancelled": True}
    raise HTTPException(409, detail=f"request {request_id!r} is not in flight (status {row['status']})")


# --- policies (hot-swap) ---------------------------------------------------------------------------------
def _policies_doc(request: Request) -> dict[str, Any]:
    cluster = _gw(request).cluster
    return {"version": cluster.policy_version, "policies": cluster.policies.to_dict()}


@router.get("/policies")
async def get_policies(request: Request) -> dict[str, Any]:
    return _policies_doc(request)


@router.put("/policies")
async def set_policies(request: Request, changes: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Change any of the runtime policies; validated as a whole (a bad field is a 400 naming it),
    applied without restart (pushed to the workers with the next load broadcast), audited."""
    if at_front(request):
        return await to_controller(request, changes)
    cluster = _gw(request).cluster
    old = cluster.policies
    try:
        new = old.changed(**changes)
    except PolicyError as e:
        raise HTTPException(400, detail={"message": str(e), "param": e.field}) from None
    except TypeError as e:
        raise HTTPException(400, detail={"message": str(e), "param": None}) from None
    if new.flip_policy == "advise" and old.flip_policy != "advise" and request.app.state.flipper.advisor is None:
        message = "flip_policy: advise needs the cluster's cost profile; start the daemon with --profile"
        raise HTTPException(400, detail={"message": message, "param": "flip_policy"})
    who = identity(request)
    diff = [(k, old.to_dict()[k], v) for k, v in new.to_dict().items() if old.to_dict()[k] != v]
    if diff:
        cluster.set_policies(new)
        request.app.state.flipper.configure()
        now = cluster.clock.now()
        for field, before, after in diff:
            await asyncio.to_thread(
                request.app.state.store.record_policy_change, now, field, json.dumps(before), json.dumps(after), who
            )
    return _policies_doc(request) | {"changed": [k for k, _, _ in diff]}


@router.get("/policies/history")
async def policy_history(request: Request) -> dict[str, Any]:
    return {"changes": await asyncio.to_thread(request.app.state.store.list_policy_changes)}


# --- flips ----------------------------------------------------------------------------------------------
@router.post("/instances/{instance_id}/flip", status_code=202)
async def flip(
    instance_id: str, request: Request, body: Annotated[dict[str, Any] | None, Body()] = None
) -> dict[str, Any]:
    if at_front(request):
        return await to_controller(request, body)
    body = body or {}
    to = body.get("to")
    if to is not None and not isinstance(to, str):
        raise HTTPException(400, detail={"message": "to: must be colocated, prefill or decode", "param": "to"})
    try:
        return await request.app.state.flipper.start(
            instance_id, to, str(body.get("reason", "manual")), identity(request)
        )
    except FlipError as e:
        raise HTTPException(e.status, detail={"message": str(e), "param": "to" if e.status == 400 else None}) from None


@router.get("/flips")
async def flips(request: Request) -> dict[str, Any]:
    return {"flips": await asyncio.to_thread(request.app.state.store.list_flips)}


# --- length predictor -----------------------------------------------------------------------------------
@router.get("/predictor")
async def predictor(request: Request) -> dict[str, Any]:
    p = _gw(request).cluster.policies
    return {"predictor": p.predictor, "granularity": p.predictor_granularity} | request.app.state.predictor.describe()


@router.post("/predictor/retrain")
async def retrain(request: Request) -> dict[str, Any]:
    """Retrain the learned predictor now from the finished requests in the status table."""
    await request.app.state.writer.flush()
    out: dict[str, Any] = await request.app.state.predictor.retrain(_gw(request).cluster.policies.predictor_granularity)
    return out


# --- Sorted-F plan admission ------------------------------------------------------------------------------
@router.put("/instances/{instance_id}/plan")
async def load_plan(instance_id: str, request: Request, plan: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Load a plan file (`tetrictl plan solve`'s format) into a decode instance: it admits requests in
    the plan's order (requests carry the plan's ids as `tetri.request_id`) while the plan's future fits
    its KV capacity. A plan that does not parse is a 400; the instance keeps its policy."""
    try:
        parsed = parse_plan(json.dumps(plan), source="plan")
    except WorkloadError as e:
        raise HTTPException(400, detail={"message": str(e), "param": "plan"}) from None
    inst = _decode_instance(request, instance_id)
    reply = await _gw(request).workers.set_plan(inst.address, parsed.order, timeout=10)
    if not reply.ok:
        raise HTTPException(409, detail=reply.reason)
    return {
        "instance_id": instance_id,
        "planned": len(parsed.order),
        "plan_memory": parsed.memory,
        "kv_capacity_tokens": inst.kv_capacity_tokens,
        "policy": parsed.policy,
    }


@router.delete("/instances/{instance_id}/plan")
async def clear_plan(instance_id: str, request: Request) -> dict[str, Any]:
    inst = _decode_instance(request, instance_id)
    reply = await _gw(request).workers.set_plan(inst.address, None, timeout=10)
    if not reply.ok:
        raise HTTPException(409, detail=reply.reason)
    return {"instance_id": instance_id, "planned": 0}


def _instance(request: Request, instance_id: str) -> Any:
    """The registered instance, or a 404 naming the id."""
    inst = _gw(request).cluster.instances.get(instance_id)
    if inst is None:
        raise HTTPException(404, detail=f"no instance {instance_id!r}")
    return inst


def _decode_instance(request: Request, instance_id: str) -> Any:
    inst = _instance(request, instance_id)
    if inst.role != "decode":
        raise HTTPException(409, detail=f"instance {instance_id} is a {inst.role} instance: plans load into decode")
    return inst
