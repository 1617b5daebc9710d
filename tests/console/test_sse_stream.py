"""`tetrictl.client.SseStream`, the one reader of streamed OpenAI answers (the benches and tests use it)."""

from __future__ import annotations

import asyncio

import httpx

from tetrictl.client import SseStream

BODY = b': comment\n\ndata: {"id": "a", "n": 1}\n\ndata: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n'


def test_it_yields_each_event_and_knows_the_stream_ended():
    stream = SseStream(httpx.Response(200, content=BODY))
    assert list(stream) == [{"id": "a", "n": 1}, {"error": {"message": "x"}}]
    assert stream.done


def test_a_cut_stream_is_not_done_and_async_reads_the_same():
    cut = SseStream(httpx.Response(200, content=BODY.split(b"data: [DONE]")[0]))
    assert len(list(cut)) == 2 and not cut.done

    async def read() -> tuple[list[dict], bool]:
        s = SseStream(httpx.Response(200, content=BODY))
        return [doc async for doc in s], s.done

    docs, done = asyncio.run(read())
    assert docs == [{"id": "a", "n": 1}, {"error": {"message": "x"}}] and done
