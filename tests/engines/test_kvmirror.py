"""The vLLM worker's mirror of its engine's prefix cache (`workers.engines.vllm.kvmirror`), fed vLLM's KV
events as plain data: keys chain from a run's parent as Tetri's block keys do; what it cannot place (an
orphan run, foreign or malformed events) is dropped and counted, never guessed; duplicates and unknown
removals change nothing; it stays within its bound; its delta is the net change."""

from __future__ import annotations

from tetri.scheduling.prefix import block_keys
from workers.engines.vllm.kvmirror import KVMirror

B = 4


def test_runs_chain_from_their_parent_as_one_sequence_would():
    m = KVMirror()
    tokens = list(range(100, 124))  # 6 blocks
    m.stored([b"h0", b"h1"], None, tokens[:8], B)
    m.stored([b"h2", b"h3", b"h4"], b"h1", tokens[8:20], B)
    assert m.keys() == block_keys(tokens[:20], B)
    stored, removed = m.delta()
    assert stored == block_keys(tokens[:20], B) and removed == []
    m.stored([b"h2"], b"h1", tokens[8:12], B)  # vLLM reports a reused block again: stored once
    assert len(m) == 5 and m.delta() == ([], [])


def test_what_cannot_be_placed_is_dropped_and_counted():
    m = KVMirror()
    m.stored([b"x1"], b"unknown", list(range(4)), B)  # its parent's store was lost
    m.stored([b"y0"], None, list(range(4)), B, extra_keys=[("lora", "a")])  # more than its tokens
    m.stored([b"z0"], None, list(range(4)), B, group=1)  # another cache group
    m.stored([b"w0", b"w1"], None, list(range(5)), B)  # tokens that do not fill the blocks
    assert len(m) == 0 and m.delta() == ([], [])
    assert (m.stats.orphans, m.stats.foreign, m.stats.malformed) == (1, 2, 1)
    m.removed([b"nothing"])  # a removal of a block it does not hold
    assert m.stats.removed == 0


def test_the_delta_is_the_net_change_and_cleared_removes_everything():
    m = KVMirror()
    m.stored([b"a0", b"a1"], None, list(range(8)), B)
    keys = m.keys()
    m.delta()
    m.removed([b"a1"])
    m.stored([b"a1"], b"a0", list(range(4, 8)), B)  # evicted and cached again before the next report
    assert m.delta() == ([], [])
    m.stored([b"b0"], None, [9, 9, 9, 9], B)
    m.removed([b"b0"])  # cached and evicted before the next report
    assert m.delta() == ([], [])
    m.cleared()
    assert len(m) == 0 and sorted(m.delta()[1]) == sorted(keys)


def test_it_holds_at_most_its_bound():
    m = KVMirror(max_blocks=3)
    m.stored([f"h{i}".encode() for i in range(5)], None, list(range(20)), B)
    assert m.keys() == block_keys(list(range(20)), B)[2:] and m.stats.evicted == 2
    stored, removed = m.delta()
    assert stored == block_keys(list(range(20)), B)[2:] and removed == []  # never reported, never removed
