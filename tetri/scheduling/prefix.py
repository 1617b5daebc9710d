"""Prefix-cache keys: Tetri's own chained hash of a prompt's full blocks of tokens.

An engine caches a prompt's KV by block (vLLM: `block_size` tokens, 16 on GPUs); a block can be reused by
a later prompt only with every block before it, so a block's identity is its tokens *and* everything
before them. Key i of a token sequence covers its first (i + 1) · block_size tokens:

    H₀ = parent (ROOT for a sequence's start),  Hᵢ = Hᵢ₋₁ · K + cᵢ  (mod 2⁶⁴),  cᵢ = Σₖ tᵢₖ · Wₖ  (mod 2⁶⁴)

with fixed odd constants K and Wₖ (`_weights`). The same tokens give the same keys in every process and
on every host, whatever the engine's own hash algorithm and seed (vLLM's block hashes depend on its
`--prefix-caching-hash-algo` and `PYTHONHASHSEED`): the control plane's index (`CacheIndex`), the sim
engine's block cache and the vLLM worker's translation of vLLM's KV events all key on these. A partial
last block has no key (engines cache full blocks only).

The recurrence is linear, so a whole prompt's keys are a few vectorised numpy operations
(Hᵢ = Kⁱ · (H₀ + Σⱼ≤ᵢ cⱼ · K⁻ʲ)). It is no cryptographic hash: two different prefixes collide with
probability about 2⁻⁶⁴, and someone could craft a collision. A collision costs a routing choice (the
index thinks an instance holds a block it does not), never an answer: each engine matches its own cache
with its own hash.

`keys_from_hash_ids` turns a trace's per-block hash ids (Mooncake's format: one id per `hash_block`
tokens, requests sharing leading ids share that prefix) into keys at an engine's block size, for the
simulator, which has lengths and ids but no tokens.

Pure: plain data in, ints out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache

import numpy as np

MASK = (1 << 64) - 1
ROOT = 0x243F6A8885A308D3  # H₀ of a sequence's first block (π's fraction bits: no other meaning)
K = 0x9E3779B97F4A7C15  # the chain's multiplier (odd: invertible mod 2⁶⁴)
_K_INV = pow(K, -1, 1 << 64)
CHUNK = 64  # blocks keyed at a time by `iter_keys`
FIRST_CHUNK = 16  # and the first time


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@cache
def _weights(block_size: int) -> np.ndarray:
    """Wₖ for the positions of a block: odd 64-bit constants, the same in every process."""
    return np.array([_splitmix64(0x7E7A1 + k) | 1 for k in range(block_size)], dtype=np.uint64)


_POW_N = 0
_K_POW = np.ones(1, dtype=np.uint64)
_K_INV_POW = np.ones(1, dtype=np.uint64)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Kⁱ and K⁻ⁱ for i = 0 … n (grown on demand, doubling)."""
    global _POW_N, _K_POW, _K_INV_POW
    if n > _POW_N:
        size = max(n, 2 * _POW_N, 256)
        kp, ki = [1], [1]
        for _ in range(size):
            kp.append(kp[-1] * K & MASK)
            ki.append(ki[-1] * _K_INV & MASK)
        _K_POW, _K_INV_POW, _POW_N = np.array(kp, dtype=np.uint64), np.array(ki, dtype=np.uint64), size
    return _K_POW, _K_INV_POW


def block_keys(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT, *, first: int = 0, count: int | None = None
) -> list[int]:
    """The keys of `tokens`' full blocks `first` … `first + count − 1` (all the full blocks from `first` by
    default), chained from `parent`, the key of block `first − 1` (ROOT when `first` is 0)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(tokens) // block_size
    last = full if count is None else min(full, first + count)
    n = last - first
    if n <= 0:
        return []
    part = tokens[first * block_size : last * block_size]
    if isinstance(part, np.ndarray):
        x = part.astype(np.uint64)
    else:
        x = np.fromiter(part, dtype=np.int64, count=n * block_size).astype(np.uint64)
    c = (x.reshape(n, block_size) * _weights(block_size)).sum(axis=1, dtype=np.uint64)
    kp, ki = _powers(n)
    s = np.cumsum(c * ki[1 : n + 1], dtype=np.uint64)
    h = kp[1 : n + 1] * (s + np.uint64(parent & MASK))
    out: list[int] = h.tolist()
    return out


def iter_keys(
    tokens: Sequence[int], block_size: int, chunk: int = CHUNK, first_chunk: int = FIRST_CHUNK
) -> Iterator[int]:
    """The keys of `tokens`' full blocks in order, computed `first_chunk` blocks, then `chunk` blocks at a
    time: a caller that stops at the first block nobody holds (`CacheIndex.match`) hashes little more than
    what matched. (One numpy call costs about 10 µs whatever its size up to a few dozen blocks: a first
    chunk of 16 keeps a short prompt to one call and a long one nobody has seen to one small call.)"""
    parent, first, full, n = ROOT, 0, len(tokens) // block_size, first_chunk
    while first < full:
        keys = block_keys(tokens, block_size, parent, first=first, count=n)
        yield from keys
        parent, first, n = keys[-1], first + len(keys), chunk


def keys_from_hash_ids(hash_ids: Sequence[int], hash_block: int, prompt_len: int, block_size: int) -> tuple[int, ...]:
    """Keys for an engine's `block_size` from a trace's hash ids, one per `hash_block` tokens of the prompt
    (Mooncake: 512; requests sharing leading ids share that prefix). Engine block j ends at token
    e = (j + 1) · block_size; its key chains the ids of the hash blocks it reaches into and how far into the
    last, so two prompts get equal keys exactly as far as their ids say their tokens are equal. Only the
    prompt's full blocks that the ids cover get a key."""
    if hash_block < 1 or block_size < 1:
        raise ValueError("hash_block and block_size must be positive")
    covered = min(prompt_len, len(hash_ids) * hash_block)
    keys: list[int] = []
    h = ROOT
    for j in range(covered // block_size):
        end = (j + 1) * block_size
        i = (end - 1) // hash_block
        h = _splitmix64(h ^ _splitmix64((int(hash_ids[i]) & MASK) ^ (end - i * hash_block) << 1))
        keys.append(h)
    return tuple(keys)


def cacheable_blocks(context: int, block_size: int) -> int:
    """How many leading full blocks of a `context`-token sequence a cache hit may cover: an engine computes
    at least one token (vLLM caps a hit at context − 1 tokens)."""
    return max(0, context - 1) // block_size
