"""Fronts and their controller (docs/cluster.md, "Fronts and a controller").

A **front** serves the OpenAI and admin APIs: it routes on its copy of the controller's registry, relays
tokens and writes its requests' status rows (each stamped with the front's incarnation id). The
**controller** keeps the registry (workers register and report there), the policies and the flips, and
streams its view to every front (`ControlPlane.Watch`).

Here is the controller's end of that stream, `FrontWatch`: its record of which fronts are connected,
which ends the running rows of a front whose stream ended and did not come back within a grace, and at a
controller's start, those of any front that does not reconnect. The front's end is
`daemon.front.link.FrontLink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tetri.clock import ClusterClock

from ..db.store import Store
from ..db.writer import store_unavailable

log = logging.getLogger(__name__)

STORE_RETRY_S = 2.0  # the status table unavailable: a front's rows are ended when it is back, tried this often
FRONT_GRACE_S = 5.0  # a front whose view stream ended is gone unless it is back within this (a controller's restart)


class FrontWatch:
    """The controller's record of its fronts (by incarnation id, from their view streams). A front whose
    stream ended and is not back within `grace_s` died: its running rows become `interrupted`."""

    def __init__(self, store: Store, clock: ClusterClock, grace_s: float = FRONT_GRACE_S) -> None:
        self.store = store
        self.clock = clock
        self.grace_s = grace_s
        self.streams: dict[str, int] = {}  # connected fronts: how many view streams each has open
        self._lost: dict[str, asyncio.Task[None]] = {}

    def changed(self, front: str, up: bool) -> None:
        """A front's view stream began (`up`) or ended."""
        if up:
            self.streams[front] = self.streams.get(front, 0) + 1
            task = self._lost.pop(front, None)
            if task is not None:
                task.cancel()
            return
        left = self.streams.get(front, 0) - 1
        if left > 0:
            self.streams[front] = left
            return
        self.streams.pop(front, None)
        if front and front not in self._lost:
            self._lost[front] = asyncio.get_running_loop().create_task(self._gone(front))

    async def _gone(self, front: str) -> None:
        try:
            await asyncio.sleep(self.grace_s)
            if front in self.streams:
                return
            now = self.clock.now()
            n = await _until_written(lambda: self.store.interrupt_front(front, now))
            log.warning("front %s is gone: %d of its request(s) marked interrupted", front, n)
        finally:
            self._lost.pop(front, None)

    async def sweep(self) -> None:
        """At a controller's start: after the grace (its fronts reconnect meanwhile), the running rows of
        every front not connected become `interrupted`."""
        await asyncio.sleep(self.grace_s)
        seen = [*self.streams, *self._lost]  # a front in its grace is left to its own timer
        now = self.clock.now()
        n = await _until_written(lambda: self.store.interrupt_orphans(seen, now))
        if n:
            log.warning("%d request(s) of fronts that did not reconnect marked interrupted", n)

    async def close(self) -> None:
        for task in list(self._lost.values()):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._lost.values(), return_exceptions=True)


async def _until_written(write: Callable[[], int]) -> int:
    """`write()` in a thread, tried again every `STORE_RETRY_S` while the status table is unavailable (its
    writer logs the outage), so a front's rows still end when it is back."""
    while True:
        try:
            return await asyncio.to_thread(write)
        except Exception as e:
            if not store_unavailable(e):
                raise
        await asyncio.sleep(STORE_RETRY_S)
