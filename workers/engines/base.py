"""The engine interface every worker drives: prefill, KV hand-over, decode, colocated generation.

Contract (both the sim engine and the vLLM engine keep it):

* Tokens are ints. ``prefill`` returns the first output token (index 0) and a `KVHandle` for the
  prompt's KV, which the engine keeps until ``release_kv`` (after the hand-over) or ``abort``.
* A decode engine ``load_kv`` s a handle: it returns once the decode instance has taken the KV (the sim
  engine: when its admission pulls it; the transfer then runs inside the engine), after which the
  prefill side releases it; then ``decode`` yields the tokens at indices 1 … max_tokens − 1 as they are
  produced. ``generate`` (colocated) yields indices
  0 … max_tokens − 1. Iterators end after the last token; ``abort`` ends them early.
* The worker takes them as ``generate_to`` and ``decode_to``: the same tokens, each engine step's handed to a
  `TokenSink` where the engine has them (no task switch, no object per token), returning at the end. By
  default these read the iterators; an engine whose one loop sees every request's step (vLLM's, `core`)
  gives them their own, and its iterators read them.
* ``usage()`` never blocks: capacity and usage in KV tokens, queue and running counts, recent tokens/s, and
  the prefix cache's counters (prompt tokens looked up, found).
* The prefix cache (an engine's own: vLLM's automatic prefix caching, the sim engine's block cache) is
  told as Tetri's block keys (`tetri.scheduling.prefix`, at ``block_size``): ``cache_keys`` all of it,
  ``cache_delta`` what it stored and removed since the last call; the worker forwards them to the
  control plane's index. ``cached_tokens`` says, once, how much of a request's prompt its prefill found
  cached.
* Engines are async and run their own batching loop; ``start``/``stop`` own that task.
* Errors a caller can act on raise `EngineError` with a one-line message.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tetri.loopqueue import LoopQueue
from tetri.sampling import GREEDY, Sampling


class TokenSink(Protocol):
    """Where a request's tokens go, a step's at a time (a list is one)."""

    def extend(self, tokens: list[int], /) -> None: ...


class EngineError(RuntimeError):
    """A request the engine cannot serve (too long, aborted, KV lost)."""


class Rejected(EngineError):
    """The engine turned a request away before its first token (`ttft_miss` reject: it waited past its
    TTFT target); nothing was produced, so the client may retry (the daemon answers 429)."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    # the length predictor's output range [lo, hi] (None: no prediction); decode admission uses lo
    predicted_output: tuple[int, int] | None = None
    # a migrated request: the last `resumed_tokens` prompt tokens are outputs already streamed, so the
    # engine's first output token is output index `resumed_tokens` of the original request
    resumed_tokens: int = 0
    sampling: Sampling = GREEDY

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class KVHandle:
    request_id: str
    num_tokens: int
    num_bytes: int
    source_instance_id: str
    params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillOutput:
    first_token: int
    kv: KVHandle


@dataclass(frozen=True)
class EngineUsage:
    kv_capacity_tokens: int
    kv_used_tokens: int
    running: int
    waiting: int
    tokens_per_s: float
    preemptions: int = 0
    held_tokens: int = 0  # prefill: KV of prefilled prompts no decode instance has pulled yet
    heavy: int = 0  # decode: requests here predicted heavy (dispatch's split), and light
    light: int = 0
    predicted_growth_tokens: int = 0  # decode: Σ predicted tokens still to produce
    prefix_query_tokens: int = 0  # counters over the engine's life (new requests, as vLLM counts them):
    prefix_hit_tokens: int = 0  # prompt tokens looked up in its prefix cache, and found there


class Engine(ABC):
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids the model knows: 0 … vocab_size − 1 (0 until started, for vLLM)
    # where the daemon loads this model's tokenizer: a local directory, "builtin:bytes" (the sim's byte
    # tokenizer) or "" (none: token-id prompts only); set by the worker (workers.main)
    tokenizer: str = ""
    instance_id: str
    block_size: int = 0  # its KV block size: the prefix cache's blocks (0: unknown until started)

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start the batching loop."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop the loop; pending iterators end with EngineError."""

    @abstractmethod
    async def prefill(self, req: EngineRequest) -> PrefillOutput: ...

    @abstractmethod
    async def load_kv(self, req: EngineRequest, kv: KVHandle) -> None:
        """Decode: take over a prefilled request's KV. Returns once this instance has taken the KV (its
        admission pulled it, or the connector has it): from then on the source may free it."""

    @abstractmethod
    def decode(self, req: EngineRequest, first_token: int) -> AsyncIterator[int]: ...

    @abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[int]: ...

    async def generate_to(self, req: EngineRequest, sink: TokenSink) -> None:
        """`generate`, each step's tokens handed to `sink`; returns after the last."""
        async for tok in self.generate(req):
            sink.extend([tok])

    async def decode_to(self, req: EngineRequest, first_token: int, sink: TokenSink) -> None:
        """`decode`, each step's tokens handed to `sink`; returns after the last."""
        async for tok in self.decode(req, first_token):
            sink.extend([tok])

    @abstractmethod
    async def release_kv(self, request_id: str) -> None: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def usage(self) -> EngineUsage: ...

    def cache_keys(self) -> list[int]:
        """Every block key its prefix cache holds now."""
        return []

    def cache_delta(self) -> tuple[list[int], list[int]]:
        """The keys its prefix cache stored and removed since the last call (the net change: disjoint)."""
        return [], []

    def cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens of the request its prefill found in the prefix cache (None: not known); asked once,
        when the request's call here ends."""
        return None


async def tokens_of(run: Callable[[TokenSink], Awaitable[None]]) -> AsyncGenerator[int, None]:
    """The tokens `run` hands its sink, as an iterator (for an engine whose `generate_to` is its own)."""
    got: LoopQueue[list[int] | BaseException | None] = LoopQueue()

    class _Sink:
        def extend(self, tokens: list[int], /) -> None:
            got.put_nowait(list(tokens))

    async def drive() -> None:
        try:
            await run(_Sink())
            got.put_nowait(None)
        except BaseException as e:  # raised again where the iterator is read
            got.put_nowait(e)

    task = asyncio.ensure_future(drive())
    try:
        while (item := await got.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            for tok in item:
                yield tok
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
