"""Instance flip decisions (TetriInfer §3.5): the transition watcher's policy.

`idle` (the paper's example): flip an instance whose load stays below `low` (10%) for `window_s`
(one minute) while the instances of the other role are overloaded (average load above `high`). Never
flips the last active instance of a role, and at most one flip is in progress at a time. Load of an
instance is the larger of its KV usage and its queue pressure (queued / `queue_full`).

`advise`: every `window_s` the shell asks a split advisor (`tetri.des.flipadvisor`: the requests that
arrived in the last window replayed on the simulator at each P:D split of the active instances) which split
to run, and hands the answer to `observe`; the watcher then flips one instance at a time toward it, the
least loaded of the role in surplus first. `low`/`high` are not used.

Pure: `TransitionWatcher.observe(now, loads)` is fed snapshots and returns decisions; the daemon carries
them out (drain, notify, change role, announce) and records them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

FLIP_POLICIES = ("off", "idle", "advise")


@dataclass(frozen=True)
class InstanceView:
    instance_id: str
    role: str  # prefill | decode | colocated (the watcher's policies flip prefill ⇄ decode only)
    state: str  # active | draining | flipping | unhealthy | cordoned (the daemon's: no new work, not flipped)
    kv_usage: float  # 0..1
    queued: int = 0

    def load(self, queue_full: int) -> float:
        return max(self.kv_usage, min(1.0, self.queued / max(1, queue_full)))


@dataclass(frozen=True)
class FlipDecision:
    instance_id: str
    to_role: str
    reason: str


@dataclass(frozen=True)
class SplitAdvice:
    """The split the advisor wants: `prefill` of the active prefill and decode instances serve prefill."""

    prefill: int
    decode: int
    reason: str


@dataclass
class TransitionWatcher:
    policy: str = "off"
    low: float = 0.10
    high: float = 0.80
    window_s: float = 60.0
    queue_full: int = 16
    _low_since: dict[str, float] = field(default_factory=dict)
    _advice: SplitAdvice | None = None
    _advised_at: float | None = None

    def __post_init__(self) -> None:
        check_flip_policy(self.policy, self.low, self.high, self.window_s)

    def advice_due(self, now: float) -> bool:
        """`advise`: whether the shell should ask the advisor now (every `window_s`, first one window after
        the watcher's first look); the window it looks at is the last `window_s` up to `now`."""
        if self.policy != "advise":
            return False
        if self._advised_at is None:
            self._advised_at = now
        return now - self._advised_at >= self.window_s

    def observe(
        self, now: float, instances: Sequence[InstanceView], advice: SplitAdvice | None = None
    ) -> list[FlipDecision]:
        """Decisions for this look. `advice`, under `advise`, is the advisor's answer to a due request
        (kept until the next one; None when the shell did not ask or the advisor had nothing to go on)."""
        if self.policy == "off":
            self._low_since.clear()
            return []
        if self.policy == "advise" and self.advice_due(now):
            self._advice, self._advised_at = advice, now
        if any(i.state == "flipping" or i.state == "draining" for i in instances):
            return []  # one flip at a time
        active = [i for i in instances if i.state == "active" and i.role in ("prefill", "decode")]
        if self.policy == "advise":
            return self._toward(active)
        for i in active:
            if i.load(self.queue_full) < self.low:
                self._low_since.setdefault(i.instance_id, now)
            else:
                self._low_since.pop(i.instance_id, None)
        for i in sorted(active, key=lambda x: (self._low_since.get(x.instance_id, now), x.instance_id)):
            since = self._low_since.get(i.instance_id)
            if since is None or now - since < self.window_s:
                continue
            same = [x for x in active if x.role == i.role]
            other = [x for x in active if x.role != i.role]
            if len(same) < 2 or not other:
                continue  # never the last instance of a role
            pressure = sum(x.load(self.queue_full) for x in other) / len(other)
            if pressure > self.high:
                to = "decode" if i.role == "prefill" else "prefill"
                self._low_since.pop(i.instance_id, None)
                return [
                    FlipDecision(
                        i.instance_id,
                        to,
                        f"load < {self.low:.0%} for {now - since:.0f}s while {to} load is {pressure:.0%}",
                    )
                ]
        return []

    def _toward(self, active: Sequence[InstanceView]) -> list[FlipDecision]:
        a = self._advice
        prefill = sum(1 for i in active if i.role == "prefill")
        if a is None or a.prefill + a.decode != len(active) or a.prefill == prefill:
            return []  # nothing advised, advice for another instance count, or there already
        surplus = "decode" if a.prefill > prefill else "prefill"
        pool = [i for i in active if i.role == surplus]
        if len(pool) < 2:
            return []  # never the last instance of a role
        chosen = min(pool, key=lambda i: (i.load(self.queue_full), i.instance_id))
        to = "prefill" if surplus == "decode" else "decode"
        return [FlipDecision(chosen.instance_id, to, f"advise: {a.prefill}P:{a.decode}D — {a.reason}")]


@dataclass(frozen=True)
class FlipRefusal:
    reason: str  # one line
    param: str | None = None  # "to" when the requested role is what is wrong


ROLES = ("colocated", "prefill", "decode")


def flip_refusal(
    instance_id: str,
    role: str,
    state: str,
    to_role: str,
    active: Mapping[str, int] | None,
    draining_prefill: int = 0,
) -> FlipRefusal | None:
    """Why an instance may not flip to `to_role` now (None: it may). The one rule the daemon's flip API,
    the worker's Flip RPC and the simulator all apply: between the three roles (colocated, prefill,
    decode), to another role, from the active state, and never leaving its model unserved while it
    drains (`leaves_unserved`). `active` counts the model's active instances by role, this one included
    (None where the caller cannot know — a worker — and the daemon has checked); `draining_prefill`: its
    prefill instances still draining."""
    if role not in ROLES:
        return FlipRefusal(f"instance {instance_id} is {role}: only colocated, prefill and decode instances flip")
    if to_role not in ROLES:
        return FlipRefusal(f"to: must be colocated, prefill or decode, got {to_role!r}", "to")
    if to_role == role:
        return FlipRefusal(f"instance {instance_id} already is a {to_role} instance")
    if state in ("draining", "flipping"):
        return FlipRefusal(f"instance {instance_id} is already flipping")
    if state != "active":
        return FlipRefusal(f"instance {instance_id} is {state}")
    if active is None:
        return None
    unserved = leaves_unserved(instance_id, role, active, draining_prefill)
    return None if unserved is None else FlipRefusal(unserved)


def leaves_unserved(instance_id: str, role: str, active: Mapping[str, int], draining_prefill: int = 0) -> str | None:
    """Why taking this instance out of routing would leave its model without a path (None: it would
    not). The one rule a flip (`flip_refusal`) and a cordon (the daemon's `POST
    /api/v1/instances/{id}/cordon`) apply. `active` counts the model's instances that take new work, by
    role, this one included: without this one there must still be a colocated instance or a prefill and a
    decode instance, and the last decode instance stays while a prefill instance does, active or still
    draining (`draining_prefill`: its held KV goes to one)."""
    rest = {r: active.get(r, 0) - (r == role) for r in ROLES}
    if not rest["colocated"] and not (rest["prefill"] and rest["decode"]):
        return f"instance {instance_id} is the last active {role} instance (nothing else could serve)"
    if role == "decode" and not rest["decode"] and (rest["prefill"] or draining_prefill):
        return f"instance {instance_id} is the last active decode instance (prefill instances hand over to it)"
    return None


def check_flip_policy(policy: str, low: float, high: float, window_s: float) -> None:
    if policy not in FLIP_POLICIES:
        raise ValueError(f"unknown flip policy {policy!r} (choose from {', '.join(FLIP_POLICIES)})")
    if not 0 <= low < high <= 1:
        raise ValueError("flip thresholds need 0 ≤ low < high ≤ 1")
    if not window_s > 0:  # also refuses NaN
        raise ValueError("flip window must be positive")


def flip_path(current: Mapping[str, int], target: Mapping[str, int]) -> list[tuple[str, str]] | None:
    """The fewest flips, as (from role, to role) one at a time, that take a model's active instances from
    `current` to `target` (counts by role), each allowed by `flip_refusal` when it starts; [] when already
    there, None when no such sequence exists (the totals differ, or every way passes through a cluster
    that could not serve). A breadth-first search over the counts: a few dozen states for a few GPUs."""
    start = tuple(current.get(r, 0) for r in ROLES)
    goal = tuple(target.get(r, 0) for r in ROLES)
    if sum(start) != sum(goal):
        return None
    came: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[str, str]] | None] = {start: None}
    frontier = [start]
    while frontier and goal not in came:
        nxt = []
        for state in frontier:
            counts = dict(zip(ROLES, state, strict=True))
            for i, a in enumerate(ROLES):
                for j, b in enumerate(ROLES):
                    if not state[i] or flip_refusal("", a, "active", b, counts) is not None:
                        continue
                    moved = list(state)
                    moved[i] -= 1
                    moved[j] += 1
                    key = tuple(moved)
                    if key not in came:
                        came[key] = (state, (a, b))
                        nxt.append(key)
        frontier = nxt
    if goal not in came:
        return None
    path: list[tuple[str, str]] = []
    at = goal
    while (step := came[at]) is not None:
        at, move = step
        path.append(move)
    return path[::-1]
