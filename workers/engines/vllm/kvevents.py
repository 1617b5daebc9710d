"""A vLLM engine's KV events, read off its ZMQ publisher into a `KVMirror` (the worker forwards the mirror's
changes to the control plane on its load reports).

The engine publishes on an IPC endpoint of this worker's own (`endpoints`, `KVEventsConfig`); each message
is (topic, sequence number, a msgpack `KVEventBatch`). A gap in the numbers (ZMQ drops messages past its
high-water mark, and what is published before the subscription starts is never seen) is filled from the
publisher's replay endpoint (its ROUTER keeps the last batches); what the replay no longer has is lost
for good, and the mirror is cleared rather than left claiming blocks the lost batches may have evicted. A
batch that does not decode is skipped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .kvmirror import KVMirror

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's ZmqEventPublisher)
REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Endpoints:
    publish: str  # where the engine publishes (it binds)
    replay: str  # where it answers replay requests

    def remove(self) -> None:
        """Remove the sockets' files (ZeroMQ leaves an IPC endpoint's file behind when its socket closes)."""
        for url in (self.publish, self.replay):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(url.removeprefix("ipc://"))


def endpoints(tag: str) -> Endpoints:
    """IPC endpoints of this process's own (short paths: a UNIX socket's is at most ~107 bytes)."""
    base = os.path.join(tempfile.gettempdir(), f"tetri-kv-{os.getpid()}-{tag}")
    return Endpoints(f"ipc://{base}.pub", f"ipc://{base}.replay")


@dataclass
class SubscriberStats:
    batches: int = 0
    replayed: int = 0
    lost: int = 0  # gaps the replay could not fill (the mirror was cleared)
    undecodable: int = 0


class KVEventSubscriber:
    def __init__(self, where: Endpoints, mirror: KVMirror) -> None:
        self.where = where
        self.mirror = mirror
        self.stats = SubscriberStats()
        # vLLM's event types, imported here: importing them loads much of vLLM (and torch)
        from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        self._types = (BlockStored, BlockRemoved, AllBlocksCleared)
        self._primary = (None, MEDIUM_GPU)  # the engine's own cache (not an offload tier's)
        self._ctx = zmq.asyncio.Context()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._last: int | None = None

    async def run(self) -> None:
        """Follow the engine's events until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.where.publish)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.undecodable += 1
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if self._last is not None and seq <= self._last:
                    continue  # seen (a replay brought it already)
                expected = 0 if self._last is None else self._last + 1
                if seq > expected:  # batches missed (published before this subscription, or dropped)
                    await self._fill(expected, seq)
                self._take(payload)
                self._last = seq
        finally:
            sub.close()

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    async def _fill(self, first: int, upto: int) -> None:
        """Ask the publisher's replay endpoint for batches `first` … `upto` − 1; clear the mirror if it no
        longer has them all."""
        got: dict[int, bytes] = {}
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.where.replay)
        try:
            await req.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(req.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if first <= seq < upto:
                    got[seq] = frames[3]
        except (TimeoutError, zmq.ZMQError):
            pass
        finally:
            req.close()
        if sorted(got) != list(range(first, upto)):
            self.stats.lost += 1
            log.warning("vLLM KV events %d … %d were lost: the index forgets this engine's cache", first, upto - 1)
            self.mirror.cleared()
            return
        for seq in range(first, upto):
            self._take(got[seq])
        self.stats.replayed += upto - first

    def _take(self, payload: bytes) -> None:
        try:
            batch: Any = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.undecodable += 1
            return
        self.stats.batches += 1
        m = self.mirror
        stored_t, removed_t, cleared_t = self._types
        for ev in batch.events:
            if isinstance(ev, stored_t):
                if ev.medium not in self._primary:  # an offload tier's copy, not the engine's cache
                    m.stats.foreign += 1
                    continue
                hashes, parent, tokens = ev.block_hashes, ev.parent_block_hash, ev.token_ids
                m.stored(hashes, parent, tokens, ev.block_size, ev.extra_keys, ev.group_idx)
            elif isinstance(ev, removed_t):
                if ev.medium in self._primary and ev.group_idx in (None, 0):
                    m.removed(ev.block_hashes)
            elif isinstance(ev, cleared_t):
                m.cleared()


async def stop(task: asyncio.Task[None] | None, sub: KVEventSubscriber | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if sub is not None:
        sub.close()
