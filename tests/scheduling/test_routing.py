"""The global scheduler's choice (TetriInfer §3.2): `least_loaded` over snapshots, and the same rule kept
as an index (`MinIndex` of `load_key`s), which must choose exactly what `least_loaded` chooses over the
same loads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.minindex import MinIndex
from tetri.scheduling.routing import InstanceLoad, least_loaded, load_key

IDS = [f"p{i}" for i in range(6)]


def test_least_loaded_counts_inflight_and_queue_then_kv_then_id() -> None:
    loads = [
        InstanceLoad("p0", queued=1, inflight=1),
        InstanceLoad("p1", queued=0, inflight=1, kv_used_tokens=50, kv_capacity_tokens=100),
        InstanceLoad("p2", queued=1, inflight=0, kv_used_tokens=10, kv_capacity_tokens=100),
        InstanceLoad("p3", inflight=1, kv_used_tokens=10, kv_capacity_tokens=100),
    ]
    assert least_loaded(loads) == "p2"  # load 1 each for p1, p2, p3; least KV; then id over p3
    assert least_loaded([]) is None
    assert MinIndex(map(load_key, loads)).best() == "p2"
    assert MinIndex().best() is None


def test_best_skips_the_excluded_and_keeps_them() -> None:
    idx = MinIndex(map(load_key, [InstanceLoad("a"), InstanceLoad("b", queued=1), InstanceLoad("c", queued=2)]))
    assert idx.best(frozenset({"a"})) == "b"
    assert idx.best(frozenset({"a", "b"})) == "c"
    assert idx.best(frozenset({"a", "b", "c"})) is None
    assert idx.best() == "a"  # set aside, not lost
    idx.remove("a")
    assert idx.best() == "b" and "a" not in idx and len(idx) == 2


op = st.one_of(
    st.tuples(
        st.just("set"),
        st.sampled_from(IDS),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 100),
        st.sampled_from([0, 100]),
    ),
    st.tuples(st.just("remove"), st.sampled_from(IDS)),
    st.tuples(st.just("best"), st.frozensets(st.sampled_from(IDS), max_size=3)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=80))
def test_the_index_chooses_what_least_loaded_chooses(ops: list[tuple]) -> None:
    idx, current = MinIndex(), dict[str, InstanceLoad]()
    for o in ops:
        if o[0] == "set":
            _, iid, queued, inflight, kv, cap = o
            current[iid] = InstanceLoad(
                iid, queued=queued, inflight=inflight, kv_used_tokens=kv, kv_capacity_tokens=cap
            )
            idx.set(load_key(current[iid]))
        elif o[0] == "remove":
            current.pop(o[1], None)
            idx.remove(o[1])
        else:
            exclude = o[1]
            assert idx.best(exclude) == least_loaded([x for x in current.values() if x.instance_id not in exclude])
        assert sorted(idx) == sorted(current)


def test_superseded_keys_are_compacted() -> None:
    idx = MinIndex(map(load_key, [InstanceLoad("a"), InstanceLoad("b")]))
    for n in range(10_000):
        idx.set(load_key(InstanceLoad("a", queued=n % 7)))
    assert len(idx._heap) <= 2 * len(idx) + 17
    assert idx.best() == "b"


# --- the per-request P/D choice -------------------------------------------------------------------------
def test_the_path_is_the_only_one_open_whatever_the_route() -> None:
    from tetri.scheduling.routing import PD_ROUTES, choose_path

    c, p = InstanceLoad("c0"), InstanceLoad("p0")
    for route in PD_ROUTES:
        assert choose_path(route, 10, None, c, None, 1024, 0) == "colocated"
        assert choose_path(route, 5000, None, None, p, 1024, 0) == "split"
        assert choose_path(route, 10, None, None, None, 1024, 0) is None
    assert choose_path("role", 5000, None, c, p, 1024, 0) == "colocated"  # today's clusters as they were
    assert choose_path("split", 10, None, c, p, 1024, 0) == "split"


def test_length_splits_long_prompts_and_predicted_long_outputs() -> None:
    from tetri.scheduling.routing import choose_path

    c, p = InstanceLoad("c0"), InstanceLoad("p0")
    assert choose_path("length", 1023, None, c, p, 1024, 0) == "colocated"
    assert choose_path("length", 1024, None, c, p, 1024, 0) == "split"
    assert choose_path("length", 100, (200, 400), c, p, 1024, 0) == "colocated"  # outputs not considered
    assert choose_path("length", 100, (200, 400), c, p, 1024, 400) == "split"  # the range's upper end
    assert choose_path("length", 100, (200, 399), c, p, 1024, 400) == "colocated"
    assert choose_path("length", 100, None, c, p, 1024, 400) == "colocated"  # no prediction: the prompt only


def test_length_takes_the_other_path_when_its_own_is_backed_up() -> None:
    from tetri.scheduling.routing import backlog, choose_path

    slack = 4

    idle = InstanceLoad("c0", queued=0, running=3, inflight=3)
    assert backlog(idle) == 0
    # reported queue 1, but the router sent 9 and 3 run: 6 wait (the fresher count)
    busy = InstanceLoad("p0", queued=1, running=3, inflight=9)
    assert backlog(busy) == 6 > slack
    assert choose_path("length", 4096, None, idle, busy, 1024, 0, slack) == "colocated"
    assert choose_path("length", 4096, None, idle, busy, 1024, 0) == "split"  # no slack: the length alone
    just = InstanceLoad("p0", queued=slack, running=1, inflight=1)
    assert choose_path("length", 4096, None, idle, just, 1024, 0, slack) == "split"  # within the slack
    assert choose_path("length", 10, None, busy, idle, 1024, 0, slack) == "split"  # and the other way round
