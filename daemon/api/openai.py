"""OpenAI-compatible endpoints: POST /v1/completions (streaming or not) and GET /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..db.models import Status
from ..gateway import Failed, Finished, Gateway, new_request_id
from ..tokenizer import ByteTokenizer
from .auth import require_api_key
from .schemas import (
    INT32_MAX,
    UNSUPPORTED,
    CompletionRequest,
    ModelCard,
    completion_chunk,
    error_body,
    errors,
    usage,
)

router = APIRouter(dependencies=[Depends(require_api_key)])
tokenizer = ByteTokenizer()


def openai_error(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@router.get("/v1/models", responses=errors(401))
async def models(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    card = ModelCard(id=gw.model, created=int(request.app.state.started), max_model_len=gw.max_model_len())
    return {"object": "list", "data": [card.model_dump()]}


def _prompt_ids(body: CompletionRequest, vocab: int | None) -> list[int] | str:
    """The prompt as token ids, or an error message (ids must be known to every instance's model)."""
    p = body.prompt
    ids: list[int] | None = None
    if isinstance(p, str):
        ids = tokenizer.encode(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        ids = list(p)  # type: ignore[arg-type]
    elif isinstance(p, list) and len(p) == 1:
        one = p[0]
        ids = tokenizer.encode(one) if isinstance(one, str) else list(one) if isinstance(one, list) else None
    if ids is None:
        return "prompt must be one string or one list of token ids (batched prompts are not supported)"
    limit = min(vocab or INT32_MAX + 1, INT32_MAX + 1)
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        return f"prompt token id {bad} is outside the model's vocabulary (0 … {limit - 1})"
    return ids


def _unsupported(body: CompletionRequest) -> tuple[str, str] | None:
    """The first field set to something this server does not implement: (field, why)."""
    for name, (neutral, why) in UNSUPPORTED.items():
        if getattr(body, name) not in neutral:
            return name, why
    return None


@router.post("/v1/completions", response_model=None, responses=errors(400, 401, 404, 409, 413, 502, 503))
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    gw = _gateway(request)
    if gw.draining:
        return JSONResponse(
            error_body("the daemon is shutting down; retry on another", "ServiceUnavailableError", None, "draining"),
            status_code=503,
            headers={"Retry-After": "5"},
        )
    chosen = body.tetri.request_id if body.tetri else None
    rid = chosen or new_request_id()
    if chosen:  # only a client-chosen id can collide; generated ids skip the lookup on this hot path
        if gw.id_taken(rid):
            return openai_error(409, f"request id {rid!r} is already taken", "ConflictError", "tetri.request_id")
        # reserved from here until the request is in flight (or refused below): a second request with this
        # id meanwhile is a 409 too
        gw.reserved[rid] = time.monotonic()
        if await asyncio.to_thread(request.app.state.store.get_request, rid):
            gw.reserved.pop(rid, None)
            return openai_error(409, f"request id {rid!r} is already taken", "ConflictError", "tetri.request_id")
    ids = _prompt_ids(body, gw.vocab_size())
    max_len = gw.max_model_len()

    def reject(status: int, message: str, type_: str, param: str | None, code: str | None = None) -> JSONResponse:
        # recorded under an id of its own: a client-chosen id stays free for the corrected request
        note = f"{message} (tetri.request_id {rid!r})" if chosen else message
        gw.reserved.pop(rid, None)
        gw.record_rejected(new_request_id(), note, len(ids) if isinstance(ids, list) else 0, body.max_tokens)
        return openai_error(status, message, type_, param, code)

    unsupported = _unsupported(body)
    if unsupported is not None:
        return reject(400, f"{unsupported[0]}: {unsupported[1]}", "BadRequestError", unsupported[0])
    if body.model != gw.model:
        return reject(404, f"The model `{body.model}` does not exist.", "NotFoundError", "model", "model_not_found")
    if isinstance(ids, str):
        return reject(400, ids, "BadRequestError", "prompt")
    if not ids:
        return reject(400, "prompt must not be empty", "BadRequestError", "prompt")
    if any(t < 0 for t in ids):
        return reject(400, "prompt token ids must be non-negative", "BadRequestError", "prompt")
    if body.max_tokens <= 0:
        return reject(400, f"max_tokens must be at least 1, got {body.max_tokens}", "BadRequestError", "max_tokens")
    if max_len is not None and len(ids) >= max_len:
        return reject(
            400,
            f"prompt has {len(ids)} tokens; this model's context is {max_len}",
            "BadRequestError",
            "prompt",
            "context_length_exceeded",
        )
    if max_len is not None and len(ids) + body.max_tokens > max_len:
        return reject(
            400,
            f"max_tokens {body.max_tokens} + prompt {len(ids)} tokens exceeds the context of {max_len}",
            "BadRequestError",
            "max_tokens",
            "context_length_exceeded",
        )
    if max_len is None:
        return reject(503, "no instance is registered yet", "ServiceUnavailableError", None)
    sla = body.tetri
    pin = sla.decode_instance if sla else None
    if pin is not None:
        target = gw.cluster.instances.get(pin)
        if target is None or target.role != "decode":
            what = "no such instance" if target is None else f"it is a {target.role} instance"
            return reject(400, f"tetri.decode_instance {pin!r}: {what}", "BadRequestError", "tetri.decode_instance")
    events = gw.run(
        rid, ids, body.max_tokens, sla.sla_ttft_ms if sla else None, sla.sla_jct_ms if sla else None, pin=pin
    )
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _sse(events, rid, created, gw.model, len(ids), body.return_token_ids), media_type="text/event-stream"
        )
    toks: list[int] = []
    async for ev in events:
        if isinstance(ev, Failed):
            return openai_error(_failure_status(ev), ev.message, "APIError", None, _failure_code(ev))
        if isinstance(ev, Finished):
            reason = ev.reason
        else:
            toks.extend(ev.ids)
    return JSONResponse(
        completion_chunk(
            rid,
            created,
            gw.model,
            tokenizer.decode(toks),
            reason,
            usage(len(ids), len(toks)),
            toks if body.return_token_ids else None,
        )
    )


def _failure_code(ev: Failed) -> str:
    return "daemon_shutdown" if ev.status == Status.INTERRUPTED else "worker_failed"


def _failure_status(ev: Failed) -> int:
    return 503 if ev.status == Status.INTERRUPTED else 502


async def _sse(
    events: AsyncIterator[Any], rid: str, created: int, model: str, prompt_len: int, with_ids: bool
) -> AsyncIterator[bytes]:
    n = 0
    async for ev in events:
        if isinstance(ev, Failed):
            yield b"data: " + json.dumps(error_body(ev.message, "APIError", None, _failure_code(ev))).encode() + b"\n\n"
            break
        if isinstance(ev, Finished):
            body = completion_chunk(rid, created, model, "", ev.reason, usage(prompt_len, n), [] if with_ids else None)
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
            break
        n += len(ev.ids)
        body = completion_chunk(rid, created, model, tokenizer.decode(ev.ids), None, None, ev.ids if with_ids else None)
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
