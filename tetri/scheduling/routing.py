"""Where a request goes: the global scheduler's choice of prefill (or colocated) instance, a pure
function of load snapshots. The prefill dispatcher's decode choice is `dispatch.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceLoad:
    instance_id: str
    queued: int = 0
    running: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    inflight: int = 0  # requests the router has sent and not yet seen finish (fresher than reports)

    @property
    def kv_utilisation(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


LoadKey = tuple[int, float, str]


def load_key(x: InstanceLoad) -> LoadKey:
    """TetriInfer §3.2's load: requests in flight from this router (fresh) plus the instance's reported
    queue; ties by KV utilisation, then id (deterministic). The lowest is the least loaded."""
    return (x.inflight + x.queued, x.kv_utilisation, x.instance_id)


def least_loaded(instances: Sequence[InstanceLoad]) -> str | None:
    """TetriInfer §3.2: the global scheduler sends a request to the least-loaded prefill instance
    (`load_key`). The daemon keeps the same choice as an index (`MinIndex` of `load_key`s)."""
    if not instances:
        return None
    return min(instances, key=load_key).instance_id
