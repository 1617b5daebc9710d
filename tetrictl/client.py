"""The one HTTP client of tetrictl and its dashboard: async httpx against the daemon's admin and OpenAI APIs.

Every call returns the decoded JSON document or raises a `ClientError` carrying tetrictl's exit code:
`Unreachable` (3) when the daemon cannot be reached, `Refused` (1, or 2 when the daemon says the input
was bad: HTTP 400, 404, 422) with the daemon's one-line message. Commands and widgets call these
methods; none of them builds a request itself.

Where the daemon is: `--url`/`--token` flags, else `TETRI_URL`/`TETRI_TOKEN`, else the `[ctl]` table
(`url`, `token`) of the config file named by `--config` or `TETRI_CONFIG`, else http://127.0.0.1:8000.
"""

from __future__ import annotations

import json
import os
import ssl
import tomllib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from . import exitcodes

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    code = exitcodes.REFUSED

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class Unreachable(ClientError):
    code = exitcodes.UNREACHABLE


class Refused(ClientError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, exitcodes.USAGE if status in (400, 404, 422) else exitcodes.REFUSED)
        self.status = status


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None
    ca_file: str | None = None  # https: trust this PEM CA bundle (else the system's, or SSL_CERT_FILE's)


def resolve_target(url: str | None = None, token: str | None = None, config: Path | None = None) -> Target:
    """Flags beat the environment, the environment beats the config file's [ctl] table. The CA file comes
    from `tetrictl --ca-file` (which sets TETRI_CA_FILE), TETRI_CA_FILE or [ctl] ca_file."""
    section: dict[str, Any] = {}
    path = config or (Path(os.environ["TETRI_CONFIG"]) if os.environ.get("TETRI_CONFIG") else None)
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ClientError(f"cannot read config {path}: {e.strerror}", exitcodes.USAGE) from None
        except tomllib.TOMLDecodeError as e:
            raise ClientError(f"config {path}: {e}", exitcodes.USAGE) from None
        ctl = data.get("ctl", {})
        if not isinstance(ctl, dict):
            raise ClientError(f"config {path}: [ctl] must be a table", exitcodes.USAGE)
        section = ctl
    u = url or os.environ.get("TETRI_URL") or section.get("url") or DEFAULT_URL
    t = token or os.environ.get("TETRI_TOKEN") or section.get("token")
    if not isinstance(u, str) or not u.startswith(("http://", "https://")):
        raise ClientError(f"daemon url must start with http:// or https://, not {u!r}", exitcodes.USAGE)
    ca = os.environ.get("TETRI_CA_FILE") or section.get("ca_file")
    return Target(u.rstrip("/"), str(t) if t else None, str(ca) if ca else None)


def _q(segment: str) -> str:
    """One path segment, escaped (an id with '/', '?' or '#' must not change the route)."""
    return quote(segment, safe="")


def _message(resp: httpx.Response) -> str:
    try:
        doc = resp.json()
    except ValueError:
        return resp.text.strip()[:200] or resp.reason_phrase
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if doc.get("detail"):
            return str(doc["detail"])
    return resp.reason_phrase


class SseStream:
    """An OpenAI-style streamed answer (`text/event-stream`: `data: {json}` events, then `data: [DONE]`), read
    from an httpx response: ``async for doc in SseStream(r)`` (or ``for`` over a sync response) yields each
    event's JSON document in order, an error event (``{"error": …}``) included; `done` is True once
    `data: [DONE]` came (False: the stream was cut). The one reader of streams in tetrictl, its benches and
    tests; other lines (comments, blank separators) are skipped."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.done = False

    def _doc(self, line: str) -> dict[str, Any] | None:
        if not line.startswith("data: "):
            return None
        if line == "data: [DONE]":
            self.done = True
            return None
        doc: dict[str, Any] = json.loads(line[6:])
        return doc

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self.response.aiter_lines():
            doc = self._doc(line)
            if doc is not None:
                yield doc
            elif self.done:
                return

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for line in self.response.iter_lines():
            doc = self._doc(line)
            if doc is not None:
                yield doc
            elif self.done:
                return


class TetriClient:
    """``async with TetriClient(target) as c: await c.cluster()``."""

    def __init__(self, target: Target, timeout: float = 10.0, transport: httpx.AsyncBaseTransport | None = None):
        headers: dict[str, str] = {}  # the daemon knows who calls by the admin token, not by a header
        if target.token:
            headers["authorization"] = f"Bearer {target.token}"
        self.target = target
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
        # a plain-http daemon needs no CA bundle: a bare context (still verifying, with nothing to trust) spares
        # the 20 ms of loading one at every start; https gets the system's
        verify: ssl.SSLContext | bool = (
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) if target.url.startswith("http://") else True
        )
        if target.ca_file and verify is True:
            try:
                verify = ssl.create_default_context(cafile=target.ca_file)
            except (OSError, ssl.SSLError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else "not a PEM CA bundle"
                raise ClientError(f"--ca-file: cannot load {target.ca_file}: {why}", exitcodes.USAGE) from None
        try:
            self._h = httpx.AsyncClient(
                base_url=target.url, headers=headers, timeout=timeout, limits=limits, transport=transport, verify=verify
            )
        except (OSError, ssl.SSLError) as e:  # https: the CA file SSL_CERT_FILE names is missing or not PEM
            where = os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR") or "the system's CA bundle"
            raise ClientError(f"cannot load the CAs to trust from {where}: {e}", exitcodes.USAGE) from None

    async def __aenter__(self) -> TetriClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._h.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = await self._h.request(
                method,
                path,
                json=json,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise Unreachable(f"cannot reach the daemon at {self.target.url} ({type(e).__name__})") from None
        except httpx.TimeoutException:
            raise Unreachable(f"the daemon at {self.target.url} did not answer in time") from None
        except httpx.TransportError as e:
            raise Unreachable(f"lost the connection to the daemon at {self.target.url}: {e}") from None
        if resp.status_code >= 400:
            raise Refused(resp.status_code, f"HTTP {resp.status_code}: {_message(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise ClientError(f"the daemon answered {path} with something that is not JSON") from None

    # --- cluster ----------------------------------------------------------------------------------------
    async def cluster(self) -> dict[str, Any]:
        return await self._call("GET", "/api/v1/cluster")

    async def instances(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/api/v1/instances"))["instances"]

    async def instance(self, instance_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/api/v1/instances/{_q(instance_id)}")

    async def cordon(self, instance_id: str) -> dict[str, Any]:
        """The instance, cordoned (`changed`: it was not yet)."""
        return await self._call("POST", f"/api/v1/instances/{_q(instance_id)}/cordon")

    async def uncordon(self, instance_id: str) -> dict[str, Any]:
        """The instance, uncordoned (`changed`: it was cordoned)."""
        return await self._call("POST", f"/api/v1/instances/{_q(instance_id)}/uncordon")

    # --- requests ---------------------------------------------------------------------------------------
    async def requests(
        self,
        phase: str | None = None,
        status: str | None = None,
        limit: int = 50,
        offset: int = 0,
        id_prefix: str | None = None,
    ) -> dict[str, Any]:
        params = {"phase": phase, "status": status, "limit": limit, "offset": offset, "id_prefix": id_prefix}
        return await self._call("GET", "/api/v1/requests", params=params)

    async def all_requests(self, id_prefix: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        while True:
            page = await self.requests(status=status, limit=1000, offset=len(rows), id_prefix=id_prefix)
            rows += page["requests"]
            if not page["requests"] or len(rows) >= page["total"]:
                return rows

    async def request(self, request_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/api/v1/requests/{_q(request_id)}")

    async def cancel(self, request_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/api/v1/requests/{_q(request_id)}/cancel")

    async def cancel_many(self, id_prefix: str = "") -> dict[str, Any]:
        """Every in-flight request (whose id starts with ``id_prefix``) cancelled at once."""
        return await self._call("POST", "/api/v1/requests/cancel", json={"id_prefix": id_prefix})

    async def complete(self, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        """POST /v1/completions (non-streaming); waits for the whole answer."""
        return await self._call("POST", "/v1/completions", json=body, timeout=timeout)

    # --- flips --------------------------------------------------------------------------------------------
    async def flip(self, instance_id: str, to: str | None = None, reason: str = "manual") -> dict[str, Any]:
        body: dict[str, Any] = {"reason": reason}
        if to is not None:
            body["to"] = to
        return await self._call("POST", f"/api/v1/instances/{_q(instance_id)}/flip", json=body)

    async def flips(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/api/v1/flips"))["flips"]

    # --- policies -----------------------------------------------------------------------------------------
    async def policies(self) -> dict[str, Any]:
        return await self._call("GET", "/api/v1/policies")

    async def set_policies(self, changes: dict[str, Any]) -> dict[str, Any]:
        return await self._call("PUT", "/api/v1/policies", json=changes)

    async def policy_history(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/api/v1/policies/history"))["changes"]

    async def predictor(self) -> dict[str, Any]:
        return await self._call("GET", "/api/v1/predictor")

    # --- plan admission -----------------------------------------------------------------------------------
    async def load_plan(self, instance_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        return await self._call("PUT", f"/api/v1/instances/{_q(instance_id)}/plan", json=plan)

    async def clear_plan(self, instance_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/api/v1/instances/{_q(instance_id)}/plan")
