"""Bearer tokens. The admin API needs an admin token when any is configured (`token`, named `admin`, and
the named `admin_tokens`; always off loopback); the caller's identity is the token's name, which the
audit records as `requested_by`. With no token (loopback only) the admin API is open to every local
process and the identity is `local`. The OpenAI endpoints need one of the API keys when any are
configured. Every comparison is constant-time."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from tetri.config import DaemonSettings

LOCAL = "local"  # the identity of an admin call on a daemon with no admin token


def _bearer(authorization: str) -> str | None:
    """The token of an Authorization header value ("Bearer <token>")."""
    return authorization[7:] if authorization.lower().startswith("bearer ") else None


def _match(presented: str | None, candidates: dict[str, str]) -> str | None:
    """The name of the candidate token equal to `presented` (every candidate compared, in constant time)."""
    if presented is None:
        return None
    hit = None
    for name, token in candidates.items():
        if hmac.compare_digest(presented.encode(), token.encode()):
            hit = name
    return hit


def admin_tokens(settings: DaemonSettings) -> dict[str, str]:
    tokens = dict(settings.admin_tokens)
    if settings.token:
        tokens["admin"] = settings.token
    return tokens


# The dependencies are coroutines: FastAPI runs a plain function dependency in a worker thread, a thread
# hop per request (a tenth of the daemon's CPU per request, bench/control_plane_cost.py).


async def require_admin(request: Request) -> None:
    tokens = admin_tokens(request.app.state.settings)
    if not tokens:
        request.state.identity = LOCAL
        return
    name = _match(_bearer(request.headers.get("authorization", "")), tokens)
    if name is None:
        raise HTTPException(401, detail="admin API: bad or missing bearer token")
    request.state.identity = name


def identity(request: Request) -> str:
    """Who made this admin call (after `require_admin`): the admin token's name, or `local`."""
    return str(getattr(request.state, "identity", LOCAL))[:64]


def api_key_ok(settings: DaemonSettings, authorization: str) -> bool:
    """Whether an Authorization header value passes the OpenAI endpoints' check (any key, when none is set)."""
    keys = settings.api_keys
    return not keys or _match(_bearer(authorization), {str(i): k for i, k in enumerate(keys)}) is not None


async def require_api_key(request: Request) -> None:
    if not api_key_ok(request.app.state.settings, request.headers.get("authorization", "")):
        raise HTTPException(401, detail="invalid API key")
