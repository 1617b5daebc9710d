"""Lower bounds on the total end-to-end latency (TEL); every one is valid for every feasible schedule.

* ``cheap`` — O(n log n), any size. Let c_[k] be the k-th smallest completion step. The k requests
  done by then each needed the area A_i = s_i·o_i + o_i(o_i+1)/2 slot-steps, all inside steps
  [0, c_[k]) of capacity M each, so c_[k] ≥ ⌈(sum of the k smallest A)/M⌉; each also has
  c_i ≥ a_i + o_i, so c_[k] ≥ the k-th smallest a_i + o_i. TEL ≥ Σ_k max(both) − Σ a_i, and
  TEL ≥ Σ o_i.
* ``mean busy time`` (also O(n log n), part of ``cheap``) — read step τ as the time interval
  [τ, τ+1) in which request j works at rate m_j(τ), its KV slots. Its memory-weighted centre
  G_j = Σ_τ m_j(τ)(τ + ½) / A_j sits a fixed δ_j before its completion (δ_j depends on s_j, o_j only).
  Total rate ≤ M gives Σ_{j∈S} A_j G_j ≥ A(S)²/(2M) for every set S (Goemans' mean-busy-time
  polyhedron), whose minimum of Σ G_j puts the smallest areas first: Σ G_j ≥ Σ_k (P_{k-1} + A_k/2)/M.
  So TEL ≥ Σ_k (P_{k-1} + A_k/2)/M + Σ δ_j − Σ a_j.
* ``lp`` — the time-indexed LP relaxation (`lp.py`), for instances small enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .lp import LPTooLarge, lp_nonzeros, solve_lp
from .workload import Workload


def area(w: Workload) -> np.ndarray:
    return w.s * w.o + w.o * (w.o + 1) // 2


def centre_gap(w: Workload) -> np.ndarray:
    """δ_j = c_j − G_j: completion minus the memory-weighted centre of the request's steps."""
    s, o = w.s.astype(np.float64), w.o.astype(np.float64)
    moment = (s + 1) * o * o / 2 + (o - 1) * o * (2 * o - 1) / 6 + (o - 1) * o / 4  # Σ_d (s+d+1)(d+½)
    return o - moment / area(w)


def cheap_bound(w: Workload, memory: int) -> int:
    areas = np.sort(area(w))
    pref = np.cumsum(areas)
    by_area = -(-pref // memory)  # ceil
    by_len = np.sort(w.a + w.o)
    rank = int(np.maximum(by_area, by_len).sum()) - int(w.a.sum())
    busy = float(((pref - areas / 2) / memory).sum() + centre_gap(w).sum()) - float(w.a.sum())
    busy_int = math.ceil(busy - 1e-9 * max(1.0, abs(busy)))
    return max(rank, busy_int, int(w.o.sum()))


@dataclass
class Bound:
    lower_bound: int
    method: str  # "lp" or "cheap"
    cheap: int
    lp: int | None = None
    detail: str = ""


def best_bound(w: Workload, memory: int, horizon: int | None, use_lp: bool = True) -> Bound:
    """The best valid bound available: the LP's when it fits in LP_MAX_NONZEROS, else the cheap one."""
    cheap = cheap_bound(w, memory)
    if not use_lp or horizon is None:
        return Bound(cheap, "cheap", cheap, None, "LP not requested")
    try:
        sol = solve_lp(w, memory, horizon)
    except LPTooLarge:
        return Bound(cheap, "cheap", cheap, None, f"LP too large ({lp_nonzeros(w, horizon)} non-zeros)")
    if sol.bound >= cheap:
        return Bound(sol.bound, "lp", cheap, sol.bound, f"horizon {horizon}")
    return Bound(cheap, "cheap", cheap, sol.bound, f"horizon {horizon}")
