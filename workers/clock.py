"""The one clock abstraction: real time, or model time running `scale` times faster than the wall.

The sim engine and the daemon's timestamps read time only through a `Clock`, so a run on an
accelerated clock reports model-time TTFT/JCT, and the discrete-event simulator can supply its own.
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


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


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
