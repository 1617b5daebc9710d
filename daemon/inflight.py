"""A request in flight, as the front serving it knows it: what its admin reads show until its row is
updated at its end (`daemon.api.reads`), and what the front's relay (`daemon.front.run`) fills in."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tetri.sampling import GREEDY, Sampling

from .cluster import Instance
from .db.models import Phase


def new_request_id(prefix: str = "cmpl-") -> str:
    return prefix + os.urandom(12).hex()  # 24 random hex digits (uuid4's formatting costs 5× as much)


@dataclass
class Inflight:
    """What the daemon knows of a request in flight. Its row is written twice: inserted as it starts, updated
    with all of this as it ends (`daemon.front.gateway.Gateway`); meanwhile reads of it come from here."""

    id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    phase: Phase = Phase.QUEUED
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_start_ts: float | None = None
    first_token_ts: float | None = None
    decode_start_ts: float | None = None
    kv_loaded_tokens: int | None = None  # prompt tokens the decode instance took with the hand-over
    cached_tokens: int | None = None  # prompt tokens its prefill found in the entry instance's prefix cache
    produced: int = 0
    cancelled: bool = False
    predicted: tuple[int, int] | None = None
    serving: tuple[str, str] | None = None  # (instance id, address) currently producing tokens
    counted: Instance | None = None  # the registry entry whose `inflight` counts this request
    timeline: list[tuple[str, float]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)  # tokens streamed so far (a migration re-prefills them)
    migrations: int = 0
    migrated_from: list[str] = field(default_factory=list)
    interrupted: str | None = None  # why the daemon ended it (shutdown): the row says `interrupted`
    prompt_head: list[int] | None = None  # the predictor's features, kept in memory
    sampling: Sampling = GREEDY

    def enter(self, phase: Phase, now: float) -> None:
        """The request enters `phase` at `now` (the cluster clock): its timeline says so."""
        self.phase = phase
        self.timeline.append((phase.value, now))

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ts is None else (self.first_token_ts - self.arrival) * 1000


class Serving(Protocol):
    """What the admin API reads and asks of the process serving requests (a front's gateway; none in a
    controller alone): its requests in flight, and their cancellation."""

    front: str | None  # the incarnation id its rows carry (None: a one-process daemon)
    draining: bool

    @property
    def inflight(self) -> Mapping[str, Inflight]: ...

    def record_rejected(self, rid: str, message: str) -> None: ...

    async def cancel(self, rid: str) -> bool: ...

    async def cancel_many(self, prefix: str = "") -> list[str]: ...
