"""Bearer tokens: the admin API needs the daemon token (when one is set, always off loopback); the
OpenAI endpoints need one of the API keys when any are configured."""

from __future__ import annotations

from fastapi import HTTPException, Request


def _bearer(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    return h[7:] if h.lower().startswith("bearer ") else None


def require_admin(request: Request) -> None:
    token = request.app.state.settings.token
    if token and _bearer(request) != token:
        raise HTTPException(401, detail="admin API: bad or missing bearer token")


def require_api_key(request: Request) -> None:
    keys = request.app.state.settings.api_keys
    if keys and _bearer(request) not in keys:
        raise HTTPException(401, detail="invalid API key")
