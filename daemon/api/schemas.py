"""The one place that owns the HTTP API's wire formats (OpenAI-compatible and admin)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TetriExtension(BaseModel):
    """Tetri's per-request extension, sent as ``"tetri": {...}`` (``extra_body`` in the openai client):
    SLA targets and an optional client-chosen request id."""

    model_config = ConfigDict(extra="forbid")
    sla_ttft_ms: float | None = Field(None, gt=0)
    sla_jct_ms: float | None = Field(None, gt=0)
    # the client's own id for the request (a plan replay names requests by the plan's ids)
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    # pin the decode phase to this decode instance (a plan replay sends its backlog to one instance)
    decode_instance: str | None = Field(None, min_length=1, max_length=128)


class StreamOptions(BaseModel):
    include_usage: bool = True


class CompletionRequest(BaseModel):
    """POST /v1/completions. Unknown OpenAI fields are accepted and ignored (as vLLM does)."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    user: str | None = None
    return_token_ids: bool = False
    tetri: TetriExtension | None = None


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int] | None = None,
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tetri"
    max_model_len: int | None = None
