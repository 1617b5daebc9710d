"""A min segment tree over priority positions: "the first waiting request, in priority order, that may
start by step t".

Each position holds the earliest step its request may start (its arrival, or a lower bound from a
failed admission test) or INF once started. Point updates and the leftmost-≤-t search are O(log n).
"""

from __future__ import annotations

from collections.abc import Sequence

INF = 1 << 62


class WaitQueue:
    def __init__(self, values: Sequence[int]) -> None:
        n = len(values)
        size = 1
        while size < max(n, 1):
            size *= 2
        self.n, self.size = n, size
        tree = [INF] * (2 * size)
        tree[size : size + n] = [int(v) for v in values]
        for i in range(size - 1, 0, -1):
            a, b = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a < b else b
        self._t = tree

    def get(self, pos: int) -> int:
        return self._t[self.size + pos]

    def set(self, pos: int, value: int) -> None:
        t = self._t
        i = self.size + pos
        t[i] = value
        i >>= 1
        while i:
            a, b = t[2 * i], t[2 * i + 1]
            m = a if a < b else b
            if t[i] == m:
                break
            t[i] = m
            i >>= 1

    def min(self) -> int:
        return self._t[1]

    def first_leq(self, limit: int, start: int = 0) -> int | None:
        """Leftmost position ≥ start whose value is ≤ limit, or None."""
        if start >= self.n:
            return None
        t = self._t
        i = self.size + start
        while t[i] > limit:
            while i & 1:
                i >>= 1
            if i == 0:
                return None
            i += 1
        while i < self.size:
            i = 2 * i if t[2 * i] <= limit else 2 * i + 1
        pos = i - self.size
        return pos if pos < self.n else None
