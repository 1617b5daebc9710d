"""A queue for the token path: `asyncio.Queue` without its per-call look-up of the running loop.

On Python 3.11 every `asyncio.get_running_loop()` — which `asyncio.Queue.get` makes on each call, as do
`asyncio.create_task` and `Event.wait` — makes a `getpid` system call (a fork check, dropped in 3.12). When
a worker still awaited a queue per token and per request, 8–11% of its CPU went to `getpid` in
`bench/control_plane_cost.py` (py-spy --native, docs/vllm.md); now each Serve stream's writer awaits its one
queue (`workers.service`), once per engine step. `LoopQueue` finds its loop once, when a consumer first
waits.

Unbounded, one consumer at a time (every queue on the token path has one), the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> T:
        """The first item; `asyncio.QueueEmpty` when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        while not self._items:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
