"""`tokens_of`: an engine's sink-fed run read as an iterator (the vLLM engine's `generate` and `decode`)."""

from __future__ import annotations

import asyncio

import pytest

from workers.engines.base import EngineError, TokenSink, tokens_of


def test_the_iterator_yields_each_steps_tokens_in_order_then_ends() -> None:
    async def run(sink: TokenSink) -> None:
        for step in ([1, 2], [3], [], [4, 5, 6]):
            sink.extend(step)
            await asyncio.sleep(0)

    async def main() -> list[int]:
        return [t async for t in tokens_of(run)]

    assert asyncio.run(main()) == [1, 2, 3, 4, 5, 6]


def test_the_runs_error_is_raised_after_the_tokens_before_it() -> None:
    async def run(sink: TokenSink) -> None:
        sink.extend([7])
        raise EngineError("aborted")

    async def main() -> list[int]:
        got: list[int] = []
        with pytest.raises(EngineError, match="aborted"):
            async for t in tokens_of(run):
                got.append(t)
        return got

    assert asyncio.run(main()) == [7]


def test_closing_the_iterator_early_cancels_the_run() -> None:
    cancelled = asyncio.Event()

    async def run(sink: TokenSink) -> None:
        try:
            sink.extend([1])
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> None:
        it = tokens_of(run)
        assert await it.__anext__() == 1
        await it.aclose()
        assert cancelled.is_set()

    asyncio.run(main())
