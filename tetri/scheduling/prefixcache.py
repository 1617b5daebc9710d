"""One instance's prefix cache, as the sim engine and the simulator model vLLM's (automatic prefix caching).

KV lives in blocks of `block_size` tokens. A prompt's full blocks, once computed (or loaded from a
hand-over), are cached under their keys (`tetri.scheduling.prefix`); a later request whose prompt starts
with the same blocks references them instead of computing them (a hit), as far as its leading blocks are
cached and at most all but its last token (`prefix.cacheable_blocks`). A block referenced by requests
here is **pinned**; when the last one lets go (finished, preempted, its hand-over pulled) it stays cached
but **free**: its memory counts as free space, and it is evicted, least recently freed first, when the
space is needed (vLLM frees a request's blocks last block first, so a prefix outlives its tails). The
cache lives inside the instance's KV: pinned blocks count in its used KV (once, however many requests
share them), free ones in the room left. A block computed again while it is cached (its prefix was not
all cached when the request started) stays the request's own copy, as in vLLM.

`InstanceScheduler` owns one and does the KV accounting; this holds the keys and says what changed:
`drain()` gives the keys cached and evicted since the last drain (the events a worker forwards to the
control plane's index), `query_tokens` and `hit_tokens` count prompt tokens looked up and found, for new
requests only (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # pinned: key -> requests here referencing it
        self._free: dict[int, None] = {}  # cached, referenced by none: the least recently freed first
        # the net change since `drain` (disjoint: a key evicted and cached again is in neither)
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def pinned(self) -> int:
        """Blocks referenced by requests here."""
        return len(self._refs)

    @property
    def free(self) -> int:
        """Blocks cached and referenced by none (evictable)."""
        return len(self._free)

    def __contains__(self, key: object) -> bool:
        return key in self._refs or key in self._free

    def keys(self) -> list[int]:
        """Every cached key (pinned and free)."""
        return [*self._refs, *self._free]

    def lookup(self, keys: Sequence[int], limit: int) -> int:
        """How many of `keys`' leading blocks are cached, at most `limit`."""
        n = 0
        refs, free = self._refs, self._free
        for key in keys[:limit]:
            if key not in refs and key not in free:
                break
            n += 1
        return n

    def pinned_among(self, keys: Sequence[int]) -> int:
        """How many of these cached blocks are pinned (referenced here already: no new memory to share)."""
        refs = self._refs
        return sum(1 for key in keys if key in refs)

    def acquire(self, keys: Sequence[int]) -> int:
        """A request references these cached blocks (its hits); how many of them were free (now pinned:
        their memory is used again)."""
        revived = 0
        refs, free = self._refs, self._free
        for key in keys:
            n = refs.get(key)
            if n is None:
                del free[key]
                refs[key] = 1
                revived += 1
            else:
                refs[key] = n + 1
        return revived

    def insert(self, key: int) -> bool:
        """A request computed (or loaded) this block: cache it, referenced by the request. False when the key
        is cached already (the request keeps its own copy)."""
        if key in self._refs or key in self._free:
            return False
        self._refs[key] = 1
        if key in self._removed:  # evicted and cached again since the last drain: no change to report
            del self._removed[key]
        else:
            self._stored[key] = None
        return True

    def release(self, keys: Sequence[int]) -> int:
        """A request lets go of these blocks (last block first); how many became free."""
        freed = 0
        refs, free = self._refs, self._free
        for key in reversed(keys):
            n = refs[key] - 1
            if n:
                refs[key] = n
            else:
                del refs[key]
                free[key] = None
                freed += 1
        return freed

    def evict(self, room_blocks: int) -> None:
        """Evict free blocks, the least recently freed first, until at most `room_blocks` are left."""
        free = self._free
        while len(free) > max(0, room_blocks):
            key = next(iter(free))
            del free[key]
            if key in self._stored:  # cached and evicted since the last drain: no change to report
                del self._stored[key]
            else:
                self._removed[key] = None

    def drain(self) -> tuple[list[int], list[int]]:
        """The keys cached and evicted since the last drain (the events for the control plane's index):
        the net change, so the two lists are disjoint and either may be applied first."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored, self._removed = {}, {}
        return stored, removed
