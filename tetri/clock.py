"""The one clock abstraction: real time, or model time running `scale` times faster than the wall.

The sim engine reads time only through a `Clock`, so a run on an accelerated clock behaves as the model
says, and the discrete-event simulator can supply its own. The daemon stamps every status-table time on
a `ClusterClock`: model time when the cluster runs scaled, wall time otherwise (docs/cluster.md,
"Timestamps: one clock per cluster").
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds (model time) since an arbitrary origin."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of model time."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Wait until `now()` reaches `deadline` (at once if it has). A loop that chains its waits on
        deadlines rather than on durations does not accumulate the host's lateness into model time."""
        ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def sleep_until(self, deadline: float) -> None:
        await self.sleep(deadline - self.now())


class ScaledClock:
    """Model time = wall time × scale (scale 100: one wall second is 100 model seconds)."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError("time scale must be positive")
        self.scale = scale
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.scale)

    async def sleep_until(self, deadline: float) -> None:
        await self.sleep(deadline - self.now())


class ClusterClock:
    """Epoch-anchored model time: `now()` starts at `origin` (default: the wall time when the clock is
    made, as unix seconds) and advances `scale` times faster than the wall, on the monotonic clock. At
    scale 1 it reads (very nearly) `time.time()`; at any scale its values are unix-like and never go back.
    """

    def __init__(self, scale: float = 1.0, origin: float | None = None) -> None:
        if not scale > 0:
            raise ValueError("time scale must be positive")
        self.scale = scale
        self.origin = time.time() if origin is None else origin
        self._mono0 = time.monotonic()

    def now(self) -> float:
        return self.origin + (time.monotonic() - self._mono0) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.scale)

    async def sleep_until(self, deadline: float) -> None:
        await self.sleep(deadline - self.now())

    def model_seconds(self, wall_seconds: float) -> float:
        """How much of this clock's time passes in `wall_seconds` of wall time."""
        return wall_seconds * self.scale
