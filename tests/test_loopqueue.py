"""tetri.loopqueue.LoopQueue: the token path's queue (asyncio.Queue's contract for one consumer)."""

from __future__ import annotations

import asyncio

import pytest

from tetri.loopqueue import LoopQueue


def test_items_come_out_in_order_and_a_waiting_get_wakes():
    async def scenario() -> list[int]:
        q: LoopQueue[int] = LoopQueue()
        q.put_nowait(1)
        got = [await q.get()]
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing there: it waits
        q.put_nowait(2)
        q.put_nowait(3)
        got.append(await waiting)
        got.append(q.get_nowait())
        assert q.empty() and q.qsize() == 0
        return got

    assert asyncio.run(scenario()) == [1, 2, 3]


def test_a_cancelled_get_loses_nothing():
    async def scenario() -> int:
        q: LoopQueue[int] = LoopQueue()
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        q.put_nowait(7)  # after the cancelled get: still there for the next one
        return await asyncio.wait_for(q.get(), 1)

    assert asyncio.run(scenario()) == 7


def test_get_nowait_on_an_empty_queue_raises_queue_empty():
    with pytest.raises(asyncio.QueueEmpty):
        LoopQueue[int]().get_nowait()
