"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in its engine-core and
model-worker processes): how an idle vLLM process waits for its next message.

vLLM's engine core and its model worker talk through a shared-memory queue whose reader spins
(`sched_yield`) for one second after each message before it parks on a socket (`SpinCondition`, 1 s,
not configurable). A busy engine never notices; an engine that ran one step and went idle keeps two
processes spinning for a second. On a host where a prefill and a decode engine share cores, every
prefill then steals CPU from the decode engine for a second: at a few requests a second the prefill
engine spins all the time, and the decode side ran at ≈ 7–10 ms a token instead of ≈ 4 (docs/vllm.md).

Parking sooner is not the answer: vLLM's wake-up message can be lost (its own comment bounds the
recovery at 5 s), and a reader parked after every step stalled for seconds. So a reader here spins as
vLLM's for `TETRI_VLLM_IDLE_SPIN_S` seconds after its last message, then polls the queue's flag between
short sleeps (`NAP_S`: a message waits at most that long, and the process uses a few percent of a core)
until vLLM's one second is over, and then parks as vLLM does. A Tetri vLLM worker sets the variable (its
`idle_spin_s`) before it starts its engine; the engine's processes inherit it. Without the variable
(vLLM's own server, other users of vLLM) nothing changes.
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV = "TETRI_VLLM_IDLE_SPIN_S"
NAP_S = 0.0002


def register() -> None:
    try:
        hot = float(os.environ[ENV])
    except (KeyError, ValueError):
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls: Any = shm_broadcast.SpinCondition
    if getattr(cls.wait, "_tetri_spin", None) is not None:  # vLLM may load plugins more than once
        return
    original = cls.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        idle = time.monotonic() - self.last_read
        if hot < idle <= self.busy_loop_s:  # past the hot spin, within vLLM's busy second: nap, then recheck
            time.sleep(NAP_S)
            return None
        return original(self, timeout_ms)

    wait._tetri_spin = hot  # type: ignore[attr-defined]
    cls.wait = wait
