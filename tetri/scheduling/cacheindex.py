"""The control plane's prefix-cache index: which prompt blocks each instance's engine holds, by Tetri's
block key (`tetri.scheduling.prefix`), as the instances' KV events say.

Fed with what each engine reports (vLLM's own KV events, translated by the worker; the sim engine's
block cache) in batches, each stamped with the reporting stream's `epoch` and a sequence number: a batch
with `reset` carries the instance's whole cache (a worker's first report on a connection: after its own
restart, the daemon's, or a lost link), the others what changed since the batch before. A batch out of
turn is not trusted: a duplicate or an older one (seq not after the last) is ignored, one of another
epoch without `reset` is a stale stream's and ignored, and when a batch shows that one before it was lost
(a gap in the numbers) the instance's entry is emptied before it is applied — the index then under-states
that instance (routing falls back to load there) until new events fill it again, rather than keep
blocks the lost batch may have removed.

Memory is bounded: at most `limit(instance)` keys per instance (the engine's block capacity, twice over,
and never more than `MAX_BLOCKS`), the oldest dropped first past it; a batch larger than `MAX_BATCH` keys
empties the instance's entry instead of being applied (a worker flooding the daemon costs it one
bounded loop). `drop` forgets an instance (removed from the registry).

`match` answers the router: for a prompt's tokens, how many leading blocks each candidate holds. Keys are
computed one block at a time and the walk stops at the first block no candidate holds, so a prompt nobody
has seen costs one block's hash.

A controller relays the index to its fronts: `log` keeps the changes applied (the last 4,096, and at most
2²⁰ keys in them), `since(cursor)`
gives a front what it has not seen (None when it fell behind: then `snapshot()`), and a front applies
them with `replay`.

Pure: plain data in and out; no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from .prefix import iter_keys

MAX_BLOCKS = 1 << 18  # keys one instance may hold here, whatever it says its capacity is
MAX_BATCH = 1 << 16  # keys one batch may carry (stored + removed); a larger one is a flood
LOG_ENTRIES = 4096  # changes kept for fronts that follow the index
LOG_KEYS = 1 << 20  # and at most this many keys in them (a front further behind takes a snapshot)


@dataclass(frozen=True)
class CacheEvents:
    """One batch of an instance's cache events, as its worker sends it."""

    epoch: int  # the reporting stream's (a new connection: a new epoch, which starts with `reset`)
    seq: int  # this batch's number on that stream (reset: 0, then 1, 2, …)
    reset: bool = False  # `stored` is the instance's whole cache: forget what it held
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    block_size: int = 0  # the engine's (0: as registered)


@dataclass(frozen=True)
class Change:
    """One change the index applied, as a front replays it."""

    number: int  # position in the controller's log
    instance: str
    reset: bool = False  # forget what the instance held first (`dropped`: and the instance itself)
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    dropped: bool = False


@dataclass
class _Entry:
    slot: int
    block_size: int = 0
    limit: int = MAX_BLOCKS
    keys: dict[int, None] = field(default_factory=dict)  # insertion order: the oldest first
    epoch: int | None = None
    seq: int = -1


@dataclass
class IndexStats:
    """What the index turned away or lost (counters over its life)."""

    batches: int = 0
    ignored: int = 0  # duplicates, out of turn, stale epochs
    gaps: int = 0  # a batch lost: the instance's entry emptied
    floods: int = 0  # a batch over MAX_BATCH: the instance's entry emptied
    evicted: int = 0  # keys dropped past an instance's limit


class CacheIndex:
    def __init__(self, log_entries: int = LOG_ENTRIES, log_keys: int = LOG_KEYS) -> None:
        self._entries: dict[str, _Entry] = {}
        self._mask: dict[int, int] = {}  # key -> bits of the instances holding it
        self._slots: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.stats = IndexStats()
        self.log: deque[Change] = deque()
        self._log_limits = (log_entries, log_keys)
        self._log_keys = 0
        self._number = 0

    # --- reading --------------------------------------------------------------------------------------
    def __contains__(self, instance: object) -> bool:
        return instance in self._entries

    def blocks(self, instance: str) -> int:
        e = self._entries.get(instance)
        return 0 if e is None else len(e.keys)

    def keys(self, instance: str) -> list[int]:
        e = self._entries.get(instance)
        return [] if e is None else list(e.keys)

    def block_size(self, instance: str) -> int:
        e = self._entries.get(instance)
        return 0 if e is None else e.block_size

    def instances(self) -> list[str]:
        return list(self._entries)

    def match(self, tokens: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate that holds at least the prompt's first block, how many of its leading full
        blocks it holds (at the block size it reported). Candidates it knows nothing of are left out."""
        out: dict[str, int] = {}
        for size, alive in self._alive(candidates).items():
            self._walk(iter_keys(tokens, size), alive, out)
        return out

    def match_keys(self, keys: Sequence[int], block_size: int, candidates: Iterable[str]) -> dict[str, int]:
        """`match` for a prompt whose keys at `block_size` are known (the simulator's, from hash ids)."""
        out: dict[str, int] = {}
        alive = self._alive(candidates).get(block_size, 0)
        if alive:
            self._walk(iter(keys), alive, out)
        return out

    def _alive(self, candidates: Iterable[str]) -> dict[int, int]:
        """The candidates holding anything, as a bit mask per block size."""
        by_size: dict[int, int] = {}
        for iid in candidates:
            e = self._entries.get(iid)
            if e is not None and e.keys and e.block_size > 0:
                by_size[e.block_size] = by_size.get(e.block_size, 0) | (1 << e.slot)
        return by_size

    def _walk(self, keys: Iterator[int], alive: int, out: dict[str, int]) -> None:
        """Follow the keys while some of the `alive` instances hold each; record where each drops out."""
        n = 0
        for mask in map(self._mask.get, keys, repeat(0)):
            held = mask & alive
            if held != alive:  # some drop out here
                self._record(out, alive & ~held, n)
                alive = held
                if not alive:
                    return
            n += 1
        self._record(out, alive, n)

    def _record(self, out: dict[str, int], bits: int, n: int) -> None:
        if n == 0:
            return
        while bits:
            low = bits & -bits
            out[self._slots[low.bit_length() - 1]] = n
            bits ^= low

    # --- an instance ----------------------------------------------------------------------------------
    def _entry(self, instance: str) -> _Entry:
        e = self._entries.get(instance)
        if e is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            e = self._entries[instance] = _Entry(slot)
            self._slots[slot] = instance
        return e

    def limit(self, instance: str, block_size: int, capacity_blocks: int = 0) -> None:
        """The instance's block size and how many keys it may hold here (twice its capacity in blocks, at
        most MAX_BLOCKS; 0: MAX_BLOCKS). A registration calls it."""
        e = self._entry(instance)
        e.block_size = max(0, block_size)
        e.limit = min(MAX_BLOCKS, 2 * capacity_blocks) if capacity_blocks > 0 else MAX_BLOCKS
        self._trim(instance, e)

    def forget_all(self) -> None:
        """Forget every key (a front about to take its controller's snapshot); the instances' block sizes
        and limits (their registrations') stay."""
        for iid, e in self._entries.items():
            self._reset(iid, e)

    def drop(self, instance: str) -> None:
        """Forget the instance (removed from the registry)."""
        e = self._entries.pop(instance, None)
        if e is None:
            return
        self._clear(e)
        del self._slots[e.slot]
        self._free_slots.append(e.slot)
        self._logged(Change(0, instance, reset=True, dropped=True))

    # --- a worker's batches ---------------------------------------------------------------------------
    def apply(self, instance: str, batch: CacheEvents) -> bool:
        """Apply one batch of the instance's events if it is in turn (see the module's doc); whether it was."""
        self.stats.batches += 1
        e = self._entry(instance)
        if batch.block_size > 0:
            e.block_size = batch.block_size
        if batch.reset:
            if e.epoch == batch.epoch and batch.seq <= e.seq:
                self.stats.ignored += 1
                return False
        elif e.epoch != batch.epoch or batch.seq <= e.seq:
            self.stats.ignored += 1
            return False
        elif batch.seq != e.seq + 1:
            self.stats.gaps += 1
            self._reset(instance, e)
        e.epoch, e.seq = batch.epoch, batch.seq
        if len(batch.stored) + len(batch.removed) > MAX_BATCH:
            self.stats.floods += 1
            self._reset(instance, e)
            return False
        if batch.reset:
            self._reset(instance, e)
        self._store(instance, e, batch.stored)
        self._remove(instance, e, batch.removed)
        return True

    def replay(self, change: Change) -> None:
        """A front applies a change its controller's index made (in the order of the log)."""
        if change.dropped:
            self.drop(change.instance)
            return
        e = self._entry(change.instance)
        if change.reset:
            self._reset(change.instance, e)
        self._store(change.instance, e, change.stored)
        self._remove(change.instance, e, change.removed)

    # --- the relay to fronts --------------------------------------------------------------------------
    @property
    def cursor(self) -> int:
        """The number of the last change applied (a front that has seen it is up to date)."""
        return self._number

    def since(self, cursor: int) -> list[Change] | None:
        """The changes after `cursor`, or None when the log no longer holds them all (then `snapshot`)."""
        if cursor == self._number:
            return []
        if cursor > self._number or not self.log or self.log[0].number > cursor + 1:
            return None
        return [c for c in self.log if c.number > cursor]

    def snapshot(self) -> list[Change]:
        """Every instance's whole entry, as changes a front applies after forgetting what it had."""
        return [Change(self._number, iid, reset=True, stored=tuple(e.keys)) for iid, e in self._entries.items()]

    # --- the mechanics --------------------------------------------------------------------------------
    def _logged(self, change: Change) -> None:
        self._number += 1
        c = change
        self.log.append(Change(self._number, c.instance, c.reset, c.stored, c.removed, c.dropped))
        self._log_keys += len(c.stored) + len(c.removed)
        entries, keys = self._log_limits
        while len(self.log) > entries or (self._log_keys > keys and len(self.log) > 1):
            old = self.log.popleft()
            self._log_keys -= len(old.stored) + len(old.removed)

    def _clear(self, e: _Entry) -> None:
        bit = 1 << e.slot
        mask = self._mask
        for key in e.keys:
            m = mask[key] & ~bit
            if m:
                mask[key] = m
            else:
                del mask[key]
        e.keys.clear()

    def _reset(self, instance: str, e: _Entry) -> None:
        self._clear(e)
        self._logged(Change(0, instance, reset=True))

    def _store(self, instance: str, e: _Entry, keys: Sequence[int]) -> None:
        if not keys:
            return
        bit = 1 << e.slot
        mask, held = self._mask, e.keys
        new = []
        for key in keys:
            if key in held:
                continue
            held[key] = None
            mask[key] = mask.get(key, 0) | bit
            new.append(key)
        if new:
            self._logged(Change(0, instance, stored=tuple(new)))
        self._trim(instance, e)

    def _remove(self, instance: str, e: _Entry, keys: Sequence[int]) -> None:
        if not keys:
            return
        bit = 1 << e.slot
        mask, held = self._mask, e.keys
        gone = []
        for key in keys:
            if held.pop(key, 0) is None:  # it was held (held values are None)
                m = mask[key] & ~bit
                if m:
                    mask[key] = m
                else:
                    del mask[key]
                gone.append(key)
        if gone:
            self._logged(Change(0, instance, removed=tuple(gone)))

    def _trim(self, instance: str, e: _Entry) -> None:
        over = len(e.keys) - e.limit
        if over > 0:
            oldest = [k for k, _ in zip(e.keys, range(over), strict=False)]
            self.stats.evicted += over
            self._remove(instance, e, oldest)
