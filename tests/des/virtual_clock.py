"""A virtual clock for driving live asyncio code (the sim engine) in model time, deterministically.

`sleep` parks the caller until the clock reaches its deadline; `run` drives a coroutine: it lets every
ready task run until the event loop has nothing left to do at this instant ("settled"), then moves to the
earliest deadline and wakes every sleeper due then, in the order they went to sleep. A sleep(0) made
while an instant is being handled wakes in a next round of the same instant — the ordering the
discrete-event simulator reproduces (events of an instant first, then plans).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClock:
    def __init__(self) -> None:
        self._now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._now + max(0.0, seconds))

    async def sleep_until(self, deadline: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (max(deadline, self._now), next(self._seq), fut))
        await fut

    async def _settle(self) -> None:
        """Yield until no other callback is ready (every task has run as far as it can at this instant)."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # the loop's queue of ready callbacks (BaseEventLoop)
        for _ in range(100_000):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                return
        if ready is not None:
            raise RuntimeError("the event loop never settled")

    async def run(self, main: Coroutine[Any, Any, T]) -> T:
        task = asyncio.get_running_loop().create_task(main)
        while True:
            await self._settle()
            if task.done():
                return task.result()
            live = [s for s in self._sleepers if not s[2].done()]
            if not live:
                raise RuntimeError("deadlock: nothing is sleeping and the main task has not finished")
            heapq.heapify(live)
            self._sleepers = live
            t = live[0][0]
            self._now = t
            while self._sleepers and self._sleepers[0][0] == t:
                _, _, fut = heapq.heappop(self._sleepers)
                if not fut.done():
                    fut.set_result(None)
