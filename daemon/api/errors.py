"""How every process's HTTP API answers what it refuses (OpenAI's error body, `daemon.api.schemas`), and
the endpoints every process serves besides its rooms': /metrics, /healthz, /readyz."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..db.writer import BatchWriter, describe, store_unavailable
from ..inflight import new_request_id
from .guard import validation_param
from .schemas import error_body, errors, store_refused

KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
}
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")

router = APIRouter()


def install(app: FastAPI) -> None:
    """The app's error handlers: a body that does not validate (400 naming the field; a completion's is
    recorded as rejected), an HTTP error in OpenAI's shape, an unavailable status table (503)."""
    app.add_exception_handler(RequestValidationError, _bad_request)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(SQLAlchemyError, _store_error)  # type: ignore[arg-type]


async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if err.get("type") == "json_invalid":
        param, msg = None, "malformed JSON body"
    else:
        param = validation_param(err.get("loc", ()))
        why = "not a field this server supports" if err.get("type") == "extra_forbidden" else err["msg"]
        msg = f"{param or 'body'}: {why}"
    serving = getattr(request.app.state, "serving", None)
    if serving is not None and request.url.path in COMPLETIONS:
        serving.record_rejected(new_request_id(), msg)
    return JSONResponse(error_body(msg, "BadRequestError", param), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = KINDS.get(exc.status_code, "APIError")
    detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
    return JSONResponse(
        error_body(str(detail["message"]), kind, detail.get("param")),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _store_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
    """A status-table read (or a write the API makes itself) that failed because the database is
    unavailable: 503 naming the cause, not a 500 (the writer holds the rows meanwhile)."""
    if not store_unavailable(exc):
        raise exc
    writer: BatchWriter | None = getattr(request.app.state, "writer", None)
    held = f"; {writer.buffered} rows buffered" if writer is not None else ""
    return store_refused(f"the status table is unavailable ({describe(exc)}){held}")


@router.get("/metrics")
async def prometheus(request: Request) -> PlainTextResponse:
    text = generate_latest(request.app.state.metrics.registry).decode()
    return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses=errors(503))
async def readyz(request: Request) -> JSONResponse:
    cluster = getattr(request.app.state, "cluster", None)
    serving = getattr(request.app.state, "serving", None)
    ready = (
        cluster is not None
        and not (serving is not None and serving.draining)
        and bool(cluster.healthy("colocated") or (cluster.healthy("prefill") and cluster.healthy("decode")))
    )
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)
