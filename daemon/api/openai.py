"""OpenAI-compatible endpoints: POST /v1/completions (streaming or not) and GET /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..gateway import Failed, Finished, Gateway, new_request_id
from ..tokenizer import ByteTokenizer
from .auth import require_api_key
from .schemas import CompletionRequest, ModelCard, completion_chunk, error_body, usage

router = APIRouter(dependencies=[Depends(require_api_key)])
tokenizer = ByteTokenizer()


def openai_error(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    card = ModelCard(id=gw.model, created=int(request.app.state.started), max_model_len=gw.max_model_len())
    return {"object": "list", "data": [card.model_dump()]}


def _prompt_ids(body: CompletionRequest) -> list[int] | str:
    """The prompt as token ids, or an error message."""
    p = body.prompt
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return list(p)  # type: ignore[arg-type]
    if isinstance(p, list) and len(p) == 1:
        one = p[0]
        if isinstance(one, str):
            return tokenizer.encode(one)
        if isinstance(one, list):
            return list(one)
    return "prompt must be one string or one list of token ids (batched prompts are not supported)"


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    gw = _gateway(request)
    chosen = body.tetri.request_id if body.tetri else None
    rid = chosen or new_request_id()
    if chosen and (rid in gw.inflight or await asyncio.to_thread(request.app.state.store.get_request, rid)):
        # only a client-chosen id can collide; generated ids skip the lookup on this hot path
        return openai_error(409, f"request id {rid!r} is already taken", "ConflictError", "tetri.request_id")
    ids = _prompt_ids(body)
    max_len = gw.max_model_len()

    def reject(status: int, message: str, type_: str, param: str | None, code: str | None = None) -> JSONResponse:
        gw.record_rejected(rid, message, len(ids) if isinstance(ids, list) else 0, body.max_tokens)
        return openai_error(status, message, type_, param, code)

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
            return openai_error(502, ev.message, "APIError", None, "worker_failed")
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


async def _sse(
    events: AsyncIterator[Any], rid: str, created: int, model: str, prompt_len: int, with_ids: bool
) -> AsyncIterator[bytes]:
    n = 0
    async for ev in events:
        if isinstance(ev, Failed):
            yield b"data: " + json.dumps(error_body(ev.message, "APIError", None, "worker_failed")).encode() + b"\n\n"
            break
        if isinstance(ev, Finished):
            body = completion_chunk(rid, created, model, "", ev.reason, usage(prompt_len, n), [] if with_ids else None)
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
            break
        n += len(ev.ids)
        body = completion_chunk(rid, created, model, tokenizer.decode(ev.ids), None, None, ev.ids if with_ids else None)
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
