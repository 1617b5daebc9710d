"""The time-indexed LP relaxation, solved with HiGHS (through scipy).

Variables x_{i,t} ∈ [0, 1] for every start step t ∈ [a_i, T) and one "late" variable per request
standing for every start at or after the horizon T. Constraints: Σ_t x_{i,t} = 1 for each i; for every
step τ < T, Σ x_{i,t} · (s_i + τ − t + 1) over the (i, t) running at τ is ≤ M. Objective:
Σ x_{i,t} · (t + o_i − a_i), the late variable costing max(T, a_i) + o_i − a_i.

Any feasible schedule maps to a feasible LP point whose cost is at most its TEL (late starts are
charged the least they could cost and their memory after T is not constrained), so the LP optimum is a
valid lower bound for every horizon T; a larger T is tighter and costlier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from .workload import IntArray, Workload

LP_MAX_NONZEROS = 4_000_000


class LPTooLarge(ValueError):
    """The instance's LP would exceed LP_MAX_NONZEROS."""


@dataclass
class LPSolution:
    bound: int  # a valid integer lower bound on TEL
    objective: float
    completion: np.ndarray  # LP-expected completion step per request (for sorted-lp)
    nonzeros: int


def lp_nonzeros(w: Workload, horizon: int) -> int:
    total = 0
    for a, o in zip(w.a.tolist(), w.o.tolist(), strict=True):
        starts = max(0, horizon - a)
        full = max(0, starts - o)  # starts whose whole window fits before T
        total += full * o + sum(range(1, min(starts, o) + 1)) + 1
    return total


def solve_lp(w: Workload, memory: int, horizon: int) -> LPSolution:
    nnz = lp_nonzeros(w, horizon)
    if nnz > LP_MAX_NONZEROS:
        raise LPTooLarge(f"LP would have {nnz} non-zeros (limit {LP_MAX_NONZEROS})")
    T = horizon
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    cost: list[np.ndarray] = []
    owner: list[np.ndarray] = []
    start_of: list[np.ndarray] = []
    col = 0
    for i in range(w.n):
        s, o, a = int(w.s[i]), int(w.o[i]), int(w.a[i])
        t = np.arange(a, T, dtype=np.int64)
        if len(t):
            d = np.arange(o, dtype=np.int64)
            tau = t[:, None] + d[None, :]
            mask = tau < T
            cidx = np.broadcast_to(col + np.arange(len(t))[:, None], tau.shape)
            rows.append(tau[mask])
            cols.append(cidx[mask])
            vals.append(np.broadcast_to(s + d[None, :] + 1, tau.shape)[mask].astype(np.float64))
        cost.append(np.append(t + o - a, max(T, a) + o - a).astype(np.float64))
        start_of.append(np.append(t, max(T, a)))
        owner.append(np.full(len(t) + 1, i, dtype=np.int64))
        col += len(t) + 1
    c = np.concatenate(cost)
    own = np.concatenate(owner)
    a_eq = sparse.csr_matrix((np.ones(col), (own, np.arange(col))), shape=(w.n, col))
    if rows:
        a_ub = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(T, col))
        b_ub = np.full(T, float(memory))
    else:
        a_ub, b_ub = None, None
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(w.n), bounds=(0, 1), method="highs")
    if res.status != 0:
        raise RuntimeError(f"HiGHS did not solve the LP: {res.message}")
    x = res.x
    completion = np.bincount(own, weights=x * (np.concatenate(start_of) + w.o[own]), minlength=w.n)
    obj = float(res.fun)
    bound = max(0, math.ceil(obj - 1e-6 * max(1.0, abs(obj))))  # HiGHS tolerances; TEL is an integer
    return LPSolution(bound, obj, completion, nnz)


def lp_order(sol: LPSolution) -> IntArray:
    """sorted-lp: requests by LP-expected completion, ties by index."""
    return np.lexsort((np.arange(len(sol.completion)), sol.completion)).astype(np.int64)
