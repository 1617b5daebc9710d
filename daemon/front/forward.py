"""A front's admin writes that belong to the controller (policy changes, flips): forwarded to the
controller's HTTP API with the caller's credentials, its answer passed back as it is. While the controller
is away (restarting) they get 503 with Retry-After; every read is answered by the front itself."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import HTTPException, Request

UNAVAILABLE = "the controller is unavailable (restarting?): retry in a moment"


def at_front(request: Request) -> bool:
    return getattr(request.app.state, "role", "daemon") == "front"


async def to_controller(request: Request, payload: Any) -> dict[str, Any]:
    """The controller's answer to this request (with `payload` as its JSON body); its refusal is raised as
    the same HTTPException, so the front answers exactly as the controller did."""
    link = request.app.state.front
    if not link.connected or not link.admin_url:
        raise HTTPException(503, detail={"message": UNAVAILABLE, "param": None}, headers={"Retry-After": "1"})
    client: httpx.AsyncClient | None = getattr(request.app.state, "controller_http", None)
    if client is None:
        ca = request.app.state.settings.tls_ca_file
        client = request.app.state.controller_http = httpx.AsyncClient(timeout=30.0, verify=ca or True)
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    try:
        url = link.admin_url + request.url.path
        r = await client.request(request.method, url, json=payload, headers=headers, params=request.query_params)
    except httpx.HTTPError:
        raise HTTPException(503, detail={"message": UNAVAILABLE, "param": None}, headers={"Retry-After": "1"}) from None
    try:
        doc = r.json()
    except ValueError:
        detail = {"message": f"the controller answered {r.status_code} without a JSON body", "param": None}
        raise HTTPException(502, detail=detail) from None
    if r.is_success:
        return dict(doc)
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    detail = {"message": str(err.get("message", r.reason_phrase)), "param": err.get("param")}
    retry = {k: v for k, v in r.headers.items() if k == "retry-after"}
    raise HTTPException(r.status_code, detail=detail, headers=retry)
