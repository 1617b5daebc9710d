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


# --- the per-request P/D choice ------------------------------------------------------------------------
# A cluster may hold colocated, prefill and decode instances at once: each request runs either colocated
# (one instance, both phases) or split (a prefill instance, then a decode instance its KV is handed to).
PD_ROUTES = ("role", "split", "length")


def backlog(x: InstanceLoad) -> int:
    """Requests at the instance that have not started: the fresher of its reported queue and the router's
    count less what it reported running. A prefill instance reports as queued the prompts admitted to its
    prefill queue with no chunk run (`Usage.waiting`). The daemon's count of a prefill instance ends at the
    hand-over, after a decode instance pulled the KV, so there it also holds the prompts done and waiting
    to be pulled (a congested split path); the simulator's ends at the prefill (it sees loads exactly)."""
    return max(x.queued, x.inflight - x.running)


def choose_path(
    route: str,
    prompt_len: int,
    predicted: tuple[int, int] | None,
    colocated: InstanceLoad | None,
    split: InstanceLoad | None,
    prompt_tokens: int,
    output_tokens: int,
    slack: int = 0,
) -> str | None:
    """Whether a request runs colocated or split, given the least-loaded entry of each path (None: the path
    has no instance that can take it now: no active colocated instance, or no active prefill instance
    with an active decode instance to hand over to). None: neither path can.

    `role` (the default): colocated whenever the cluster has a colocated instance — a cluster of one kind
    runs as it always did. `split`: split whenever it can. `length` (TaiChi, llm-d: split the requests whose
    prefill would stall a colocated batch's decodes): split when the prompt has at least `prompt_tokens`
    tokens, or the predicted output at least `output_tokens` (0: not considered; the upper end of the
    predicted range) — long decodes keep a steady TPOT on a decode instance; colocated otherwise. Then the
    load, when `slack` is set (0: the length alone decides): when the preferred path's entry has more than
    `slack` more requests waiting (`backlog`) than the other's, the other."""
    if colocated is None or split is None:
        return "colocated" if colocated is not None else "split" if split is not None else None
    if route == "role":
        return "colocated"
    if route == "split":
        return "split"
    long_output = output_tokens > 0 and predicted is not None and predicted[1] >= output_tokens
    want, other = ("split", colocated) if prompt_len >= prompt_tokens or long_output else ("colocated", split)
    mine = split if want == "split" else colocated
    if slack and backlog(mine) > backlog(other) + slack:
        return "colocated" if want == "split" else "split"
    return want
