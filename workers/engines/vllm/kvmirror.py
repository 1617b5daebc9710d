"""What a vLLM engine's prefix cache holds, as Tetri's block keys, kept from vLLM's own KV events.

vLLM (0.32) publishes, for its prefix cache, `BlockStored` (the hashes of blocks just cached, the hash of
the block before the first, their token ids), `BlockRemoved` (hashes evicted) and `AllBlocksCleared`.
Its hashes depend on its `--prefix-caching-hash-algo` and seed, so the control plane keys on Tetri's own
(`tetri.scheduling.prefix`): a stored run of blocks gets its keys by chaining from its parent's key,
which this mirror remembers for every block it holds. What the mirror cannot place is dropped and counted,
never guessed:

* a run whose parent it does not hold (its store was lost, or arrived after this run): an orphan;
* blocks whose identity is more than their tokens (a LoRA adapter, multimodal inputs, a cache salt:
  `extra_keys`), another cache group than the first, another medium than the engine's own (an offload
  tier): foreign;
* token ids that do not fill the run's blocks: malformed.

A hash stored twice (vLLM reports reused blocks again) is stored once; a removal of a hash it does not hold
is ignored. `delta()` is the net change since the last call (the keys stored and removed, disjoint);
`keys()` all of it. At most `max_blocks` blocks are held (the engine cannot hold more than its capacity;
past it, removals were lost): the oldest are dropped as removed.

Pure: plain data in (the events' fields), keys out; `kvevents` reads the events off vLLM's publisher.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tetri.scheduling.prefix import ROOT, block_keys


@dataclass
class MirrorStats:
    stored: int = 0  # blocks taken
    removed: int = 0
    orphans: int = 0  # runs whose parent is not held
    foreign: int = 0  # runs with extra keys, of another group or medium
    malformed: int = 0
    evicted: int = 0  # dropped past max_blocks
    cleared: int = 0


class KVMirror:
    def __init__(self, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max_blocks
        self.block_size = 0  # as the events say (vLLM's hash block size)
        self._key: dict[Hashable, int] = {}  # vLLM block hash -> Tetri key, for every block held (oldest first)
        self._stored: dict[int, None] = {}  # the net change since `delta`
        self._removed: dict[int, None] = {}
        self.stats = MirrorStats()

    def __len__(self) -> int:
        return len(self._key)

    def keys(self) -> list[int]:
        return list(self._key.values())

    def delta(self) -> tuple[list[int], list[int]]:
        stored, removed = list(self._stored), list(self._removed)
        self._stored, self._removed = {}, {}
        return stored, removed

    def stored(
        self,
        hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[object | None] | None = None,
        group: int | None = None,
    ) -> None:
        """A `BlockStored` event: `hashes` just cached, after the block `parent` (None: the sequence's start)."""
        if (extra_keys and any(x is not None for x in extra_keys)) or group not in (None, 0):
            self.stats.foreign += 1
            return
        if block_size < 1 or not hashes or len(token_ids) != len(hashes) * block_size:
            self.stats.malformed += 1
            return
        if parent is None:
            start = ROOT
        else:
            held = self._key.get(parent)
            if held is None:
                self.stats.orphans += 1
                return
            start = held
        self.block_size = block_size
        for h, key in zip(hashes, block_keys(token_ids, block_size, start), strict=True):
            if h in self._key:
                continue
            self._key[h] = key
            self.stats.stored += 1
            if key in self._removed:
                del self._removed[key]
            else:
                self._stored[key] = None
        over = len(self._key) - self.max_blocks
        if over > 0:
            oldest = [h for h, _ in zip(self._key, range(over), strict=False)]
            self.stats.evicted += over
            self.removed(oldest)

    def removed(self, hashes: Sequence[Hashable]) -> None:
        """A `BlockRemoved` event."""
        for h in hashes:
            key = self._key.pop(h, None)
            if key is None:
                continue
            self.stats.removed += 1
            if key in self._stored:
                del self._stored[key]
            else:
                self._removed[key] = None

    def cleared(self) -> None:
        """`AllBlocksCleared` (or events lost for good): nothing is held."""
        self.stats.cleared += 1
        self.removed(list(self._key))
