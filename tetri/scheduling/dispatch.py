"""Inter-decode dispatch (TetriInfer §3.3.4): which decode instance receives a prefilled request.

`power_of_two`: sample two decode instances; a *heavy* request (predicted output above the threshold,
128 tokens by default — ShareGPT's median answer) goes to the one running fewer heavy decodes, a light
one to the one with less predicted KV load (current KV plus predicted remaining growth). Without a
prediction every request is treated as light. `least_kv` is the plain baseline.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

DISPATCH_POLICIES = ("pot", "least-kv")


@dataclass(frozen=True)
class DecodeLoad:
    instance_id: str
    kv_used_tokens: int
    kv_capacity_tokens: int
    heavy: int = 0  # running/queued requests predicted heavy
    light: int = 0
    predicted_growth_tokens: int = 0  # Σ predicted remaining output of its requests
    sent: int = 0  # dispatched here since the last load report

    @property
    def predicted_load(self) -> float:
        return (self.kv_used_tokens + self.predicted_growth_tokens) / max(1, self.kv_capacity_tokens)


def least_kv(loads: Sequence[DecodeLoad]) -> str | None:
    if not loads:
        return None
    return min(
        loads, key=lambda d: ((d.kv_used_tokens + d.sent) / max(1, d.kv_capacity_tokens), d.instance_id)
    ).instance_id


def power_of_two(
    loads: Sequence[DecodeLoad], predicted_lo: int | None, rng: random.Random, heavy_threshold: int = 128
) -> str | None:
    if not loads:
        return None
    if len(loads) == 1:
        return loads[0].instance_id
    a, b = rng.sample(list(loads), 2)
    if predicted_lo is not None and predicted_lo > heavy_threshold:
        key = lambda d: (d.heavy + d.sent, d.predicted_load, d.instance_id)  # noqa: E731
    else:
        key = lambda d: (d.predicted_load, d.heavy + d.light + d.sent, d.instance_id)  # noqa: E731
    return min((a, b), key=key).instance_id


def dispatch(
    policy: str, loads: Sequence[DecodeLoad], predicted_lo: int | None, rng: random.Random, heavy_threshold: int = 128
) -> str | None:
    if policy == "pot":
        return power_of_two(loads, predicted_lo, rng, heavy_threshold)
    if policy == "least-kv":
        return least_kv(loads)
    raise ValueError(f"unknown dispatch policy {policy!r} (choose from {', '.join(DISPATCH_POLICIES)})")
