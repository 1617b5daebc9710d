"""Prefill scheduling (TetriInfer §3.3.1, §3.3.3): request order within PrefillSchedBatch groups and
fixed-size chunked prefill."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.prefill import (
    PREFILL_POLICIES,
    Chunk,
    ChunkedPrefill,
    FixedBatchPrefill,
    PrefillItem,
    order_prefill,
)


def items(lengths: list[int]) -> list[PrefillItem]:
    return [PrefillItem(f"r{i}", n, i) for i, n in enumerate(lengths)]


def drain(cp: ChunkedPrefill, limit: int = 100_000) -> list[tuple[Chunk, list[str]]]:
    out: list[tuple[Chunk, list[str]]] = []
    for _ in range(limit):
        step = cp.next_chunk()
        if step is None:
            return out
        out.append(step)
    raise AssertionError("the chunker never went idle")


def run_order(chunks: list[tuple[Chunk, list[str]]]) -> list[str]:
    """Request ids in the order their first token was scheduled."""
    seen: list[str] = []
    for chunk, _ in chunks:
        for rid, _, _ in chunk.pieces:
            if rid not in seen:
                seen.append(rid)
    return seen


# --- order_prefill ----------------------------------------------------------------------------


def test_fcfs_keeps_arrival_order() -> None:
    queue = items([50, 10, 300, 20, 5])
    shuffled = [queue[3], queue[0], queue[4], queue[2], queue[1]]
    assert order_prefill(shuffled, "fcfs", 2) == queue


def test_sjf_and_ljf_sort_by_prompt_length_within_one_group() -> None:
    queue = items([50, 10, 300, 20, 5])
    assert [x.prompt_len for x in order_prefill(queue, "sjf", 16)] == [5, 10, 20, 50, 300]
    assert [x.prompt_len for x in order_prefill(queue, "ljf", 16)] == [300, 50, 20, 10, 5]


def test_ties_keep_arrival_order() -> None:
    queue = items([10, 10, 5, 10])
    assert [x.request_id for x in order_prefill(queue, "sjf", 8)] == ["r2", "r0", "r1", "r3"]
    assert [x.request_id for x in order_prefill(queue, "ljf", 8)] == ["r0", "r1", "r3", "r2"]


@pytest.mark.parametrize("policy", ["sjf", "ljf"])
def test_paper_example_batch_ten_twenty_queued_gives_two_sorted_groups(policy: str) -> None:
    # descending lengths: the shortest overall arrive last, so a global sort would pull them forward
    lengths = list(range(200, 0, -10))
    assert len(lengths) == 20
    out = order_prefill(items(lengths), policy, 10)
    first, second = out[:10], out[10:]
    assert {x.seq for x in first} == set(range(10))
    assert {x.seq for x in second} == set(range(10, 20))
    key = sorted if policy == "sjf" else (lambda xs: sorted(xs, reverse=True))
    assert [x.prompt_len for x in first] == key(lengths[:10])
    assert [x.prompt_len for x in second] == key(lengths[10:])


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2000), max_size=40),
    batch=st.integers(1, 12),
    policy=st.sampled_from(PREFILL_POLICIES),
)
def test_order_is_a_permutation_sorted_only_inside_groups(lengths: list[int], batch: int, policy: str) -> None:
    queue = items(lengths)
    out = order_prefill(list(reversed(queue)), policy, batch)
    assert sorted(x.seq for x in out) == list(range(len(queue)))
    if policy == "fcfs":
        assert out == queue
        return
    for g in range(0, len(queue), batch):
        group = out[g : g + batch]
        assert {x.seq for x in group} == set(range(g, min(g + batch, len(queue))))
        keys = [x.prompt_len if policy == "sjf" else -x.prompt_len for x in group]
        assert keys == sorted(keys)


def test_order_validates_policy_and_batch() -> None:
    with pytest.raises(ValueError, match="fcfs, sjf, ljf"):
        order_prefill([], "random", 4)
    with pytest.raises(ValueError, match="PrefillSchedBatch"):
        order_prefill([], "sjf", 0)


# --- ChunkedPrefill ---------------------------------------------------------------------------


def test_long_prompt_spans_several_full_chunks_then_a_padded_one() -> None:
    cp = ChunkedPrefill(chunk_size=512)
    cp.add(PrefillItem("a", 1300, 0))
    chunks = drain(cp)
    assert [c.pieces for c, _ in chunks] == [(("a", 0, 512),), (("a", 512, 512),), (("a", 1024, 276),)]
    assert all(c.size == 512 for c, _ in chunks)
    assert [c.padding for c, _ in chunks] == [0, 0, 236]
    assert [done for _, done in chunks] == [[], [], ["a"]]
    assert cp.wasted_tokens == 236
    assert cp.chunks == 3
    assert len(cp) == 0


def test_short_prompts_merge_into_one_chunk() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    for it in items([20, 30, 40]):
        cp.add(it)
    chunk, done = cp.next_chunk()  # type: ignore[misc]
    assert chunk.pieces == (("r0", 0, 20), ("r1", 0, 30), ("r2", 0, 40))
    assert (chunk.size, chunk.padding, chunk.used) == (100, 10, 90)
    assert done == ["r0", "r1", "r2"]
    assert cp.next_chunk() is None


def test_prompt_split_across_a_chunk_boundary_completes_in_the_second_chunk() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    for it in items([60, 70, 30]):
        cp.add(it)
    chunks = drain(cp)
    assert [c.pieces for c, _ in chunks] == [
        (("r0", 0, 60), ("r1", 0, 40)),
        (("r1", 40, 30), ("r2", 0, 30)),
    ]
    assert [done for _, done in chunks] == [["r0"], ["r1", "r2"]]
    assert [c.padding for c, _ in chunks] == [0, 40]


def test_padding_only_where_the_queue_ran_dry() -> None:
    cp = ChunkedPrefill(chunk_size=64)
    cp.add(PrefillItem("a", 100, 0))
    c1, _ = cp.next_chunk()  # type: ignore[misc]
    assert c1.padding == 0  # 36 tokens of "a" still queued
    c2, _ = cp.next_chunk()  # type: ignore[misc]
    assert c2.padding == 28  # the queue ran dry
    cp.add(PrefillItem("b", 64, 1))
    cp.add(PrefillItem("c", 10, 2))
    c3, d3 = cp.next_chunk()  # type: ignore[misc]
    assert (c3.padding, d3) == (0, ["b"])
    c4, d4 = cp.next_chunk()  # type: ignore[misc]
    assert (c4.padding, d4) == (54, ["c"])
    assert cp.wasted_tokens == 28 + 54


def test_late_arrival_fills_the_rest_of_a_chunk() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    cp.add(PrefillItem("a", 150, 0))
    cp.next_chunk()
    cp.add(PrefillItem("b", 30, 1))
    chunk, done = cp.next_chunk()  # type: ignore[misc]
    assert chunk.pieces == (("a", 100, 50), ("b", 0, 30))
    assert done == ["a", "b"]
    assert chunk.padding == 20


def test_idle_chunker_returns_none() -> None:
    cp = ChunkedPrefill(chunk_size=16)
    assert cp.next_chunk() is None
    assert (cp.chunks, cp.wasted_tokens) == (0, 0)


def test_no_padding_gives_a_short_last_chunk_and_no_waste() -> None:
    cp = ChunkedPrefill(chunk_size=100, pad=False)
    for it in items([150, 20]):
        cp.add(it)
    chunks = drain(cp)
    assert [(c.size, c.padding, c.used) for c, _ in chunks] == [(100, 0, 100), (70, 0, 70)]
    assert cp.wasted_tokens == 0


@pytest.mark.parametrize("policy", ["sjf", "ljf"])
def test_second_group_waits_until_the_first_group_is_done(policy: str) -> None:
    lengths = list(range(200, 0, -10))  # 20 requests, the shortest arrive last
    cp = ChunkedPrefill(chunk_size=64, policy=policy, sched_batch=10)
    for it in items(lengths):
        cp.add(it)
    chunks = drain(cp)
    order = run_order(chunks)
    assert order == [x.request_id for x in order_prefill(items(lengths), policy, 10)]
    completed = [rid for _, done in chunks for rid in done]
    assert completed == order
    first = {f"r{i}" for i in range(10)}
    last_chunk_of_first = max(i for i, (_, done) in enumerate(chunks) if first & set(done))
    for i, (chunk, _) in enumerate(chunks):
        if i < last_chunk_of_first:
            assert all(rid in first for rid, _, _ in chunk.pieces), f"chunk {i} runs the second group early"
    # within the chunk that finishes the first group, second-group pieces come after
    pieces = chunks[last_chunk_of_first][0].pieces
    in_first = [rid in first for rid, _, _ in pieces]
    assert in_first == sorted(in_first, reverse=True)


def test_sjf_group_ordered_when_reached_late_arrivals_join_a_later_group() -> None:
    cp = ChunkedPrefill(chunk_size=1000, policy="sjf", sched_batch=3)
    for it in [PrefillItem("a", 900, 0), PrefillItem("b", 300, 1), PrefillItem("c", 200, 2)]:
        cp.add(it)
    chunk, done = cp.next_chunk()  # type: ignore[misc]
    assert [p[0] for p in chunk.pieces] == ["c", "b", "a"]
    assert done == ["c", "b"]
    cp.add(PrefillItem("d", 1, 3))  # shorter than everything, but the group is already ordered
    chunk, done = cp.next_chunk()  # type: ignore[misc]
    assert chunk.pieces == (("a", 500, 400), ("d", 0, 1))
    assert done == ["a", "d"]


def test_remove_drops_queued_and_active_requests() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    for it in items([150, 50, 40]):
        cp.add(it)
    cp.next_chunk()  # r0 half done, everything is active (fcfs takes the whole queue)
    assert cp.remove("r0") is True
    assert cp.remove("r0") is False
    assert cp.remove("nope") is False
    assert len(cp) == 2
    assert cp.pending_tokens() == 90
    chunk, done = cp.next_chunk()  # type: ignore[misc]
    assert chunk.pieces == (("r1", 0, 50), ("r2", 0, 40))
    assert done == ["r1", "r2"]


def test_remove_from_the_waiting_queue() -> None:
    cp = ChunkedPrefill(chunk_size=100, policy="sjf", sched_batch=1)
    for it in items([150, 50, 40]):
        cp.add(it)
    cp.next_chunk()  # only r0's group is active
    assert cp.remove("r1") is True
    chunks = drain(cp)
    assert all(rid != "r1" for c, _ in chunks for rid, _, _ in c.pieces)
    assert [rid for _, done in chunks for rid in done] == ["r0", "r2"]


def test_pending_tokens_counts_what_is_left() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    for it in items([150, 30]):
        cp.add(it)
    assert cp.pending_tokens() == 180
    cp.next_chunk()
    assert cp.pending_tokens() == 80


@pytest.mark.parametrize("bad", [0, -1])
def test_configure_rejects_non_positive_chunk_size(bad: int) -> None:
    cp = ChunkedPrefill(chunk_size=64)
    with pytest.raises(ValueError, match="ChunkSize"):
        cp.configure(bad, "fcfs", 16)
    assert cp.chunk_size == 64  # unchanged on error
    with pytest.raises(ValueError, match="ChunkSize"):
        ChunkedPrefill(chunk_size=bad)


def test_configure_rejects_unknown_policy_and_bad_batch() -> None:
    cp = ChunkedPrefill()
    with pytest.raises(ValueError, match="unknown prefill policy"):
        cp.configure(512, "lifo", 16)
    with pytest.raises(ValueError, match="PrefillSchedBatch"):
        cp.configure(512, "sjf", 0)
    assert (cp.chunk_size, cp.policy, cp.sched_batch) == (512, "fcfs", 16)


def test_configure_changes_later_chunks() -> None:
    cp = ChunkedPrefill(chunk_size=100)
    cp.add(PrefillItem("a", 350, 0))
    c1, _ = cp.next_chunk()  # type: ignore[misc]
    cp.configure(200, "fcfs", 16)
    c2, _ = cp.next_chunk()  # type: ignore[misc]
    c3, done = cp.next_chunk()  # type: ignore[misc]
    assert (c1.size, c2.size, c3.size) == (100, 200, 200)
    assert c2.pieces == (("a", 100, 200),)
    assert c3.pieces == (("a", 300, 50),)
    assert (c3.padding, done) == (150, ["a"])


def test_configure_policy_applies_to_groups_taken_later() -> None:
    cp = ChunkedPrefill(chunk_size=1000, policy="sjf", sched_batch=2)
    for it in items([100, 300, 50, 900]):
        cp.add(it)
    cp.configure(1000, "ljf", 2)
    chunk, _ = cp.next_chunk()  # type: ignore[misc]
    # both groups sorted longest first (sjf would have run r0, r1, r2)
    assert chunk.pieces == (("r1", 0, 300), ("r0", 0, 100), ("r3", 0, 600))


# --- properties -------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=30), chunk_size=st.integers(1, 1024))
def test_fcfs_padded_chunks_cover_every_prompt_token_once(lengths: list[int], chunk_size: int) -> None:
    cp = ChunkedPrefill(chunk_size=chunk_size, policy="fcfs", pad=True)
    for it in items(lengths):
        cp.add(it)
    chunks = drain(cp)
    total = sum(lengths)
    assert sum(c.used for c, _ in chunks) == total
    assert len(chunks) == math.ceil(total / chunk_size) == cp.chunks
    assert all(c.size == chunk_size for c, _ in chunks)
    assert all(c.used == sum(n for _, _, n in c.pieces) for c, _ in chunks)
    assert all(c.padding == 0 for c, _ in chunks[:-1])  # everything was queued up front
    assert cp.wasted_tokens == sum(c.padding for c, _ in chunks) == len(chunks) * chunk_size - total
    # pieces cover each prompt exactly once, in order, and requests run in arrival order
    next_tok = {f"r{i}": 0 for i in range(len(lengths))}
    for chunk, _ in chunks:
        for rid, first, n in chunk.pieces:
            assert n > 0
            assert first == next_tok[rid]
            next_tok[rid] += n
    assert next_tok == {f"r{i}": n for i, n in enumerate(lengths)}
    assert run_order(chunks) == [f"r{i}" for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 800), min_size=1, max_size=25),
    chunk_size=st.integers(1, 512),
    policy=st.sampled_from(PREFILL_POLICIES),
    batch=st.integers(1, 8),
    pad=st.booleans(),
    arrive_every=st.integers(1, 5),
)
def test_completed_lists_each_request_once_in_the_chunk_that_finishes_it(
    lengths: list[int], chunk_size: int, policy: str, batch: int, pad: bool, arrive_every: int
) -> None:
    cp = ChunkedPrefill(chunk_size=chunk_size, policy=policy, sched_batch=batch, pad=pad)
    pending = items(lengths)
    done_tok = {x.request_id: 0 for x in pending}
    completed: list[str] = []
    padding = 0
    step = 0
    while pending or len(cp):
        if step % arrive_every == 0 and pending:
            cp.add(pending.pop(0))  # requests trickle in
        step += 1
        res = cp.next_chunk()
        if res is None:
            continue
        chunk, done = res
        assert chunk.used == sum(n for _, _, n in chunk.pieces) <= chunk_size
        assert chunk.size == (chunk_size if pad else chunk.used)
        if not pad:
            assert chunk.padding == 0
        if chunk.padding:
            assert len(cp) == 0  # padding only when nothing else was queued
        padding += chunk.padding
        for rid, first, n in chunk.pieces:
            assert first == done_tok[rid]
            done_tok[rid] += n
        finished_here = [rid for rid, first, n in chunk.pieces if first + n == lengths[int(rid[1:])]]
        assert done == finished_here
        completed += done
    assert sorted(completed) == sorted(f"r{i}" for i in range(len(lengths)))
    assert done_tok == {f"r{i}": n for i, n in enumerate(lengths)}
    assert cp.wasted_tokens == padding


def test_fixed_batch_takes_whole_prompts_within_the_budget_and_the_first_only_when_asked():
    q = FixedBatchPrefill("sjf", sched_batch=4)
    for seq, n in enumerate((300, 100, 700, 50)):
        q.add(PrefillItem(f"r{seq}", n, seq))
    # sjf within the group of 4: 50, 100, 300, 700
    assert [x.request_id for x in q.next_batch(200)] == ["r3", "r1"]
    assert q.next_batch(200, at_least_one=False) == []  # 300 does not fit: nothing
    assert [x.request_id for x in q.next_batch(200)] == ["r0"]  # alone, over the budget
    assert [x.request_id for x in q.next_batch(512)] == ["r2"]
    assert len(q) == 0
