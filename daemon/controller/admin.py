"""The controller's admin writes under /api/v1: cordons, the runtime policies (hot-swapped, audited),
flips, and Sorted-F plans loaded into decode instances. A front takes the same requests and forwards them
here (`daemon.front.forward`); the reads are every process's own (`daemon.api.reads`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Request

from tetri.planner.planfile import parse_plan
from tetri.planner.workload import WorkloadError
from tetri.scheduling.policyset import PolicyError

from ..api.auth import identity, require_admin
from ..api.reads import instance_or_404, policies_doc
from ..api.schemas import errors
from ..cluster import Instance
from .flips import FlipError
from .registry import Registry

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1", dependencies=[Depends(require_admin)], responses=errors(401, 404, 409, 503))


def _registry(request: Request) -> Registry:
    return request.app.state.cluster


# --- cordons --------------------------------------------------------------------------------------------
@router.post("/instances/{instance_id}/cordon")
async def cordon(instance_id: str, request: Request) -> dict[str, Any]:
    """Send the instance no new work (no new prompts; no new hand-overs to a decode instance) until it is
    uncordoned; what runs there runs to completion, and it stays registered and reporting. Refused (409)
    when it is the last instance that keeps its model served, as a flip is. Held in the controller's memory
    (a daemon restart forgets it). The instance, `changed`: whether it was not cordoned yet."""
    cluster = _registry(request)
    inst = instance_or_404(request, instance_id)
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
    cluster = _registry(request)
    inst = instance_or_404(request, instance_id)
    changed = cluster.uncordon(inst)
    if changed:
        log.warning("instance %s (%s) uncordoned by %s", inst.id, inst.role, identity(request))
    return cluster.instance_dict(inst) | {"changed": changed}


@router.put("/policies")
async def set_policies(request: Request, changes: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Change any of the runtime policies; validated as a whole (a bad field is a 400 naming it),
    applied without restart (pushed to the workers with the next load broadcast), audited."""
    cluster = _registry(request)
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
    return policies_doc(request) | {"changed": [k for k, _, _ in diff]}


@router.post("/instances/{instance_id}/flip", status_code=202)
async def flip(
    instance_id: str, request: Request, body: Annotated[dict[str, Any] | None, Body()] = None
) -> dict[str, Any]:
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
    reply = await request.app.state.workers.set_plan(inst.address, parsed.order, timeout=10)
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
    reply = await request.app.state.workers.set_plan(inst.address, None, timeout=10)
    if not reply.ok:
        raise HTTPException(409, detail=reply.reason)
    return {"instance_id": instance_id, "planned": 0}


def _decode_instance(request: Request, instance_id: str) -> Instance:
    inst = instance_or_404(request, instance_id)
    if inst.role != "decode":
        raise HTTPException(409, detail=f"instance {instance_id} is a {inst.role} instance: plans load into decode")
    return inst
