"""Phase 1 of Sorted-F: pick a feasible batch X (Σ_{i∈X}(s_i + o_i) ≤ M) minimising
F(X) = Σ_{i∈X} o_i / |X|², repeatedly, to build the ordered list phase 2 executes.

Solvers (each takes the remaining requests' s and o and returns the chosen positions):

* ``dp`` — exact: for every batch size k, the least Σo within capacity M (a 0/1 knapsack with a
  cardinality dimension, O(n · k_max · M)); then the k minimising Σo/k². For n ≤ ~100.
* ``swap`` — local search: the better of two greedy fills (ascending o, ascending s+o), improved by the
  best add / drop / pairwise swap move until none lowers F. O(n log n) per move.
* ``quantile`` — linear time: a sample's quantiles filter out outliers in o and s+o, the smallest
  candidates by key (found with a partial sort) fill the capacity greedily; best F over a few keys.
* ``auto`` — dp when the DP table is small, swap up to 5,000 requests, quantile beyond.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .names import SOLVERS
from .workload import IntArray, WorkloadError

DP_CELL_BUDGET = 60_000_000  # n · (k_max + 1) · (M + 1) cells of the DP's choice table
SWAP_MAX_N = 5_000


def check_solver(name: str) -> None:
    if name not in SOLVERS:
        raise WorkloadError(f"unknown solver {name!r} (choose from {', '.join(SOLVERS)})")


def f_value(o: IntArray, members: IntArray) -> float:
    k = len(members)
    return float(o[members].sum()) / (k * k) if k else float("inf")


def _k_max(w: IntArray, memory: int) -> int:
    return int(np.searchsorted(np.cumsum(np.sort(w)), memory, side="right"))


def dp_batch(s: IntArray, o: IntArray, memory: int) -> IntArray:
    """Exact minimiser of F over feasible subsets."""
    w = s + o
    n = len(w)
    kmax = _k_max(w, memory)
    big = np.iinfo(np.int64).max // 4
    dp = np.full((kmax + 1, memory + 1), big, dtype=np.int64)
    dp[0, :] = 0
    took = np.zeros((n, kmax + 1, memory + 1), dtype=bool)
    for i in range(n):
        wi, oi = int(w[i]), int(o[i])
        if wi > memory:
            continue
        cand = dp[:-1, : memory + 1 - wi] + oi
        better = cand < dp[1:, wi:]
        dp[1:, wi:] = np.where(better, cand, dp[1:, wi:])
        took[i, 1:, wi:] = better
    ks = np.arange(1, kmax + 1)
    best_o = dp[1:, memory]
    scores = np.where(best_o < big, best_o / (ks * ks), np.inf)
    k = int(ks[int(np.argmin(scores))])
    c, chosen = memory, []
    for i in range(n - 1, -1, -1):
        if k == 0:
            break
        if took[i, k, c]:
            chosen.append(i)
            k -= 1
            c -= int(w[i])
    return np.array(sorted(chosen), dtype=np.int64)


def _greedy_fill(order: IntArray, w: IntArray, memory: int) -> IntArray:
    """Walk ``order`` taking every request that still fits."""
    ws = w[order]
    csum = np.cumsum(ws)
    cut = int(np.searchsorted(csum, memory, side="right"))
    taken = [order[:cut]]
    used = int(csum[cut - 1]) if cut else 0
    rest = order[cut:]
    small = rest[w[rest] <= memory - used]
    for i in small.tolist():  # the tail that still fits: usually short
        wi = int(w[i])
        if used + wi <= memory:
            taken.append(np.array([i], dtype=np.int64))
            used += wi
    return np.concatenate(taken).astype(np.int64)


def swap_batch(s: IntArray, o: IntArray, memory: int, max_moves: int = 10_000) -> tuple[IntArray, int]:
    """Greedy start, then best-improvement add / drop / pairwise swap moves. Returns (batch, moves)."""
    w = s + o
    n = len(w)
    starts = [
        _greedy_fill(np.lexsort((w, o)), w, memory),
        _greedy_fill(np.lexsort((o, w)), w, memory),
    ]
    inside = np.zeros(n, dtype=bool)
    inside[min(starts, key=lambda b: f_value(o, b))] = True
    moves = 0
    while moves < max_moves:
        members = np.flatnonzero(inside)
        outside = np.flatnonzero(~inside)
        k = len(members)
        sum_o = int(o[members].sum())
        slack = memory - int(w[members].sum())
        best_f = sum_o / (k * k)
        best: tuple[str, int, int] | None = None
        if len(outside):
            by_w = outside[np.argsort(w[outside], kind="stable")]
            prefmin_o = np.minimum.accumulate(o[by_w])
            argmin_idx = _prefix_argmin(o[by_w])
            # add: the smallest o among outside requests that fit in the slack
            j = int(np.searchsorted(w[by_w], slack, side="right"))
            if j:
                b = int(by_w[argmin_idx[j - 1]])
                f_add = (sum_o + int(o[b])) / ((k + 1) ** 2)
                if f_add < best_f - 1e-12:
                    best_f, best = f_add, ("add", -1, b)
            # swap: for each member a, the smallest-o outsider with w_b ≤ slack + w_a
            lim = np.searchsorted(w[by_w], slack + w[members], side="right")
            ok = lim > 0
            if ok.any():
                gain = np.full(k, -1, dtype=np.int64)
                gain[ok] = o[members[ok]] - prefmin_o[lim[ok] - 1]
                a_pos = int(np.argmax(gain))
                if gain[a_pos] > 0:
                    f_swap = (sum_o - int(gain[a_pos])) / (k * k)
                    if f_swap < best_f - 1e-12:
                        b = int(by_w[argmin_idx[lim[a_pos] - 1]])
                        best_f, best = f_swap, ("swap", int(members[a_pos]), b)
        if k > 1:
            a = int(members[int(np.argmax(o[members]))])
            f_drop = (sum_o - int(o[a])) / ((k - 1) ** 2)
            if f_drop < best_f - 1e-12:
                best_f, best = f_drop, ("drop", a, -1)
        if best is None:
            break
        _, a, b = best
        if a >= 0:
            inside[a] = False
        if b >= 0:
            inside[b] = True
        moves += 1
    return np.flatnonzero(inside), moves


def _prefix_argmin(x: IntArray) -> IntArray:
    """Index of the (first) minimum of x[:j+1] for every j."""
    pm = np.minimum.accumulate(x)
    is_new = np.empty(len(x), dtype=bool)
    is_new[0] = True
    is_new[1:] = pm[1:] < pm[:-1]
    idx = np.where(is_new, np.arange(len(x)), 0)
    return np.maximum.accumulate(idx)


def quantile_batch(
    s: IntArray, o: IntArray, memory: int, rng: np.random.Generator, q: float = 0.9, sample: int = 512
) -> IntArray:
    """Linear-time batch: filter outliers by sampled quantiles, fill greedily from a partial sort."""
    w = s + o
    n = len(w)
    pick = rng.choice(n, size=min(sample, n), replace=False) if n > sample else np.arange(n)
    o_cut = np.quantile(o[pick], q)
    w_cut = np.quantile(w[pick], q)
    pool = np.flatnonzero((o <= o_cut) & (w <= w_cut))
    if len(pool) == 0:
        pool = np.arange(n)
    need = max(1, memory // max(1, int(np.median(w[pick]))))  # batch size the capacity suggests
    best: IntArray | None = None
    for key in (o[pool], w[pool], o[pool] * w[pool]):
        m = min(len(pool), 4 * need + 16)
        cand = pool[np.argpartition(key, m - 1)[:m]] if m < len(pool) else pool
        cand = cand[np.argsort(key_of(key, pool, cand), kind="stable")]
        batch = _greedy_fill(cand, w, memory)
        if best is None or f_value(o, batch) < f_value(o, best):
            best = batch
    assert best is not None
    return best


def key_of(key: IntArray, pool: IntArray, cand: IntArray) -> IntArray:
    """Values of ``key`` (aligned with ``pool``) for the members ``cand`` of the pool."""
    where = np.searchsorted(pool, cand)
    return key[where]


@dataclass
class Phase1:
    order: IntArray  # request indices, batches concatenated, each by non-decreasing o
    batches: list[IntArray]
    solver: str
    iterations: int  # batches built plus local-search moves


def choose_solver(n: int, s: IntArray, o: IntArray, memory: int) -> str:
    kmax = _k_max(s + o, memory)
    if n * (kmax + 1) * (memory + 1) <= DP_CELL_BUDGET:
        return "dp"
    return "swap" if n <= SWAP_MAX_N else "quantile"


Progress = Callable[[int, int], None]  # (requests placed, total)


def sorted_f_phase1(
    s: IntArray,
    o: IntArray,
    memory: int,
    solver: str = "auto",
    seed: int = 0,
    progress: Progress | None = None,
) -> Phase1:
    """Build Sorted-F's ordered list over requests with lengths (s, o)."""
    check_solver(solver)
    if solver == "lp":
        raise WorkloadError("the lp solver orders by the LP relaxation: use policy sorted-lp")
    n = len(s)
    name = choose_solver(n, s, o, memory) if solver == "auto" else solver
    rng = np.random.default_rng(seed)
    remaining = np.arange(n, dtype=np.int64)
    batches: list[IntArray] = []
    iters = 0
    while len(remaining):
        rs, ro = s[remaining], o[remaining]
        if name == "dp":
            local = dp_batch(rs, ro, memory)
        elif name == "swap":
            local, moves = swap_batch(rs, ro, memory)
            iters += moves
        else:
            local = quantile_batch(rs, ro, memory, rng)
        chosen = remaining[local]
        chosen = chosen[np.lexsort((chosen, o[chosen]))]
        batches.append(chosen)
        iters += 1
        keep = np.ones(len(remaining), dtype=bool)
        keep[local] = False
        remaining = remaining[keep]
        if progress is not None:
            progress(n - len(remaining), n)
    order = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
    return Phase1(order, batches, name, iters)
