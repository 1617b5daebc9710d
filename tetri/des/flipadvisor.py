"""The `advise` flip policy's model: which P:D split the last window's requests wanted.

Every `flip_window_s` the shell (the daemon's flip watcher, or the simulator's) hands `SplitAdvisor` the
requests that arrived in the last window as its status table shows them (`trace.Seen`: finished or still
running, an answer length for each by `trace.window_workload`). `SplitAdvisor` replays them on the
simulator at every split of the active instances (1 … n−1 prefill; past 16 instances, `candidate_splits`),
with the live policies (flips off), and answers the split with the highest goodput within the SLOs — the
scoring of `tetrictl advise` (`outcome.outcome`, `outcome.score`: goodput, then the lower mean JCT). The
current split stays unless another beats it by more than `margin` (goodput higher by that share, or the
same goodput and a mean JCT lower by that share), so a window that any split serves alike flips nothing;
fewer than `min_requests` requests in the window are no evidence and give no advice.

The window is replayed from an empty cluster, so work carried in from before the window (requests that
arrived earlier and still run) is not modelled.

Pure: requests and policies in, `SplitAdvice` out; the same object serves live and simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tetri.costmodel import Profile, load_profile
from tetri.scheduling.flip import SplitAdvice
from tetri.scheduling.policyset import PolicySet

from .cluster import ClusterConfig, simulate
from .outcome import offered_rate, outcome, score
from .slo import DEFAULT_SLO, SloSet
from .trace import Seen, window_workload
from .workloads import Request

PRICE = 1.0  # dollars per GPU-hour: the split's price does not change with the split, so any will do


def candidate_splits(n: int, prefill: int) -> list[int]:
    """The prefill counts tried on `n` instances now at `prefill`: every split up to 16 instances; past
    that the current one and ±1, ±2, ±4 … from it (each replay costs a simulation of the window)."""
    if n <= 16:
        return list(range(1, n))
    steps = [0] + [s * 2**k for k in range(n.bit_length()) for s in (1, -1)]
    return sorted({prefill + d for d in steps if 1 <= prefill + d < n})


@dataclass(frozen=True)
class SplitAdvisor:
    profile: Profile
    slo: SloSet = field(default=DEFAULT_SLO)
    min_requests: int = 8
    margin: float = 0.05
    max_requests: int = 2000  # a busier window is cut to its latest requests (the replay's cost)
    seed: int = 0

    def advise(self, seen: Sequence[Seen], policies: PolicySet, prefill: int, decode: int) -> SplitAdvice | None:
        """The split to run for the window `seen` on `prefill` + `decode` instances now at `prefill`:`decode`."""
        n = prefill + decode
        requests = window_workload(seen)[-self.max_requests :]
        if n < 2 or len(requests) < self.min_requests:
            return None
        t0 = min(r.arrival for r in requests)
        window = [Request(r.request_id, r.arrival - t0, r.prompt_len, r.output_len, r.max_tokens) for r in requests]
        rate = offered_rate(window)
        pol = policies.changed(flip_policy="off")
        scored: dict[int, dict[str, Any]] = {}
        for p in candidate_splits(n, prefill):
            cfg = ClusterConfig("tetri", self.profile, n, p, pol, seed=self.seed)
            scored[p] = outcome(simulate(window, cfg), self.slo, PRICE, rate)
        best = max(scored, key=lambda p: (score(scored[p]), p == prefill))
        b, now = scored[best], scored[prefill]
        if not self._better(b, now):
            best, b = prefill, now
        reason = (
            f"{len(window)} requests of the last window: goodput {b['goodput_rps']:.3g} req/s at "
            f"{best}P:{n - best}D vs {now['goodput_rps']:.3g} at {prefill}P:{decode}D "
            f"(mean JCT {b['avg_jct_s']:.3g}s vs {now['avg_jct_s']:.3g}s)"
        )
        return SplitAdvice(best, n - best, reason)

    def _better(self, o: dict[str, Any], than: dict[str, Any]) -> bool:
        if o["goodput_rps"] > than["goodput_rps"] * (1 + self.margin):
            return True
        same = abs(o["goodput_rps"] - than["goodput_rps"]) <= than["goodput_rps"] * 1e-9
        return same and o["avg_jct_s"] < than["avg_jct_s"] * (1 - self.margin)


def advising(config: ClusterConfig) -> ClusterConfig:
    """`config` with the `advise` flip policy's model for its profile, SLOs and seed (the simulator takes
    the advisor as data: `ClusterConfig.advisor`); unchanged when its policy does not flip by advice."""
    if config.policy.flip_policy != "advise" or config.advisor is not None:
        return config
    profile = load_profile(config.profile) if isinstance(config.profile, str) else config.profile
    return replace(config, advisor=SplitAdvisor(profile, config.slo, seed=config.seed))
