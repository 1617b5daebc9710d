"""vLLM's engine core, read by one loop in the worker: each `EngineCoreOutputs` (one engine step: every
request's new tokens) is handed out where it arrives. A request's tokens go to its `TokenSink` there and
then; its end resolves the one future its caller waits on.

vLLM's `AsyncLLM` would run its output processor on every step instead. For each request and step it makes
a `RequestOutput`, keeps a detokenizer state (unused here: the worker starts vLLM with no tokenizer, and the
front makes the text), and puts the output on the request's own queue, for a task to take. It also
records Prometheus metrics. Tetri's worker takes none of that. `AsyncLLM` still builds the engine (its
processes, the input processor), and its output loop is never started: it starts on the first request
added through it, and none is.

The worker process's CPU per token beside plain vLLM's API server, before and after: docs/vllm.md ("The
relay at its floor", bench/relay_cost.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.engines.base import EngineError, TokenSink

log = logging.getLogger(__name__)
PREEMPTED = 3  # vLLM's EngineCoreEventType.PREEMPTED


@dataclass(frozen=True, slots=True)
class CoreEnd:
    """How a request ended in the engine core."""

    reason: str  # vLLM's FinishReason as its string: stop | length | abort | error | repetition
    kv_params: dict[str, Any] | None  # the KV connector's transfer parameters (a prefill's, a decode's)
    cached: int | None  # prompt tokens the engine did not compute (its prefix cache's, a connector's)


@dataclass(slots=True)
class _Req:
    sink: TokenSink
    done: asyncio.Future[CoreEnd]
    cached: int | None = None


@dataclass
class CoreStats:
    """What the engine core reports with its steps: the KV cache's use, its prefix cache's lookups and hits
    (prompt tokens of new requests), the preemptions, and the output tokens of each step (`on_tokens`)."""

    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    on_tokens: Callable[[int], None] = field(default=lambda n: None)


class CoreLoop:
    """The requests in vLLM's engine core (`llm`: an `AsyncLLM` whose own output loop never runs), by vLLM's
    request id, and the task reading the core's outputs."""

    def __init__(self, llm: Any, stats: CoreStats) -> None:
        self._core = llm.engine_core
        self._inputs = llm.input_processor
        self._llm = llm
        self._stats = stats
        self._tasks: tuple[str, ...] = ()
        self._reqs: dict[str, _Req] = {}  # vLLM's request id -> the request
        self._ids: dict[str, str] = {}  # the worker's request id -> vLLM's
        self._reader: asyncio.Task[None] | None = None
        self._failed: str | None = None

    async def start(self) -> None:
        self._tasks = tuple(await self._llm.get_supported_tasks())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="vllm-core-outputs")

    async def stop(self, reason: str) -> None:
        self._fail(reason)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None

    async def run(self, rid: str, prompt: list[int], params: Any, sink: TokenSink, priority: int = 0) -> CoreEnd:
        """Run one request in the engine core: its tokens go to `sink` step by step; returns its end. The
        caller cancelled, the request is aborted in the core."""
        if self._failed is not None:
            raise EngineError(self._failed)
        try:
            req = self._inputs.process_inputs(
                rid,
                {"type": "token", "prompt_token_ids": prompt},
                params,
                supported_tasks=self._tasks,
                priority=priority,
            )
        except ValueError as e:  # vLLM's validation of the prompt and the sampling parameters
            raise EngineError(f"request {rid}: {e}") from None
        self._inputs.assign_request_id(req)  # vLLM's own id: the worker's, made unique
        vid = req.request_id
        done: asyncio.Future[CoreEnd] = asyncio.get_running_loop().create_future()
        self._reqs[vid] = _Req(sink, done)
        self._ids[rid] = vid
        try:
            await self._core.add_request_async(req)
            if done.done() and vid not in self._reqs:  # aborted while it was being added: the core drops it
                await self._core.abort_requests_async([vid])
            return await done
        except asyncio.CancelledError:
            if vid in self._reqs:
                await self._core.abort_requests_async([vid])
            raise
        finally:
            self._reqs.pop(vid, None)
            if self._ids.get(rid) == vid:
                del self._ids[rid]

    async def abort(self, rid: str) -> None:
        """End a request early: its `run` raises EngineError("aborted")."""
        vid = self._ids.pop(rid, None)
        r = self._reqs.pop(vid, None) if vid is not None else None
        if r is None:
            return
        if not r.done.done():
            r.done.set_exception(EngineError("aborted"))
        await self._core.abort_requests_async([vid])

    async def _read(self) -> None:
        get, reqs, stats = self._core.get_output_async, self._reqs, self._stats
        while True:
            try:
                outs = await get()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine core died: every request here fails
                log.error("vLLM's engine core failed: %s", e)
                self._fail(f"vLLM's engine core failed: {type(e).__name__}: {e}")
                return
            made = 0
            failed: list[str] = []
            for o in outs.outputs:
                r = reqs.get(o.request_id)
                if r is None:  # aborted meanwhile
                    continue
                toks = o.new_token_ids
                if r.cached is None and o.prefill_stats is not None:
                    r.cached = int(o.prefill_stats.num_cached_tokens)
                if o.events:
                    stats.preemptions += sum(1 for ev in o.events if ev.type == PREEMPTED)
                try:
                    if toks:
                        made += len(toks)
                        r.sink.extend(toks)
                    why = o.finish_reason
                    end = None if why is None else CoreEnd(str(why), o.kv_transfer_params, r.cached)
                except Exception as e:  # a fault here ends this request alone: the loop serves every request
                    log.exception("request %s: its output failed", o.request_id)
                    del reqs[o.request_id]
                    failed.append(o.request_id)
                    if not r.done.done():
                        r.done.set_exception(EngineError(f"the worker failed on this request's output: {e}"))
                    continue
                if end is not None:
                    del reqs[o.request_id]
                    if not r.done.done():
                        r.done.set_result(end)
            if failed:  # the core stops them
                await self._core.abort_requests_async(failed)
            if made:
                stats.on_tokens(made)
            s = outs.scheduler_stats
            if s is not None:
                stats.kv_cache_usage = float(s.kv_cache_usage)
                prefix = s.prefix_cache_stats
                if prefix is not None:
                    stats.prefix_queries += int(prefix.queries)
                    stats.prefix_hits += int(prefix.hits)

    def _fail(self, reason: str) -> None:
        self._failed = reason
        for r in self._reqs.values():
            if not r.done.done():
                r.done.set_exception(EngineError(reason))
        self._reqs.clear()
        self._ids.clear()
