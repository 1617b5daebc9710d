"""A front's admin writes that belong to the controller (cordons, policy changes, flips, plans: the routes of
`daemon.controller.admin`): forwarded to the controller's HTTP API with the caller's credentials and body,
its answer passed back as it is. While the controller is away (restarting) they get 503 with Retry-After;
every read is answered by the front itself (`daemon.api.reads`)."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from ..api.auth import require_admin
from ..api.schemas import errors

UNAVAILABLE = "the controller is unavailable (restarting?): retry in a moment"
# the controller's writes (`daemon.controller.admin`), by method and path under /api/v1
WRITES = (
    ("POST", "/instances/{instance_id}/cordon"),
    ("POST", "/instances/{instance_id}/uncordon"),
    ("PUT", "/policies"),
    ("POST", "/instances/{instance_id}/flip"),
    ("PUT", "/instances/{instance_id}/plan"),
    ("DELETE", "/instances/{instance_id}/plan"),
)

router = APIRouter(prefix="/api/v1", dependencies=[Depends(require_admin)], responses=errors(401, 404, 409, 503))


async def _forward(request: Request) -> JSONResponse:
    """The controller's answer to this write, its body passed on as it came (the controller validates it)."""
    return await to_controller(request, await request.body())


for _method, _path in WRITES:
    router.add_api_route(_path, _forward, methods=[_method], include_in_schema=False)


async def to_controller(request: Request, body: bytes) -> JSONResponse:
    """The controller's answer to this request (with `body` as its body), with its status; its
    refusal is raised as the same HTTPException, so the front answers exactly as the controller did."""
    link = request.app.state.front
    if not link.connected or not link.admin_url:
        raise HTTPException(503, detail={"message": UNAVAILABLE, "param": None}, headers={"Retry-After": "1"})
    client: httpx.AsyncClient | None = getattr(request.app.state, "controller_http", None)
    if client is None:
        ca = request.app.state.settings.tls_ca_file
        client = request.app.state.controller_http = httpx.AsyncClient(timeout=30.0, verify=ca or True)
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
    try:
        url = link.admin_url + request.url.path
        r = await client.request(request.method, url, content=body, headers=headers, params=request.query_params)
    except httpx.HTTPError:
        raise HTTPException(503, detail={"message": UNAVAILABLE, "param": None}, headers={"Retry-After": "1"}) from None
    try:
        doc = r.json()
    except ValueError:
        detail = {"message": f"the controller answered {r.status_code} without a JSON body", "param": None}
        raise HTTPException(502, detail=detail) from None
    if r.is_success:
        return JSONResponse(doc, status_code=r.status_code)
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    detail = {"message": str(err.get("message", r.reason_phrase)), "param": err.get("param")}
    retry = {k: v for k, v in r.headers.items() if k == "retry-after"}
    raise HTTPException(r.status_code, detail=detail, headers=retry)
