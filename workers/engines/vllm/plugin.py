"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in its engine-core and
model-worker processes) for the engines a Tetri worker starts (`ENGINE` set; inert anywhere else): the
AMX permission vLLM's CPU attention needs, how an idle vLLM process waits for its next message, and the
sampler state a seeded request continued on another engine takes along (`seeded`).

AMX. vLLM's CPU attention kernel for bfloat16 runs AMX tile instructions, which Linux allows a process
only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); vLLM never asks, oneDNN does when it first runs an
AMX matrix multiply — a prefill's, many tokens at once. A decode engine that loads whole prompts computes
one token per request per step, so its first attention ran before anything had asked, and its model
worker died of SIGILL (exit -4). `register` asks at start on a CPU that has AMX.

vLLM's engine core and its model worker talk through a shared-memory queue whose reader spins
(`sched_yield`) for one second after each message before it parks on a socket (`SpinCondition`, 1 s,
not configurable). A busy engine never notices; an engine that ran one step and went idle keeps a
process spinning for a second. On a host where a prefill and a decode engine share cores, every prefill
then steals CPU from the decode engine for a second: at a few requests a second the prefill engine spins
all the time, and the decode side ran at ≈ 7–10 ms a token instead of ≈ 4 (docs/vllm.md).

So a reader here spins as vLLM's for `TETRI_VLLM_IDLE_SPIN_S` seconds after its last message, then parks
on the writer's notification socket, as vLLM's does after its second, but rechecking the queue every
`RECHECK_MS`: vLLM's notifications can be lost (its writer drops one sent before the reader acknowledged
the previous; vLLM's own recheck is 5 s), and a lost one costs a parked reader at most that long. An
idle process then wakes a few hundred times a second instead of spinning (an earlier version napped
0.2 ms between checks: 15–20% of a core per idle engine). A Tetri vLLM worker sets the variable (its
`idle_spin_s`) before it starts its engine; the engine's processes inherit it. Without the variable
(vLLM's own server, other users of vLLM) nothing changes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import seeded

ENGINE = "TETRI_VLLM_ENGINE"  # set by a Tetri vLLM worker for its engine's processes
ENV = "TETRI_VLLM_IDLE_SPIN_S"
RECHECK_MS = 2


def register() -> None:
    if os.environ.get(ENGINE) != "1":
        return
    _allow_amx()
    seeded.install()
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
        if time.monotonic() - self.last_read <= hot:
            return original(self, timeout_ms)  # within the hot spin: vLLM's sched_yield
        recheck = RECHECK_MS if timeout_ms is None else max(0, min(timeout_ms, RECHECK_MS))
        events = dict(self.poller.poll(timeout=recheck))
        if self.local_notify_socket in events:  # consume the (conflated) notification, as vLLM does
            self.local_notify_socket.recv(flags=shm_broadcast.zmq.NOBLOCK, copy=False)
        return None  # the caller rechecks the queue (and its cancel flag)

    wait._tetri_spin = hot  # type: ignore[attr-defined]
    cls.wait = wait


def _allow_amx() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
