"""Tetri's block keys (`tetri.scheduling.prefix`): a block's key is its tokens and everything before them,
the same in every process; a chain continues from a parent key; a trace's hash ids give keys as far as its
ids say two prompts are equal."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tetri.scheduling.prefix import ROOT, block_keys, cacheable_blocks, iter_keys, keys_from_hash_ids

token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=300)


@given(tokens=token_lists, block=st.sampled_from([1, 4, 16, 128]), cut=st.integers(0, 30))
def test_a_chain_continues_from_any_block_and_stops_at_the_last_full_one(tokens, block, cut):
    keys = block_keys(tokens, block)
    assert len(keys) == len(tokens) // block
    cut = min(cut, len(keys))
    head = block_keys(tokens, block, count=cut)
    tail = block_keys(tokens, block, head[-1] if head else ROOT, first=cut)
    assert head + tail == keys
    assert list(iter_keys(tokens, block)) == keys
    assert list(iter_keys(tokens, block, head[-1] if head else ROOT, first=cut)) == tail
    assert block_keys(np.array(tokens, dtype=np.int64), block) == keys
    assert all(0 <= k < 2**64 for k in keys)


@given(a=token_lists, b=token_lists, block=st.sampled_from([1, 2, 16]))
def test_two_prompts_share_exactly_the_keys_of_the_blocks_they_share(a, b, block):
    ka, kb = block_keys(a, block), block_keys(b, block)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    for j in range(min(len(ka), len(kb))):
        assert (ka[j] == kb[j]) == ((j + 1) * block <= common)


def test_keys_are_the_same_in_another_process():
    tokens = list(range(1000, 1400))
    code = "from tetri.scheduling.prefix import block_keys; print(block_keys(list(range(1000, 1400)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == str(block_keys(tokens, 16))


def test_hash_ids_give_equal_keys_as_far_as_the_ids_agree():
    a = keys_from_hash_ids([7, 8, 9], 512, 1536, 16)
    b = keys_from_hash_ids([7, 8, 10], 512, 1536, 16)
    assert len(a) == 96
    assert a[:64] == b[:64] and all(x != y for x, y in zip(a[64:], b[64:], strict=True))
    # an engine block straddling two hash blocks (block 96 tokens, hash blocks of 64)
    c, d = keys_from_hash_ids([1, 2, 3], 64, 192, 96), keys_from_hash_ids([1, 5, 3], 64, 192, 96)
    assert c[0] != d[0]  # its last token is in the second hash block, where the ids differ
    # only the prompt's full blocks that the ids cover
    assert len(keys_from_hash_ids([1], 512, 100, 16)) == 6
    assert len(keys_from_hash_ids([1, 2], 16, 1000, 16)) == 2


def test_a_hit_leaves_at_least_one_token_to_compute():
    assert [cacheable_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]
