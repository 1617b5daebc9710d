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

The block sums cᵢ are one numpy product for many blocks at once; the chain is a plain loop over them
(about 0.1 µs a block). `iter_keys` sums 16 blocks first, then twice as many each time, so a caller that
stops at the first block nobody holds (`CacheIndex.match`) hashes little past it, in few numpy calls: in
the daemon, whose other threads (gRPC's, the status writer's) leave the caches cold between its calls,
each numpy call costs several microseconds whatever its size.

It is no cryptographic hash: two different prefixes collide with probability about 2⁻⁶⁴, and someone
could craft a collision. A collision costs a routing choice (the index thinks an instance holds a block
it does not), never an answer: each engine matches its own cache with its own hash.

`keys_from_hash_ids` turns a trace's per-block hash ids (Mooncake's format: one id per `hash_block`
tokens, requests sharing leading ids share that prefix) into keys at an engine's block size, for the
simulator, which has lengths and ids but no tokens.

Pure: plain data in, ints out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from itertools import islice

import numpy as np

MASK = (1 << 64) - 1
ROOT = 0x243F6A8885A308D3  # H₀ of a sequence's first block (π's fraction bits: no other meaning)
K = 0x9E3779B97F4A7C15  # the chain's multiplier (odd: invertible mod 2⁶⁴)
FIRST_CHUNK = 16  # blocks `iter_keys` sums first


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@cache
def _weights(block_size: int) -> np.ndarray:
    """Wₖ for the positions of a block: odd 64-bit constants, the same in every process."""
    return np.array([_splitmix64(0x7E7A1 + k) | 1 for k in range(block_size)], dtype=np.uint64)


def _sums(tokens: Sequence[int] | np.ndarray, block_size: int, first: int, last: int) -> list[int]:
    """cᵢ of blocks `first` … `last − 1` (mod 2⁶⁴: numpy's unsigned products wrap)."""
    part = tokens[first * block_size : last * block_size]
    if isinstance(part, np.ndarray):
        x = part.astype(np.int64).view(np.uint64)
    else:
        x = np.fromiter(part, dtype=np.int64, count=len(part)).view(np.uint64)
    out: list[int] = (x.reshape(last - first, block_size) @ _weights(block_size)).tolist()
    return out


def block_keys(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT, *, first: int = 0, count: int | None = None
) -> list[int]:
    """The keys of `tokens`' full blocks `first` … `first + count − 1` (all the full blocks from `first` by
    default), chained from `parent`, the key of block `first − 1` (ROOT when `first` is 0)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(tokens) // block_size
    last = full if count is None else min(full, first + count)
    return list(islice(iter_keys(tokens, block_size, parent, first=first), max(0, last - first)))


def iter_keys(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT, *, first: int = 0
) -> Iterator[int]:
    """The keys of `tokens`' full blocks from block `first` on, in order, summed `FIRST_CHUNK` blocks first
    and twice as many each time after."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full, h, n = len(tokens) // block_size, parent & MASK, FIRST_CHUNK
    while first < full:
        last = min(full, first + n)
        for c in _sums(tokens, block_size, first, last):
            h = (h * K + c) & MASK
            yield h
        first, n = last, 2 * n


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
