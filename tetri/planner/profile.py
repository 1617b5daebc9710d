"""The future KV-memory profile of a running set, and the admission test built on it.

Model (docs/planner.md): a request started at step p with prompt s and output o holds s + (τ − p + 1)
KV slots in every step τ ∈ [p, p + o − 1] and completes at c = p + o. For running requests the total
R(τ) is known for every future τ; it rises between completions and drops at them, so the largest value
over any interval sits at a completion's last step (a *checkpoint* c_k − 1) or at the interval's end.

`KVProfile.fits(s, o, t)` is the one admission test every policy uses: may a request (s, o) start at t
so that every future step stays within M? `earliest_start` gives the first step at which it may, if
nothing else is admitted before; admitting more can only push that later, so it is a valid lower bound.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
from scipy.ndimage import maximum_filter1d

_NEG = -(2**62)


class KVProfile:
    """Running requests under budget ``memory``; all queries assume ``advance(t)`` was called first."""

    def __init__(self, memory: int) -> None:
        self.memory = int(memory)
        # The running set, sorted by completion step: Python lists are the source of truth (cheap
        # inserts); numpy copies and the derived arrays are rebuilt lazily when a query needs them.
        self._lc: list[int] = []  # completion steps c, ascending
        self._lb: list[int] = []  # s - p + 1: slots at step τ are base + τ
        self._li: list[int] = []  # request ids
        self._dirty = True
        self._c = np.empty(0, dtype=np.int64)
        self._suffix = np.zeros(1, dtype=np.int64)  # suffix sums of base, length R + 1
        self._pmax = np.empty(0, dtype=np.int64)  # prefix max of U = R(τ) + τ at checkpoints
        self._ls: list[int] = [0]  # list copies of _suffix and _pmax for scalar queries
        self._lp: list[int] = []

    # --- mutation -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lc)

    def add(self, rid: int, s: int, o: int, start: int) -> None:
        c = start + o
        k = bisect_right(self._lc, c)
        self._lc.insert(k, c)
        self._lb.insert(k, s - start + 1)
        self._li.insert(k, rid)
        self._dirty = True

    def remove(self, rid: int) -> None:
        if rid in self._li:
            k = self._li.index(rid)
            del self._lc[k], self._lb[k], self._li[k]
            self._dirty = True

    def advance(self, t: int) -> list[int]:
        """Drop requests completed by step t (c ≤ t); returns their ids."""
        k = bisect_right(self._lc, t)
        if k == 0:
            return []
        done = self._li[:k]
        del self._lc[:k], self._lb[:k], self._li[:k]
        self._dirty = True
        return done

    # --- queries ------------------------------------------------------------------------------
    def next_completion(self) -> int | None:
        return self._lc[0] if self._lc else None

    def ids(self) -> list[int]:
        return list(self._li)

    def _refresh(self) -> None:
        if not self._dirty:
            return
        r = len(self._lc)
        self._c = c = np.array(self._lc, dtype=np.int64)
        suffix = np.zeros(r + 1, dtype=np.int64)
        if r:
            base = np.array(self._lb, dtype=np.int64)
            suffix[:r] = np.cumsum(base[::-1])[::-1]
            tau = c - 1
            first = np.searchsorted(c, c, side="left")  # active at τ_j: c ≥ c_j
            u = suffix[first] + tau * (r - first) + tau
            self._pmax = np.maximum.accumulate(u)
        else:
            self._pmax = np.empty(0, dtype=np.int64)
        self._suffix = suffix
        self._dirty = False
        self._ls, self._lp = suffix.tolist(), self._pmax.tolist()

    def usage(self, tau: int | np.ndarray) -> np.ndarray | int:
        """R(τ) for future steps τ (vectorised)."""
        self._refresh()
        idx = np.searchsorted(self._c, tau, side="right")
        val = self._suffix[idx] + np.asarray(tau) * (len(self._c) - idx)
        return int(val) if np.ndim(val) == 0 else val

    def fits(self, s: int, o: int, t: int) -> bool:
        """May (s, o) start at step t with every future step within M?"""
        if s + o > self.memory:
            return False
        if not self._lc:
            return True
        self._refresh()
        c = self._lc
        x = t + o - 1
        limit = self.memory - s - 1 + t
        j = bisect_right(c, x + 1)  # checkpoints c_j - 1 ≤ x
        if j and self._lp[j - 1] > limit:
            return False
        idx = bisect_right(c, x, 0, j)
        return self._ls[idx] + x * (len(c) - idx) + x <= limit

    def usage_now(self, t: int) -> int:
        """R(t), the slots held in step t (0 when nothing runs)."""
        if not self._lc:
            return 0
        self._refresh()
        idx = bisect_right(self._lc, t)
        return self._ls[idx] + t * (len(self._lc) - idx)

    def earliest_start(self, s: int, o: int, t: int) -> int:
        """First step t' ≥ t at which (s, o) fits, assuming no further admissions."""
        if not self._lc:
            return t
        if self.fits(s, o, t):
            return t
        horizon = self._lc[-1]  # from here on nothing runs and s + o ≤ M fits
        if horizon <= t:
            return t
        tau = np.arange(t, horizon, dtype=np.int64)
        u = np.asarray(self.usage(tau)) + tau
        size = min(o, len(u))
        wmax = maximum_filter1d(u, size=size, origin=-(size // 2), mode="constant", cval=_NEG)
        ok = np.flatnonzero(wmax - tau <= self.memory - s - 1)
        return t + int(ok[0]) if len(ok) else horizon

    def first_overflow(self, t: int) -> int | None:
        """First step τ ≥ t with R(τ) > M, or None."""
        if not self._lc:
            return None
        self._refresh()
        r = len(self._c)
        tau = self._c - 1
        first = np.searchsorted(self._c, self._c, side="left")
        at_cp = self._suffix[first] + tau * (r - first)
        over = np.flatnonzero(at_cp > self.memory)
        if not len(over):
            return None
        j = int(over[0])
        b, n_act = int(self._suffix[first[j]]), r - int(first[j])
        # R is linear (b + τ·n) on the piece ending at τ_j; first τ where it passes M:
        tau0 = (self.memory - b) // n_act + 1
        piece_start = int(self._c[first[j] - 1]) if first[j] > 0 else t
        return max(tau0, piece_start, t)
