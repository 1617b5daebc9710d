"""Where a request goes: the global scheduler's choice of prefill (or colocated) instance, a pure
function of load snapshots. The prefill dispatcher's decode choice is `dispatch.py`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the CLI imports this module, and the index brings numpy
    from .cacheindex import CacheIndex
    from .minindex import MinIndex


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


# --- the entry instance: by load, by the prefix cache, or in turn -------------------------------------
# `routing` (a policy): where among the instances of the entry role a request starts.
#   cache-aware  the instance holding most of the prompt's leading blocks in its prefix cache, within the
#                saturation guard (`cache_aware`); none in reach: the least loaded
#   least-load   the least loaded (TetriInfer §3.2), blind to the cache
#   round-robin  each in turn (a plain load balancer in front of N servers), blind to load and cache
ROUTINGS = ("cache-aware", "least-load", "round-robin")


def backlog_of(x: InstanceLoad) -> int:
    """The router's backlog at an instance: requests it routed there and not finished, plus its reported
    queue (`load_key`'s first term)."""
    return x.inflight + x.queued


def cache_aware(least: InstanceLoad, hits: Sequence[tuple[InstanceLoad, int]], slack: int) -> InstanceLoad:
    """The cache-aware choice: of the instances holding some of the prompt's leading blocks (`hits`:
    each with the tokens it holds), the one holding the most, ties to the less loaded (`load_key`) — but
    only among those whose backlog is within `slack` requests of the least-loaded instance's (`least`).
    That guard is the saturation rule (llm-d's "sticky until saturated", SGLang's balance threshold): a
    prefix every request shares does not pin its traffic on one instance while others idle, since past
    `slack` the least-loaded instance takes the next request, computes the prefix and holds it too.
    Nothing in reach: `least` (least-load's choice). Dynamo weighs the same two terms (the prompt blocks an
    instance would compute, its load) in one cost; here they are in that order, which the bench checks
    against least-load on the session mixes (docs/bench.md)."""
    floor = backlog_of(least)
    best: tuple[int, tuple[int, float, str]] | None = None
    pick = least
    for x, held in hits:
        if held <= 0 or backlog_of(x) > floor + slack:
            continue
        key = (-held, load_key(x))
        if best is None or key < best:
            best, pick = key, x
    return pick


def round_robin(candidates: Sequence[str], turn: int) -> str | None:
    """The `turn`-th choice of a balancer that takes the candidates (in id order) one after another."""
    if not candidates:
        return None
    ordered = sorted(candidates)
    return ordered[turn % len(ordered)]


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
    """Whether a request runs colocated or split, given the entry each path would take (None: the path
    has no instance that can take it now: no active colocated instance, or no active prefill instance
    with an active decode instance to hand over to). None: neither path can. `prompt_len` is what the
    colocated entry would compute: the prompt less the leading tokens its prefix cache holds (llm-d
    disaggregates only when the uncached part of a prompt is long), so a conversation whose history the
    colocated instance holds stays there.

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


# --- the whole rule: one call ------------------------------------------------------------------------------
class EntryPolicies(Protocol):
    """The runtime policies the entry rule reads (`tetri.scheduling.policyset.PolicySet` has them)."""

    @property
    def routing(self) -> str: ...
    @property
    def cache_slack(self) -> int: ...
    @property
    def pd_route(self) -> str: ...
    @property
    def pd_prompt_tokens(self) -> int: ...
    @property
    def pd_output_tokens(self) -> int: ...
    @property
    def pd_backlog_slack(self) -> int: ...


class RoutingView(Protocol):
    """What the entry rule reads of a registry (the daemon's `Cluster`): per (role, model) the instances
    that may take new work, by `load_key`; each one's load; the prefix-cache index; round-robin's turns."""

    cache: CacheIndex
    turns: Counter[tuple[str, str]]

    def routes(self) -> Mapping[tuple[str, str], MinIndex]: ...

    def load(self, instance_id: str) -> InstanceLoad: ...


def choose_entry(
    view: RoutingView,
    policies: EntryPolicies,
    model: str,
    exclude: frozenset[str] = frozenset(),
    prompt: Sequence[int] = (),
    predicted: tuple[int, int] | None = None,
    split: bool = False,
) -> str | None:
    """Where a request for `model` with this `prompt` (token ids) starts (TetriInfer §3.2): an instance of
    the colocated role, or of the prefill role provided the model has a decode instance to hand over to;
    none of `exclude`. Among the instances of a role, the `routing` policy chooses (cache-aware, least-load
    or round-robin). When the model has both paths, `pd_route` chooses between them for this request
    (`choose_path`: the tokens the colocated entry would compute, the predicted output range and the two
    entries' loads); `split` (the request names its decode instance): only a prefill instance. The chosen
    instance's id; None: no instance can take it now. Under round-robin the caller advances the chosen
    role's turn (`view.turns`)."""
    routes = view.routes()
    colocated = None if split else routes.get(("colocated", model))
    prefill = routes.get(("prefill", model)) if routes.get(("decode", model)) else None
    both = prefill is not None
    c = _pick(view, policies, ("colocated", model), colocated, exclude, prompt, both) if colocated else None
    p = _pick(view, policies, ("prefill", model), prefill, exclude, prompt) if prefill else None
    if c is None or p is None:
        pick = c if c is not None else p
        return None if pick is None else pick[0]
    path = choose_path(
        policies.pd_route,
        len(prompt) - c[1],  # what the colocated entry would compute
        predicted,
        view.load(c[0]),
        view.load(p[0]),
        policies.pd_prompt_tokens,
        policies.pd_output_tokens,
        policies.pd_backlog_slack,
    )
    return c[0] if path == "colocated" else p[0]


def _pick(
    view: RoutingView,
    pol: EntryPolicies,
    key: tuple[str, str],
    idx: MinIndex,
    exclude: frozenset[str],
    prompt: Sequence[int],
    both: bool = False,
) -> tuple[str, int] | None:
    """One role's instance (`key`: the role and model of `idx`) for a request under the `routing` policy,
    and the prompt tokens its prefix cache holds (looked up when cache-aware, or for the P/D choice when the
    model has `both` paths); None when none can take it."""
    least = idx.best(exclude)
    if least is None:
        return None
    candidates = [iid for iid in idx if iid not in exclude] if exclude else list(idx)
    chosen = least
    held: dict[str, int] = {}
    if pol.routing == "cache-aware" and prompt:
        held = _held(view.cache, prompt, candidates)
        if held:
            with_hits = [(view.load(iid), n) for iid, n in held.items()]
            chosen = cache_aware(view.load(least), with_hits, pol.cache_slack).instance_id
    elif pol.routing == "round-robin":
        chosen = round_robin(candidates, view.turns[key]) or least
    if pol.routing != "cache-aware" and prompt and both and pol.pd_route == "length":
        held = _held(view.cache, prompt, [chosen])  # what it holds still counts for the P/D choice
    return chosen, held.get(chosen, 0)


def _held(cache: CacheIndex, prompt: Sequence[int], candidates: Sequence[str]) -> dict[str, int]:
    """Prompt tokens each candidate's prefix cache holds (those holding some), from the index."""
    blocks = cache.match(prompt, candidates)
    return {iid: n * cache.block_size(iid) for iid, n in blocks.items()}
