"""OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions (streaming or not), and
GET /v1/models (every model a registered worker serves). The `model` field routes a request to that
model's instances; prompts are tokenized, and outputs detokenized, with that model's tokenizer
(`daemon.served`, `daemon.front.textstream`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tetri.sampling import Sampling

from ..api.auth import require_api_key
from ..api.schemas import (
    INT32_MAX,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    SamplingFields,
    chat_chunk,
    chat_completion,
    completion_chunk,
    error_body,
    errors,
    openai_error,
    store_refused,
    usage,
)
from ..api.sse import EventStream, StreamSend, send_now
from ..db.models import Status
from ..inflight import new_request_id
from ..served import ServedModels
from ..tokenizer import Tokenizer, TokenizerError, render
from .gateway import Failed, Finished, Gateway
from .textstream import TextStream

router = APIRouter(dependencies=[Depends(require_api_key)])
CODES = errors(400, 401, 404, 409, 413, 429, 502, 503)
RETRY_AFTER_S = "1"  # a request its instance rejected (429): when to try again, in seconds


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _served(request: Request) -> ServedModels:
    return request.app.state.served


@router.get("/v1/models", responses=errors(401))
async def models(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    created = int(request.app.state.started)
    cards = [ModelCard(id=m, created=created, max_model_len=n or None) for m, n in sorted(gw.cluster.models().items())]
    return {"object": "list", "data": [c.model_dump() for c in cards]}


class BadPrompt(ValueError):
    """A prompt that cannot be served: (param, message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _completion_ids(body: CompletionRequest, tok: Tokenizer | None) -> list[int]:
    p = body.prompt
    one: str | list[int] | None = None
    # validated: a list is all ints, all strings or all lists (the schema's union), so its head says which
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        one = p
    elif isinstance(p, list) and len(p) == 1:
        one = p[0]  # type: ignore[assignment]
    if one is None:
        why = "prompt must be one string or one list of token ids (batched prompts are not supported)"
        raise BadPrompt("prompt", why)
    if isinstance(one, list):
        return list(one)
    if tok is None:
        raise BadPrompt("prompt", f"model {body.model!r} has no tokenizer on this daemon: send token ids")
    return tok.encode(one, add_special_tokens=True)


def _chat_ids(body: ChatCompletionRequest, tok: Tokenizer | None) -> list[int]:
    if tok is None:
        raise BadPrompt("messages", f"model {body.model!r} has no tokenizer on this daemon: use /v1/completions")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    try:
        return tok.encode(render(tok, messages), add_special_tokens=False)
    except TokenizerError as e:
        raise BadPrompt("messages", str(e)) from None


def _unsupported(body: SamplingFields) -> tuple[str, str] | None:
    """The first field set to something this server does not implement: (field, why). Only fields the
    client set can be (the defaults are neutral), and only those are looked up (pydantic's lookup of a
    field a model does not have is slow)."""
    given = body.model_fields_set
    for name, (neutral, why) in UNSUPPORTED.items():
        if name in given and getattr(body, name) not in neutral:
            return name, why
    return None


def _sampling(body: SamplingFields, tok: Tokenizer | None) -> Sampling:
    """The request's sampling; omitted fields take the model's generation-config defaults, then OpenAI's."""
    d = tok.defaults if tok is not None else {}
    stops = tuple(body.stop_token_ids or ())
    if not body.ignore_eos and tok is not None:
        stops += tuple(sorted(tok.eos_ids - set(stops)))
    top_k = body.top_k if body.top_k is not None else int(d.get("top_k", 0))
    return Sampling(
        temperature=body.temperature if body.temperature is not None else d.get("temperature", 1.0),
        top_p=body.top_p if body.top_p is not None else d.get("top_p", 1.0),
        top_k=max(0, top_k),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_token_ids=stops,
        ignore_eos=body.ignore_eos,
    )


@dataclass
class _Job:
    rid: str
    model: str
    prompt_tokens: int
    created: int
    serve: Callable[..., Awaitable[Finished | Failed]]  # Gateway.serve with the request bound: (out=…)
    include_usage: bool
    with_ids: bool


def _draining(gw: Gateway, rid: str, max_tokens: int, model: str) -> JSONResponse:
    """A request to a draining daemon: 503 with Retry-After, recorded (the writer flushes before it exits)."""
    gw.record_rejected(rid, "the daemon is shutting down (draining)", 0, max_tokens, model)
    return JSONResponse(
        error_body("the daemon is shutting down; retry on another", "ServiceUnavailableError", None, "draining"),
        status_code=503,
        headers={"Retry-After": "5"},
    )


async def _admit(
    request: Request,
    body: SamplingFields,
    ids_of: Callable[[Tokenizer | None], list[int]],
    max_tokens: int | None,
    id_prefix: str,
    max_field: str = "max_tokens",
) -> _Job | JSONResponse:
    """Validate, tokenize and start one request, or the error answer (recorded as rejected). `max_field`:
    the field `max_tokens` came from, which its refusals name."""
    gw = _gateway(request)
    if gw.draining:
        return _draining(gw, new_request_id(id_prefix), max_tokens or 0, body.model)
    refusal = gw.writer.refusal()
    if refusal is not None:  # past the rows held for an unavailable status table (not recorded: one more)
        return store_refused(refusal)
    chosen = body.tetri.request_id if body.tetri else None
    rid = chosen or new_request_id(id_prefix)
    if chosen:  # only a client-chosen id can collide; generated ids skip the lookup on this hot path
        why = await gw.reserve(rid)  # held until the request is in flight (or refused below)
        if why == "taken":
            return openai_error(409, f"request id {rid!r} is already taken", "ConflictError", "tetri.request_id")
        if why is not None:
            return store_refused(why)
    ids: list[int] = []

    def reject(status: int, message: str, type_: str, param: str | None, code: str | None = None) -> JSONResponse:
        # recorded under an id of its own: a client-chosen id stays free for the corrected request
        note = f"{message} (tetri.request_id {rid!r})" if chosen else message
        gw.release_id(rid)
        gw.record_rejected(new_request_id(), note, len(ids), max_tokens or 0, body.model)
        return openai_error(status, message, type_, param, code)

    unsupported = _unsupported(body)
    if unsupported is not None:
        return reject(400, f"{unsupported[0]}: {unsupported[1]}", "BadRequestError", unsupported[0])
    served = gw.cluster.models()
    if body.model not in served:
        if body.model in request.app.state.settings.expect_models:  # starting: no instance has registered yet
            answer = reject(503, f"The model `{body.model}` is starting; retry.", "ServiceUnavailableError", "model")
            answer.headers["Retry-After"] = "5"
            return answer
        return reject(404, f"The model `{body.model}` does not exist.", "NotFoundError", "model", "model_not_found")
    tok = _served(request).tokenizer(body.model)
    try:
        ids = ids_of(tok)
    except BadPrompt as e:
        return reject(400, str(e), "BadRequestError", e.param)
    if not ids:
        return reject(400, "prompt must not be empty", "BadRequestError", "prompt")
    limit = min(gw.cluster.vocab_size(body.model) or INT32_MAX + 1, INT32_MAX + 1)
    bad = None if min(ids) >= 0 and max(ids) < limit else next(t for t in ids if not 0 <= t < limit)
    if bad is not None:
        message = f"prompt token id {bad} is outside the model's vocabulary (0 … {limit - 1})"
        return reject(400, message, "BadRequestError", "prompt")
    if body.stop and tok is None:
        return reject(400, "stop strings need the model's tokenizer (none on this daemon)", "BadRequestError", "stop")
    max_len = served[body.model] or gw.cluster.max_model_len(body.model)
    if max_len is None:
        return reject(503, "no instance is registered yet", "ServiceUnavailableError", None)
    if len(ids) >= max_len:
        message = f"prompt has {len(ids)} tokens; this model's context is {max_len}"
        return reject(400, message, "BadRequestError", "prompt", "context_length_exceeded")
    want = max_tokens if max_tokens is not None else max_len - len(ids)
    field = max_field
    if want <= 0:
        return reject(400, f"{field} must be at least 1, got {want}", "BadRequestError", field)
    if len(ids) + want > max_len:
        message = f"{field} {want} + prompt {len(ids)} tokens exceeds the context of {max_len}"
        return reject(400, message, "BadRequestError", field, "context_length_exceeded")
    sla = body.tetri
    pin = sla.decode_instance if sla else None
    if pin is not None:
        target = gw.cluster.instances.get(pin)
        if target is None or target.role != "decode" or target.model != body.model:
            what = "no such instance" if target is None else f"it is a {target.role} instance of {target.model!r}"
            return reject(400, f"tetri.decode_instance {pin!r}: {what}", "BadRequestError", "tetri.decode_instance")
        if target.cordoned:  # it takes no new hand-over (its worker would wait for it to be active, then fail)
            message = f"tetri.decode_instance {pin!r}: it is cordoned (no new work until uncordoned)"
            return reject(409, message, "ConflictError", "tetri.decode_instance")
    sampling = _sampling(body, tok)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    text = TextStream(tok.decoder(ids), stop, frozenset(sampling.stop_token_ids)) if tok is not None else None
    serve = partial(
        gw.serve,
        rid,
        body.model,
        ids,
        want,
        sla_ttft_ms=sla.sla_ttft_ms if sla else None,
        sla_jct_ms=sla.sla_jct_ms if sla else None,
        pin=pin,
        sampling=sampling,
        text=text,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _Job(rid, body.model, len(ids), int(time.time()), serve, include_usage, body.return_token_ids)


class _Whole:
    """A non-streamed answer's output: its text and token ids, gathered."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.ids: list[int] = []

    def tokens(self, ids: list[int], text: str) -> None:
        self.parts.append(text)
        self.ids += ids


async def _collect(job: _Job) -> tuple[str, list[int], str, int | None] | Failed:
    """A whole answer: its text, token ids, finish reason and cached prompt tokens, or the failure."""
    out = _Whole()
    end = await job.serve(out=out)
    if isinstance(end, Failed):
        return end
    return "".join(out.parts), out.ids, end.reason, end.cached_tokens


@router.post("/v1/completions", response_model=None, responses=CODES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    job = await _admit(request, body, lambda tok: _completion_ids(body, tok), body.max_tokens, "cmpl-")
    return job if isinstance(job, JSONResponse) else await _respond(job, body.stream, False, request)


@router.post("/v1/chat/completions", response_model=None, responses=CODES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    # max_completion_tokens wins over max_tokens, as OpenAI's
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    job = await _admit(request, body, lambda tok: _chat_ids(body, tok), max_tokens, "chatcmpl-", field)
    return job if isinstance(job, JSONResponse) else await _respond(job, body.stream, True, request)


async def _respond(job: _Job, stream: bool, chat: bool, request: Request) -> Response:
    """The answer to an admitted request: an SSE stream, or the whole completion (or its failure). A client
    that disconnects before a whole completion is ready cancels its request, as a stream's does."""
    if stream:
        return EventStream(_sse(job, chat, request.app.state.settings.stream_interval))
    collect = asyncio.ensure_future(_collect(job))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server gave up on this request (its shutdown): so does the job
        collect.cancel()
        raise
    finally:
        gone.cancel()
    if not collect.done():  # the client left: stop the request (recorded as cancelled), answer no one
        collect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collect
        return Response(status_code=499)
    got = collect.result()
    if isinstance(got, Failed) and got.status == Status.REJECTED:
        return _rejected(got)
    if isinstance(got, Failed):
        status = 503 if got.status == Status.INTERRUPTED else 502
        return openai_error(status, got.message, "APIError", None, _failure_code(got))
    text, toks, reason, cached = got
    ids = toks if job.with_ids else None
    whole = chat_completion if chat else completion_chunk
    used = usage(job.prompt_tokens, len(toks), cached)
    return JSONResponse(whole(job.rid, job.created, job.model, text, reason, used, ids))


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (its body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failure_code(ev: Failed) -> str:
    if ev.status == Status.REJECTED:
        return "ttft_target_missed"
    return "daemon_shutdown" if ev.status == Status.INTERRUPTED else "worker_failed"


def _rejected(ev: Failed) -> JSONResponse:
    """A request its instance turned away before its first token (`ttft_miss` reject): 429, as a server too
    busy to answer in time; nothing was done, so the client may retry."""
    answer = openai_error(429, ev.message, "RateLimitError", None, _failure_code(ev))
    answer.headers["Retry-After"] = RETRY_AFTER_S
    return answer


def _usage_chunk(job: _Job, chat: bool, n: int, cached: int | None) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    u = usage(job.prompt_tokens, n, cached)
    if chat:
        return chat_chunk(job.rid, job.created, job.model, None, None, u)
    return {"id": job.rid, "object": "text_completion", "created": job.created, "model": job.model, "choices": [],
            "usage": u}  # fmt: skip


# Characters JSON leaves raw that line readers built on str.splitlines (httpx's `aiter_lines`, Python's
# own) take for line ends, splitting an event mid-string: NEL, LINE and PARAGRAPH SEPARATOR. Escaped, the
# JSON decodes to the same text; SSE's own line ends (CR, LF) never occur raw (JSON escapes controls).
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _json(value: Any) -> bytes:
    """`value` as JSON, safe for line readers that split on Unicode line breaks."""
    raw = orjson.dumps(value)
    if b"\xc2\x85" in raw or b"\xe2\x80" in raw:
        for ch, esc in _LINE_BREAKING:
            raw = raw.replace(ch, esc)
    return raw


def sse_data(body: dict[str, Any]) -> bytes:
    """One SSE event carrying `body` as JSON, safe for line readers that split on Unicode line breaks."""
    return b"data: " + _json(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class _Frames:
    """A stream's token chunks as SSE frames, built as bytes: the chunk's JSON (`chat_chunk`,
    `completion_chunk`) is dumped once per stream with placeholders, and a frame is its constant pieces
    around the text's JSON (and the ids'), so a token costs no dict and no whole-document dump."""

    # placeholders, where the text and the ids go: a NUL (JSON escapes it) and a random tag, which nothing
    # else in the chunk (its id, its model's name) can hold
    _TEXT = "\x00" + os.urandom(8).hex()
    _IDS = "\x00" + os.urandom(8).hex()

    def __init__(self, job: _Job, chat: bool) -> None:
        ids: Any = self._IDS if job.with_ids else None
        self.with_ids = job.with_ids
        rid, created, model = job.rid, job.created, job.model
        if chat:
            self.text = self._split(chat_chunk(rid, created, model, {"content": self._TEXT}, None, None, ids))
            self.bare = self._split(chat_chunk(rid, created, model, {}, None, None, ids))  # no text
        else:
            self.text = self._split(completion_chunk(rid, created, model, self._TEXT, None, None, ids))
            self.bare = []

    def _split(self, body: dict[str, Any]) -> list[bytes]:
        """The frame's constant pieces, around its text and ids (where they are)."""
        raw = sse_data(body)
        pieces: list[bytes] = []
        for part in raw.split(orjson.dumps(self._TEXT)):
            pieces += part.split(orjson.dumps(self._IDS)) if self.with_ids else [part]
        return pieces

    def frame(self, ids: list[int], text: str) -> bytes:
        if not text and self.bare:
            pieces, values = self.bare, [orjson.dumps(ids)] if self.with_ids else []
        else:
            pieces, values = self.text, [_json(text)]
            if self.with_ids:
                values.append(orjson.dumps(ids))
        out = pieces[0]
        for value, piece in zip(values, pieces[1:], strict=True):
            out += value + piece
        return out


class _Stream:
    """A streamed answer's output: each engine step's tokens become a frame, sent at once from where they
    arrive (`send_now`: no task switch); frames that come while a send waits (a slow client) follow it.

    With a stream interval N > 1 (`[daemon] stream_interval`, as vLLM's `--stream-interval`) the first
    frame goes at once and then one frame per N tokens, carrying them all; what is held at the end goes
    with the response's end (`take`). The text is the same, in fewer events and socket writes."""

    def __init__(self, frames: _Frames, send: StreamSend, interval: int = 1) -> None:
        self.frames = frames
        self.send = send
        self.write_now = send.write_now
        self.buffer = b""  # frames behind a send that waits
        self.waiting: asyncio.Future[None] | None = None
        self.failed: BaseException | None = None
        self.count = 0  # tokens that count, for the usage chunk
        self.interval = interval
        self.held_ids: list[int] = []  # tokens not framed yet (stream interval > 1)
        self.held_text = ""
        self.framed = 0  # tokens framed so far (stream interval > 1)
        self.prefix = b""  # sent before the first frame (a chat stream's role chunk)
        self.sent = False  # anything handed to the server yet (the response has begun)

    def tokens(self, ids: list[int], text: str) -> None:
        self.count += len(ids)
        if self.interval > 1:
            self.held_ids += ids
            self.held_text += text
            if self.framed and self.count - self.framed < self.interval:
                return
            ids, text, self.held_ids, self.held_text = self.held_ids, self.held_text, [], ""
        if text or (ids and self.frames.with_ids):
            self.framed = self.count
            frame = self.frames.frame(ids, text)
            if self.prefix:
                frame, self.prefix = self.prefix + frame, b""
            if self.waiting is None and self.failed is None:
                self._send(frame)
            else:
                self.buffer += frame

    def _send(self, data: bytes) -> None:
        self.sent = True
        if self.write_now(data):  # straight to the connection (`StreamSend.write_now`)
            return
        try:
            self.waiting = send_now(self.send, {"type": "http.response.body", "body": data, "more_body": True})
        except Exception as e:  # the request's task raises it (`flush`): the Serve stream's reader goes on
            self.failed = e
            return
        if self.waiting is not None:
            self.waiting.add_done_callback(self._sent)

    def _sent(self, done: asyncio.Future[None]) -> None:
        self.waiting = None
        if done.cancelled():
            self.failed = asyncio.CancelledError()
        elif done.exception() is not None:
            self.failed = done.exception()
        elif self.buffer:
            data, self.buffer = self.buffer, b""
            self._send(data)

    async def flush(self) -> None:
        """Wait until every frame so far has been sent (or raise why not)."""
        while self.waiting is not None:
            await asyncio.wait((self.waiting,))
        if self.failed is not None:
            raise self.failed

    def take(self) -> bytes:
        """What is not sent yet: the frames behind a send, and the tokens held for the stream interval."""
        data, self.buffer = self.prefix + self.buffer, b""
        self.prefix = b""
        if self.held_text or (self.held_ids and self.frames.with_ids):
            data += self.frames.frame(self.held_ids, self.held_text)
        self.held_ids, self.held_text = [], ""
        return data


def _sse(job: _Job, chat: bool, interval: int) -> Callable[[StreamSend], Awaitable[bytes | Response]]:
    """The stream's body: the request served with its frames written as they come; returns its last piece
    (what is buffered, the finishing chunk, the usage, `[DONE]`), which goes out with the response's end."""

    async def body(send: StreamSend) -> bytes | Response:
        out = _Stream(_Frames(job, chat), send, interval)
        if chat:  # the first chunk names the role, as OpenAI's and vLLM's do (it goes with the first tokens)
            out.prefix = sse_data(
                chat_chunk(job.rid, job.created, job.model, {"role": "assistant", "content": ""}, None)
            )
        end = await job.serve(out=out)
        await out.flush()
        if isinstance(end, Failed) and end.status == Status.REJECTED and not out.sent:
            return _rejected(end)  # nothing was sent: the response can still be a 429
        tail = out.take()
        if isinstance(end, Failed):
            return tail + sse_data(error_body(end.message, "APIError", None, _failure_code(end))) + DONE
        ids: list[int] | None = [] if job.with_ids else None
        if chat:
            tail += sse_data(chat_chunk(job.rid, job.created, job.model, {}, end.reason, None, ids))
        else:
            tail += sse_data(completion_chunk(job.rid, job.created, job.model, "", end.reason, None, ids))
        if job.include_usage:
            tail += sse_data(_usage_chunk(job, chat, out.count, end.cached_tokens))
        return tail + DONE

    return body
