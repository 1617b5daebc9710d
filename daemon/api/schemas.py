"""The one place that owns the HTTP API's wire formats (OpenAI-compatible and admin)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class TetriExtension(BaseModel):
    """Tetri's per-request extension, sent as ``"tetri": {...}`` (``extra_body`` in the openai client):
    SLA targets and an optional client-chosen request id."""

    model_config = ConfigDict(extra="forbid")
    sla_ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    sla_jct_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    # the client's own id for the request (a plan replay names requests by the plan's ids)
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    # pin the decode phase to this decode instance (a plan replay sends its backlog to one instance)
    decode_instance: str | None = Field(None, min_length=1, max_length=128)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk with `usage` and no choices


INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # the wire carries int32 ids


StopStrings = str | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)]


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share: sampling (passed to the engine: vLLM's
    SamplingParams; the sim engine's tokens are deterministic whatever they say), stops, streaming,
    Tetri's extension. Every field is typed strictly (``"4"`` is not 4, ``true`` is not 1); a field this
    server does not implement is a 400 naming it: unknown ones, and those in `UNSUPPORTED` at anything
    but their neutral value. An omitted sampling field takes the model's generation-config default, then
    OpenAI's (temperature 1), as vLLM's server does."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=256)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, strict=True, ge=-1, le=INT32_MAX)  # vLLM's: 0 or -1 is off
    seed: int | None = Field(None, strict=True, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    stop: StopStrings | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None  # vLLM's
    ignore_eos: bool = Field(False, strict=True)  # vLLM's: generate past the model's EOS
    user: str | None = Field(None, max_length=256)
    return_token_ids: bool = Field(False, strict=True)  # vLLM's: the output's token ids beside the text
    tetri: TetriExtension | None = None
    # OpenAI fields accepted only at their neutral value (see UNSUPPORTED)
    n: int | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int = Field(16, strict=True, le=INT32_MAX)
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn. Content is text, or a list of text parts (joined with newlines, as vLLM joins them)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, strict=True, le=INT32_MAX)  # None: what the context leaves
    max_completion_tokens: int | None = Field(None, strict=True, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


# field -> (values this server can honour, why not otherwise)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "only n=1 is supported"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "echo": ((None, False), "echo is not supported"),
    "logprobs": ((None, False), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "tools": ((None, []), "tools are not supported"),
    "tool_choice": ((None, "none"), "tools are not supported"),
    "response_format": ((None, {"type": "text"}), "response_format is not supported (text only)"),
}


class BulkCancel(BaseModel):
    """`POST /api/v1/requests/cancel`: which in-flight requests to cancel (all of them without `id_prefix`:
    the filter `GET /api/v1/requests` spells the same way)."""

    model_config = ConfigDict(extra="forbid")

    id_prefix: str = Field("", max_length=64, description="Only requests whose id starts with this.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer, /v1 and admin alike (OpenAI's error shape)."""

    error: ErrorDetail


_WHY = {
    400: "Bad request: a field out of range, of the wrong type, unsupported, or malformed JSON",
    401: "Missing or wrong bearer token",
    404: "No such model, instance, request or route",
    405: "Method not allowed on this route",
    409: "Conflict with the current state (id taken, not in flight, wrong role)",
    413: "Request body larger than max_request_bytes",
    429: "Turned away before its first token: it waited past the TTFT target (ttft_miss reject; Retry-After)",
    502: "The worker serving the request failed",
    503: "Not ready: no instance can serve, or the daemon is draining (Retry-After)",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error codes."""
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in codes}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    usage: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A chat.completion.chunk; `delta` None: the usage-only last chunk (no choices)."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if delta is None:
        body["choices"] = []
    else:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body["choices"] = [choice]
    if usage is not None:
        body["usage"] = usage
    return body


def chat_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with `prompt_tokens_details.cached_tokens` (prompt tokens found in the prefix
    cache, as OpenAI and vLLM's `--enable-prompt-tokens-details` report them) when it is known."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tetri"
    max_model_len: int | None = None


STORE_RETRY_AFTER_S = "5"  # the status table unavailable (503)


def openai_error(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def store_refused(message: str) -> JSONResponse:
    """503 for the status table: unavailable to a read, or past `store_buffer_rows` rows held for it."""
    return JSONResponse(
        error_body(message, "ServiceUnavailableError", None, "store_unavailable"),
        status_code=503,
        headers={"Retry-After": STORE_RETRY_AFTER_S},
    )
