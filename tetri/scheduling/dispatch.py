"""Inter-decode dispatch (TetriInfer §3.3.4): which decode instance receives a prefilled request.

`power_of_two`: sample two decode instances; a *heavy* request (predicted output above the threshold,
128 tokens by default — ShareGPT's median answer) goes to the one running fewer heavy decodes, a light
one to the one with less predicted KV load (current KV plus predicted remaining growth). Without a
prediction every request is treated as light. `least_kv` is the plain baseline.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

from .minindex import MinIndex

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


def least_kv_key(d: DecodeLoad) -> tuple[float, str]:
    """KV in use plus what was sent since the report, as a share of the capacity; ties by id."""
    return ((d.kv_used_tokens + d.sent) / max(1, d.kv_capacity_tokens), d.instance_id)


def least_kv(loads: Sequence[DecodeLoad]) -> str | None:
    if not loads:
        return None
    return min(loads, key=least_kv_key).instance_id


def power_of_two(
    loads: Sequence[DecodeLoad], predicted_lo: int | None, rng: random.Random, heavy_threshold: int = 128
) -> str | None:
    if not loads:
        return None
    if len(loads) == 1:
        return loads[0].instance_id
    a, b = rng.sample(loads, 2)  # in place: two members read, whatever the sequence's length
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


class _InOrder(Sequence[DecodeLoad]):
    """A `DispatchView`'s current loads in broadcast order, read in place (no copy per choice)."""

    def __init__(self, view: DispatchView) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view.order)

    @overload
    def __getitem__(self, k: int) -> DecodeLoad: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[DecodeLoad]: ...
    def __getitem__(self, k: int | slice) -> DecodeLoad | Sequence[DecodeLoad]:
        if isinstance(k, slice):
            return [self.view.loads[i] for i in self.view.order[k]]
        return self.view.loads[self.view.order[k]]


class DispatchView:
    """What a prefill instance dispatches on: the decode loads of the daemon's last broadcast, plus what it
    sent to each since (`sent`). A choice reads an index, not every instance: least-kv the `MinIndex` of
    `least_kv_key`s, power-of-two two members sampled in place. Each is the choice `dispatch` makes over
    the whole list with the same random stream (tests/scheduling/test_dispatch.py); the choice is counted
    as sent."""

    def __init__(self, loads: Iterable[DecodeLoad] = ()) -> None:
        self.loads: dict[str, DecodeLoad] = {d.instance_id: d for d in loads}
        self.order = list(self.loads)
        self._by_kv = MinIndex(least_kv_key(d) for d in self.loads.values())
        self._in_order = _InOrder(self)

    def __len__(self) -> int:
        return len(self.order)

    def choose(
        self,
        policy: str,
        predicted_lo: int | None,
        rng: random.Random,
        exclude: frozenset[str] = frozenset(),
        heavy_threshold: int = 128,
    ) -> str | None:
        if policy == "least-kv":
            pick = self._by_kv.best(exclude)
        else:  # excluding some is rare (a retry after a refused hand-over): then the list without them
            loads = [self.loads[i] for i in self.order if i not in exclude] if exclude else self._in_order
            pick = dispatch(policy, loads, predicted_lo, rng, heavy_threshold)
        if pick is not None:
            d = self.loads[pick] = dataclasses.replace(self.loads[pick], sent=self.loads[pick].sent + 1)
            self._by_kv.set(least_kv_key(d))
        return pick
