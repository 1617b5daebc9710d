"""The least element of a set whose members' keys change, kept as an index: what routing and dispatch
read instead of scanning every instance per decision."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

Key = tuple[Any, ...]  # compared as a tuple; its last element is the member's id (so keys never tie)


class MinIndex:
    """A heap of keys with lazy deletion. `set` (a member's key changed) costs O(log n), nothing when the
    key is unchanged; `best` is amortised O(log n). It chooses what `min(keys)` over the current keys
    chooses: the caller's key function is the rule, this only keeps it."""

    def __init__(self, keys: Iterable[Key] = ()) -> None:
        self._key: dict[Hashable, Key] = {k[-1]: k for k in keys}
        self._heap: list[Key] = list(self._key.values())
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, member: object) -> bool:
        return member in self._key

    def __iter__(self) -> Iterator[Any]:
        return iter(self._key)

    def set(self, key: Key) -> None:
        if self._key.get(key[-1]) == key:
            return
        self._key[key[-1]] = key
        heapq.heappush(self._heap, key)
        if len(self._heap) > 2 * len(self._key) + 16:  # superseded keys pile up between choices: compact
            self._heap = list(self._key.values())
            heapq.heapify(self._heap)

    def remove(self, member: Hashable) -> None:
        self._key.pop(member, None)

    def _stale(self, key: Key) -> bool:
        return self._key.get(key[-1]) != key

    def best(self, exclude: frozenset[Any] = frozenset()) -> Any | None:
        """The member with the least key, not in `exclude` (None: there is none)."""
        heap = self._heap
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        if not heap:
            return None
        if heap[0][-1] not in exclude:
            return heap[0][-1]
        # rare (a retry away from an instance that failed): set the excluded aside, then put them back
        aside, found = [], None
        while heap:
            key = heapq.heappop(heap)
            if self._stale(key):
                continue
            aside.append(key)
            if key[-1] not in exclude:
                found = key[-1]
                break
        for key in aside:
            heapq.heappush(heap, key)
        return found
