"""The control plane's prefix-cache index (`tetri.scheduling.cacheindex`): what the instances' batches of
KV events say they hold, matched against a prompt; batches out of turn, floods and lost batches never
make it claim a block an instance does not hold, and its memory stays bounded; a front replaying the
controller's log holds what the controller holds."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.cacheindex import MAX_BATCH, CacheEvents, CacheIndex
from tetri.scheduling.prefix import block_keys

B = 16


def prompt(group: int, n: int) -> list[int]:
    return [group * 10_000 + i for i in range(n)]


def test_match_counts_each_candidates_leading_blocks():
    idx = CacheIndex()
    for iid in ("a", "b", "c"):
        idx.limit(iid, B, 1000)
    keys = block_keys(prompt(1, 160), B)  # 10 blocks
    assert idx.apply("a", CacheEvents(1, 0, reset=True, stored=tuple(keys[:6])))
    assert idx.apply("b", CacheEvents(2, 0, reset=True, stored=tuple(keys)))
    assert idx.apply("c", CacheEvents(3, 0, reset=True, stored=tuple(keys[1:])))  # no first block: no hit
    assert idx.match(prompt(1, 170), ["a", "b", "c"]) == {"a": 6, "b": 10}
    assert idx.match(prompt(1, 170), ["a", "c"]) == {"a": 6}
    assert idx.match(prompt(2, 170), ["a", "b", "c"]) == {}
    assert idx.match(prompt(1, 15), ["a", "b"]) == {}  # no full block
    assert idx.apply("b", CacheEvents(2, 1, removed=(keys[3],)))
    assert idx.match(prompt(1, 170), ["b"]) == {"b": 3}


def test_batches_out_of_turn_are_ignored_and_a_gap_empties_the_instance():
    idx = CacheIndex()
    idx.limit("a", B)
    keys = block_keys(prompt(1, 320), B)
    assert idx.apply("a", CacheEvents(5, 0, reset=True, stored=tuple(keys[:4])))
    assert idx.apply("a", CacheEvents(5, 1, stored=tuple(keys[4:8])))
    assert not idx.apply("a", CacheEvents(5, 1, stored=tuple(keys[4:8])))  # a duplicate
    assert not idx.apply("a", CacheEvents(5, 0, reset=True, stored=()))  # an old reset of this epoch
    assert not idx.apply("a", CacheEvents(4, 9, removed=tuple(keys)))  # a stale stream's
    assert idx.blocks("a") == 8 and idx.stats.ignored == 3
    assert idx.apply("a", CacheEvents(5, 3, stored=tuple(keys[8:10])))  # batch 2 was lost
    assert idx.stats.gaps == 1 and idx.keys("a") == keys[8:10]  # what it said before is not trusted
    assert idx.match(prompt(1, 320), ["a"]) == {}
    assert idx.apply("a", CacheEvents(6, 0, reset=True, stored=tuple(keys[:2])))  # the worker reconnected
    assert idx.keys("a") == keys[:2]


def test_an_instance_holds_at_most_its_limit_and_a_flood_is_not_applied():
    idx = CacheIndex()
    idx.limit("a", B, capacity_blocks=50)  # at most 100 keys
    keys = block_keys(prompt(1, 16 * 300), B)
    assert idx.apply("a", CacheEvents(1, 0, reset=True, stored=tuple(keys)))
    assert idx.blocks("a") == 100 and idx.keys("a") == keys[200:]  # the oldest went first
    flood = tuple(random.Random(0).getrandbits(64) for _ in range(MAX_BATCH + 1))
    assert not idx.apply("a", CacheEvents(1, 1, stored=flood))
    assert idx.blocks("a") == 0 and idx.stats.floods == 1
    assert idx.apply("a", CacheEvents(1, 2, stored=tuple(keys[:3])))  # and it goes on from there
    assert idx.blocks("a") == 3


def test_drop_forgets_an_instance_and_frees_its_slot():
    idx = CacheIndex()
    keys = tuple(block_keys(prompt(1, 64), B))
    for iid in ("a", "b"):
        idx.limit(iid, B)
        idx.apply(iid, CacheEvents(1, 0, reset=True, stored=keys))
    idx.drop("a")
    assert "a" not in idx and idx.match(prompt(1, 64), ["a", "b"]) == {"b": 4}
    idx.limit("c", B)
    idx.apply("c", CacheEvents(1, 0, reset=True, stored=keys[:1]))
    assert idx.match(prompt(1, 64), ["b", "c"]) == {"b": 4, "c": 1}
    assert set(idx._mask) == set(keys)


ops = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["reset", "next", "dup", "gap", "stale", "drop"]),
        st.lists(st.integers(0, 40), max_size=12),
        st.lists(st.integers(0, 40), max_size=6),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, log=st.sampled_from([3, 4096]))
def test_the_index_never_claims_what_an_instance_does_not_hold_and_fronts_follow_it(ops, log):
    """Each instance's cache is a set driven by the batches its worker sends in turn; whatever arrives
    (duplicates, stale epochs, a batch lost and the next one), what the index says an instance holds is a
    subset of its set once the batch after a lost one has arrived. A
    front following the log (or a snapshot when it fell behind) holds exactly what the controller holds."""
    pool = block_keys(prompt(1, 41 * B), B)
    idx, front = CacheIndex(log_entries=log), CacheIndex()
    truth: dict[str, set[int]] = {}
    epoch: dict[str, int] = {}
    seq: dict[str, int] = {}
    cursor = 0
    for iid, how, stored, removed in ops:
        s = {pool[i] for i in stored}
        r = {pool[i] for i in removed} - s
        if how == "drop":
            idx.drop(iid)
            truth.pop(iid, None)
            epoch.pop(iid, None)
        elif how == "reset" or iid not in epoch:
            epoch[iid] = epoch.get(iid, 0) + 1
            seq[iid] = 0
            truth[iid] = set(s)
            idx.limit(iid, B)
            assert idx.apply(iid, CacheEvents(epoch[iid], 0, reset=True, stored=tuple(s)))
        else:
            truth[iid] = (truth[iid] | s) - r
            seq[iid] += 1
            if how == "gap":  # this batch is lost on the way; the next one (nothing new in it) shows it
                seq[iid] += 1
                assert idx.apply(iid, CacheEvents(epoch[iid], seq[iid]))
            else:
                idx.apply(iid, CacheEvents(epoch[iid], seq[iid], stored=tuple(s), removed=tuple(r)))
            if how == "dup":
                assert not idx.apply(iid, CacheEvents(epoch[iid], seq[iid], stored=tuple(s), removed=tuple(r)))
            if how == "stale":
                assert not idx.apply(iid, CacheEvents(epoch[iid] - 1, seq[iid] + 1, stored=tuple(pool)))
        for i in idx.instances():
            assert set(idx.keys(i)) <= truth.get(i, set()), i
        changes = idx.since(cursor)
        if changes is None:
            front.forget_all()
            changes = idx.snapshot()
        for c in changes:
            front.replay(c)
        cursor = idx.cursor
        assert {i: set(idx.keys(i)) for i in idx.instances() if idx.keys(i)} == {
            i: set(front.keys(i)) for i in front.instances() if front.keys(i)
        }


def test_the_relay_log_is_bounded_in_changes_and_in_keys():
    idx = CacheIndex(log_entries=100, log_keys=50)
    idx.limit("a", B)
    keys = block_keys(prompt(1, 16 * 80), B)
    idx.apply("a", CacheEvents(1, 0, reset=True, stored=tuple(keys[:30])))
    cursor = idx.cursor
    idx.apply("a", CacheEvents(1, 1, stored=tuple(keys[30:60])))  # 60 keys logged: the first change goes
    assert sum(len(c.stored) + len(c.removed) for c in idx.log) <= 50
    assert idx.since(0) is None  # fallen behind: a snapshot
    assert [len(c.stored) for c in idx.since(cursor) or []] == [30]
    assert sorted(k for c in idx.snapshot() for k in c.stored) == sorted(keys[:60])
