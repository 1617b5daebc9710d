"""The event loop the daemon and the workers run on: uvloop where it is installed (vLLM's own OpenAI
server runs on it, as uvicorn does by default), asyncio's own loop otherwise or when asked.

    TETRI_EVENT_LOOP=uvloop   (default; falls back to asyncio when uvloop is not installed)
    TETRI_EVENT_LOOP=asyncio  (the standard library's loop: for debugging, or to compare)

On uvloop the control plane's CPU per request and per token is lower (`bench/control_plane_cost.py
--event-loops asyncio,uvloop` measures the two side by side; docs/vllm.md). gRPC's asyncio stack and
vLLM's `AsyncLLM` run on either loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from .config import ConfigError

ENV = "TETRI_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")

T = TypeVar("T")


class EventLoopError(ConfigError):
    """TETRI_EVENT_LOOP names no loop this process can run."""


def chosen() -> str:
    """The loop this process will run: `TETRI_EVENT_LOOP`, or uvloop when installed."""
    name = os.environ.get(ENV, "").strip().lower() or "uvloop"
    if name not in CHOICES:
        raise EventLoopError(f"{ENV}={name!r}: expected one of {', '.join(CHOICES)}")
    if name == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return name


def run(main: Coroutine[Any, Any, T], loop: str | None = None) -> T:
    """`asyncio.run(main)` on the chosen loop (`loop`, else `chosen()`)."""
    name = loop or chosen()
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running() -> str:
    """The loop running this coroutine's thread: "uvloop" or "asyncio" (the processes' ready lines say it)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
