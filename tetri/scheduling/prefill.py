"""Prefill-instance scheduling (TetriInfer §3.3): the local scheduler's order and fixed-size chunks.

* Order: ``fcfs``, ``sjf`` or ``ljf`` (by prompt length) within groups of PrefillSchedBatch queued
  requests taken in arrival order — sorting only inside a group bounds how long anyone waits (no
  starvation): with batch 10, twenty queued requests are scheduled as two sorted groups.
* Chunks: each iteration runs exactly ChunkSize tokens: prompts are sliced and merged into chunks in
  scheduling order; a partial last chunk is padded to ChunkSize and the padding is wasted compute.
* `FixedBatchPrefill`: chunked prefill off (vLLM's fixed batch, the ablation): whole prompts in the same
  order, up to a token budget per iteration.

Pure: plain data in, decisions out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL_POLICIES = ("fcfs", "sjf", "ljf")


@dataclass(frozen=True)
class PrefillItem:
    request_id: str
    prompt_len: int
    seq: int  # arrival order
    cached: int = 0  # leading prompt tokens the prefix cache holds: the prefill starts after them

    @property
    def work(self) -> int:
        """The prompt tokens its prefill computes (what sjf / ljf order by)."""
        return self.prompt_len - self.cached


def order_prefill(queue: Sequence[PrefillItem], policy: str, sched_batch: int) -> list[PrefillItem]:
    """The scheduling order of the queued requests (queue given in arrival order)."""
    if policy not in PREFILL_POLICIES:
        raise ValueError(f"unknown prefill policy {policy!r} (choose from {', '.join(PREFILL_POLICIES)})")
    if sched_batch < 1:
        raise ValueError("PrefillSchedBatch must be at least 1")
    arrival = sorted(queue, key=lambda x: x.seq)
    if policy == "fcfs":
        return arrival
    out: list[PrefillItem] = []
    for g in range(0, len(arrival), sched_batch):
        group = arrival[g : g + sched_batch]
        out += sorted(group, key=lambda x: (x.work if policy == "sjf" else -x.work, x.seq))
    return out


@dataclass(frozen=True)
class Chunk:
    """One prefill iteration: (request id, first token, tokens) pieces, plus padding tokens."""

    pieces: tuple[tuple[str, int, int], ...]
    size: int
    padding: int

    @property
    def used(self) -> int:
        return self.size - self.padding


@dataclass
class _Progress:
    item: PrefillItem
    done: int = 0

    def __post_init__(self) -> None:
        self.done = max(self.done, self.item.cached)  # the cached tokens are not computed


@dataclass
class ChunkedPrefill:
    """The prefill instance's queue and chunker. `add` requests as they arrive; `next_chunk` gives the
    next iteration's work and `completed` the requests whose prompt the last chunk finished.

    A group of PrefillSchedBatch requests is ordered when the scheduler first reaches it and is then
    worked through in that order (later arrivals join a later group)."""

    chunk_size: int = 512
    policy: str = "fcfs"
    sched_batch: int = 16
    pad: bool = True  # pad the last partial chunk (TetriInfer); False = a short last iteration
    _queue: list[PrefillItem] = field(default_factory=list)
    _active: deque[_Progress] = field(default_factory=deque)
    wasted_tokens: int = 0
    chunks: int = 0

    def __post_init__(self) -> None:
        self.configure(self.chunk_size, self.policy, self.sched_batch)

    def configure(self, chunk_size: int, policy: str, sched_batch: int) -> None:
        """Change the knobs at runtime (policy hot-swap); work already ordered keeps its order."""
        if chunk_size < 1:
            raise ValueError("ChunkSize must be at least 1")
        order_prefill([], policy, sched_batch)  # validates
        self.chunk_size, self.policy, self.sched_batch = chunk_size, policy, sched_batch

    def add(self, item: PrefillItem) -> None:
        self._queue.append(item)

    def remove(self, request_id: str) -> bool:
        before = len(self._queue) + len(self._active)
        self._queue = [x for x in self._queue if x.request_id != request_id]
        self._active = deque(p for p in self._active if p.item.request_id != request_id)
        return len(self._queue) + len(self._active) < before

    def __len__(self) -> int:
        return len(self._queue) + len(self._active)

    def pending_tokens(self) -> int:
        return sum(x.work for x in self._queue) + sum(p.item.prompt_len - p.done for p in self._active)

    def _take_group(self) -> None:
        """Order the next PrefillSchedBatch queued requests (fcfs: all of them, in arrival order)."""
        group = self._queue if self.policy == "fcfs" else self._queue[: self.sched_batch]
        ordered = order_prefill(group, self.policy, self.sched_batch)
        self._queue = self._queue[len(group) :]
        self._active.extend(_Progress(x) for x in ordered)

    def next_chunk(self) -> tuple[Chunk, list[str]] | None:
        """The next iteration: a chunk, and the ids whose prompts it completes. None when idle."""
        if not self._active:
            self._take_group()
        if not self._active:
            return None
        room = self.chunk_size
        pieces: list[tuple[str, int, int]] = []
        completed: list[str] = []
        while room and (self._active or self._queue):
            if not self._active:
                self._take_group()
            p = self._active[0]
            n = min(room, p.item.prompt_len - p.done)
            pieces.append((p.item.request_id, p.done, n))
            p.done += n
            room -= n
            if p.done == p.item.prompt_len:
                completed.append(p.item.request_id)
                self._active.popleft()
        padding = room if self.pad else 0
        self.wasted_tokens += padding
        self.chunks += 1
        size = self.chunk_size if self.pad else self.chunk_size - room
        return Chunk(tuple(pieces), size, padding), completed


class FixedBatchPrefill:
    """Chunked prefill off (vLLM's fixed-batch prefill): whole prompts, never split nor padded, in the
    order `ChunkedPrefill` schedules them (fcfs, or sjf / ljf within PrefillSchedBatch groups taken in
    arrival order and sorted when first reached), up to a token budget per iteration, at least one."""

    wasted_tokens = 0  # whole prompts: nothing is padded

    def __init__(self, policy: str = "fcfs", sched_batch: int = 16) -> None:
        order_prefill([], policy, sched_batch)  # validates
        self.policy, self.sched_batch = policy, sched_batch
        self._queue: list[PrefillItem] = []  # not yet reached, arrival order
        self._active: deque[PrefillItem] = deque()  # reached groups, in scheduling order

    def configure(self, policy: str, sched_batch: int) -> None:
        order_prefill([], policy, sched_batch)  # validates
        self.policy, self.sched_batch = policy, sched_batch

    def __len__(self) -> int:
        return len(self._queue) + len(self._active)

    def add(self, item: PrefillItem) -> None:
        self._queue.append(item)

    def remove(self, request_id: str) -> bool:
        before = len(self)
        self._queue = [x for x in self._queue if x.request_id != request_id]
        self._active = deque(x for x in self._active if x.request_id != request_id)
        return len(self) < before

    def drain(self) -> list[PrefillItem]:
        """Everything queued, in the current order; the queue is left empty."""
        items = [*self._active, *self._queue]
        self._queue, self._active = [], deque()
        return items

    def _take_group(self) -> None:
        group = self._queue if self.policy == "fcfs" else self._queue[: self.sched_batch]
        self._active.extend(order_prefill(group, self.policy, self.sched_batch))
        self._queue = self._queue[len(group) :]

    def next_batch(self, budget: int, at_least_one: bool = True) -> list[PrefillItem]:
        """Whole prompts in scheduling order while they fit ``budget``; the first one even if it does not
        (unless ``at_least_one`` is False: then nothing that does not fit)."""
        out: list[PrefillItem] = []
        used = 0
        while self._active or self._queue:
            if not self._active:
                self._take_group()
            item = self._active[0]
            if (out or not at_least_one) and used + item.work > budget:
                break
            out.append(self._active.popleft())
            used += item.work
            if used >= budget:
                break
        return out
