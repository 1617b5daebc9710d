"""Instance flips (TetriInfer §3.5): the transition watcher's idle and advise policies. Time is a plain number fed
to `observe`; no clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.flip import FlipDecision, InstanceView, SplitAdvice, TransitionWatcher, check_flip_policy


def view(iid: str, role: str, kv: float, state: str = "active", queued: int = 0) -> InstanceView:
    return InstanceView(iid, role, state, kv, queued)


def cluster(idle_kv: float = 0.02, decode_kv: float = 0.9) -> list[InstanceView]:
    """Two prefill instances, p1 idle; two busy decode instances."""
    return [
        view("p0", "prefill", 0.5),
        view("p1", "prefill", idle_kv),
        view("d0", "decode", decode_kv),
        view("d1", "decode", decode_kv),
    ]


def watcher(**kw: float | str) -> TransitionWatcher:
    args: dict[str, float | str] = {"policy": "idle", "low": 0.10, "high": 0.80, "window_s": 60.0}
    args.update(kw)
    return TransitionWatcher(**args)  # type: ignore[arg-type]


def test_off_never_flips() -> None:
    w = TransitionWatcher(policy="off")
    for t in range(0, 1000, 10):
        assert w.observe(float(t), cluster()) == []


def test_idle_below_low_for_the_window_flips_to_the_other_role() -> None:
    w = watcher()
    assert w.observe(0.0, cluster()) == []
    assert w.observe(30.0, cluster()) == []
    assert w.observe(59.9, cluster()) == []  # not yet a full window
    [d] = w.observe(60.0, cluster())
    assert isinstance(d, FlipDecision)
    assert (d.instance_id, d.to_role) == ("p1", "decode")
    assert "load" in d.reason
    assert "10%" in d.reason and "90%" in d.reason  # the threshold and the other role's load
    assert "60s" in d.reason


def test_decode_instance_flips_to_prefill() -> None:
    views = [view("p0", "prefill", 0.95), view("d0", "decode", 0.0), view("d1", "decode", 0.5)]
    w = watcher(window_s=10.0)
    w.observe(0.0, views)
    [d] = w.observe(10.0, views)
    assert (d.instance_id, d.to_role) == ("d0", "prefill")


def test_no_flip_when_the_other_role_is_not_overloaded() -> None:
    w = watcher()
    w.observe(0.0, cluster(decode_kv=0.8))  # average exactly at high: not above
    assert w.observe(120.0, cluster(decode_kv=0.8)) == []
    # once the other role becomes overloaded the long-idle instance flips right away
    [d] = w.observe(121.0, cluster(decode_kv=0.81))
    assert d.instance_id == "p1"


def test_other_role_load_is_an_average() -> None:
    views = [
        view("p0", "prefill", 0.5),
        view("p1", "prefill", 0.0),
        view("d0", "decode", 1.0),
        view("d1", "decode", 0.5),
    ]
    w = watcher()
    w.observe(0.0, views)
    assert w.observe(100.0, views) == []  # average 0.75 ≤ 0.8 though d0 is full


def test_queue_pressure_counts_as_load() -> None:
    views = [
        view("p0", "prefill", 0.0, queued=14),  # 14/16 of a full queue
        view("p1", "prefill", 0.0, queued=20),  # queue full: busy
        view("d0", "decode", 0.0),
        view("d1", "decode", 0.05),
    ]
    w = watcher(window_s=1.0)
    w.observe(0.0, views)
    [d] = w.observe(5.0, views)  # the prefill side is overloaded by its queues
    assert (d.instance_id, d.to_role) == ("d0", "prefill")
    assert views[0].load(16) == pytest.approx(0.875)
    assert view("p2", "prefill", 0.0, queued=2).load(16) == pytest.approx(0.125)  # ≥ low: not idle
    assert views[1].load(16) == 1.0


def test_never_flips_the_last_instance_of_a_role() -> None:
    views = [view("p0", "prefill", 0.0), view("d0", "decode", 1.0), view("d1", "decode", 1.0)]
    w = watcher()
    for t in range(0, 600, 30):
        assert w.observe(float(t), views) == []


def test_the_last_active_instance_counts_only_active_ones() -> None:
    views = [
        view("p0", "prefill", 0.0),
        view("p1", "prefill", 0.0, state="unhealthy"),
        view("d0", "decode", 1.0),
    ]
    w = watcher()
    w.observe(0.0, views)
    assert w.observe(600.0, views) == []


@pytest.mark.parametrize("state", ["draining", "flipping"])
def test_no_decision_while_a_flip_is_in_progress(state: str) -> None:
    views = [*cluster(), view("d2", "decode", 0.0, state=state)]
    w = watcher()
    w.observe(0.0, cluster())
    assert w.observe(100.0, views) == []
    assert w.observe(200.0, views) == []
    assert len(w.observe(201.0, cluster())) == 1  # once it has finished


def test_load_returning_above_low_resets_the_timer() -> None:
    w = watcher()
    w.observe(0.0, cluster())
    w.observe(50.0, cluster())
    assert w.observe(55.0, cluster(idle_kv=0.10)) == []  # at low: not below it
    assert w.observe(70.0, cluster()) == []  # idle again since 70
    assert w.observe(129.0, cluster()) == []
    [d] = w.observe(130.0, cluster())
    assert d.instance_id == "p1"


def test_one_decision_at_a_time_longest_idle_first() -> None:
    views = [
        view("p0", "prefill", 0.0),
        view("p1", "prefill", 0.0),
        view("p2", "prefill", 0.9),
        view("d0", "decode", 0.95),
    ]
    w = watcher()
    w.observe(0.0, [views[0], view("p1", "prefill", 0.5), views[2], views[3]])
    w.observe(10.0, views)  # p1 idle only from 10
    [d] = w.observe(70.0, views)
    assert d.instance_id == "p0"
    # the daemon now drains p0: nothing else until it is done
    draining = [view("p0", "prefill", 0.0, state="draining"), *views[1:]]
    assert w.observe(80.0, draining) == []
    flipped = [view("p0", "decode", 0.0), *views[1:]]
    # p1 has been idle for a window, but the decode side now averages (0 + 0.95) / 2: not overloaded
    assert w.observe(90.0, flipped) == []


def test_flipped_instance_timer_starts_over() -> None:
    w = watcher()
    w.observe(0.0, cluster())
    assert len(w.observe(60.0, cluster())) == 1
    # the daemon did not act on it (say, the flip failed): it needs a fresh window
    assert w.observe(61.0, cluster()) == []
    assert len(w.observe(121.0, cluster())) == 1


def test_switching_policy_off_clears_timers() -> None:
    w = watcher()
    w.observe(0.0, cluster())
    w.policy = "off"
    assert w.observe(30.0, cluster()) == []
    w.policy = "idle"
    assert w.observe(61.0, cluster()) == []  # idle counted again from 61
    assert len(w.observe(121.0, cluster())) == 1


@settings(max_examples=100, deadline=None)
@given(
    snapshots=st.lists(
        st.tuples(
            st.floats(0, 30),  # time step
            st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), st.floats(0, 1)), min_size=1, max_size=5),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_decisions_are_always_safe(snapshots: list[tuple[float, list[tuple[str, float]]]]) -> None:
    w = watcher(window_s=20.0)
    now = 0.0
    below_since: dict[str, float] = {}
    for dt, insts in snapshots:
        now += dt
        views = [view(f"i{k}", role, kv) for k, (role, kv) in enumerate(insts)]
        for v in views:
            if v.kv_usage < 0.10:
                below_since.setdefault(v.instance_id, now)
            else:
                below_since.pop(v.instance_id, None)
        decisions = w.observe(now, views)
        assert len(decisions) <= 1
        for d in decisions:
            v = next(x for x in views if x.instance_id == d.instance_id)
            assert d.to_role != v.role
            assert sum(x.role == v.role for x in views) >= 2  # not the last of its role
            others = [x.kv_usage for x in views if x.role != v.role]
            assert sum(others) / len(others) > 0.80
            assert v.kv_usage < 0.10
            assert now - below_since.pop(v.instance_id) >= 20.0


@pytest.mark.parametrize(
    ("low", "high", "window"),
    [(-0.1, 0.8, 60.0), (0.5, 0.5, 60.0), (0.9, 0.8, 60.0), (0.1, 1.5, 60.0), (0.1, 0.8, 0.0), (0.1, 0.8, -5.0)],
)
def test_invalid_thresholds_are_rejected(low: float, high: float, window: float) -> None:
    with pytest.raises(ValueError, match="flip"):
        TransitionWatcher(policy="idle", low=low, high=high, window_s=window)
    with pytest.raises(ValueError, match="flip"):
        check_flip_policy("idle", low, high, window)


def test_unknown_flip_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="off, idle"):
        TransitionWatcher(policy="always")


def test_nan_window_is_rejected() -> None:
    with pytest.raises(ValueError, match="flip"):
        check_flip_policy("idle", 0.1, 0.8, float("nan"))


def test_one_flip_refusal_rule():
    from tetri.scheduling.flip import flip_refusal

    pd = {"prefill": 2, "decode": 2}
    assert flip_refusal("p0", "prefill", "active", "decode", pd) is None
    assert flip_refusal("p0", "prefill", "active", "decode", None) is None  # a worker cannot count
    last = flip_refusal("p0", "prefill", "active", "decode", {"prefill": 1, "decode": 3})
    assert last is not None and "last active prefill" in last.reason
    bad = flip_refusal("p0", "prefill", "active", "gpu", pd)
    assert bad is not None and bad.param == "to"
    for state, words in (
        ("draining", "already flipping"),
        ("flipping", "already flipping"),
        ("unhealthy", "is unhealthy"),
    ):
        r = flip_refusal("d1", "decode", state, "prefill", pd)
        assert r is not None and words in r.reason
    same = flip_refusal("d1", "decode", "active", "decode", pd)
    assert same is not None and "already is a decode" in same.reason
    unknown = flip_refusal("x0", "router", "active", "decode", pd)
    assert unknown is not None and "only colocated, prefill and decode" in unknown.reason


def test_flips_between_the_three_roles_never_leave_the_model_unserved():
    from tetri.scheduling.flip import flip_refusal

    # a colocated cluster turns one instance into a prefill, then one into a decode instance: a P/D pair
    assert flip_refusal("c0", "colocated", "active", "prefill", {"colocated": 3}) is None
    assert flip_refusal("c1", "colocated", "active", "decode", {"colocated": 2, "prefill": 1}) is None
    # the last colocated instance flips when a prefill and a decode instance serve meanwhile
    assert flip_refusal("c2", "colocated", "active", "prefill", {"colocated": 1, "prefill": 1, "decode": 1}) is None
    alone = flip_refusal("c0", "colocated", "active", "prefill", {"colocated": 1, "prefill": 1})
    assert alone is not None and "nothing else could serve" in alone.reason
    # prefill instances need a decode instance to hand over to: the last one flips only once they are gone
    hand = flip_refusal("d0", "decode", "active", "colocated", {"colocated": 2, "prefill": 1, "decode": 1})
    assert hand is not None and "last active decode" in hand.reason
    assert flip_refusal("d0", "decode", "active", "colocated", {"colocated": 2, "decode": 1}) is None
    # the last prefill instance may go (colocated instances serve); its held KV drains to a decode instance
    assert flip_refusal("p0", "prefill", "active", "colocated", {"colocated": 1, "prefill": 1, "decode": 1}) is None


# --- advise: flip one instance at a time toward the split the advisor gives ------------------------------
def advising(window_s: float = 10.0) -> TransitionWatcher:
    return TransitionWatcher(policy="advise", window_s=window_s)


def test_advise_asks_every_window_and_keeps_the_answer_until_the_next() -> None:
    w = advising()
    views = cluster()
    assert not w.advice_due(0.0)  # the first look starts the clock
    assert w.observe(0.0, views) == []
    assert not w.advice_due(9.9)
    assert w.advice_due(10.0)
    [d] = w.observe(10.0, views, SplitAdvice(1, 3, "window"))
    assert (d.instance_id, d.to_role) == ("p1", "decode")  # the least loaded prefill instance
    assert d.reason.startswith("advise: 1P:3D") and "window" in d.reason
    assert not w.advice_due(12.0)
    # still short of the split a look later (the flip did not happen): the kept advice asks again
    assert [x.instance_id for x in w.observe(12.0, views)] == ["p1"]
    assert w.advice_due(20.0)
    assert w.observe(20.0, views, None) == []  # no advice this window: nothing to move toward


def test_advise_moves_decode_to_prefill_and_stops_at_the_split() -> None:
    w = advising()
    w.observe(0.0, cluster())
    views = [
        view("p0", "prefill", 0.9),
        view("d0", "decode", 0.4),
        view("d1", "decode", 0.1),
        view("d2", "decode", 0.2),
    ]
    [d] = w.observe(10.0, views, SplitAdvice(2, 2, "x"))
    assert (d.instance_id, d.to_role) == ("d1", "prefill")
    there = [
        view("p0", "prefill", 0.9),
        view("d1", "prefill", 0.0),
        view("d0", "decode", 0.4),
        view("d2", "decode", 0.2),
    ]
    assert w.observe(11.0, there) == []


def test_advise_never_flips_the_last_instance_or_during_a_flip_or_for_another_instance_count() -> None:
    w = advising()
    w.observe(0.0, [])
    two = [view("p0", "prefill", 0.0), view("d0", "decode", 0.9)]
    assert w.observe(10.0, two, SplitAdvice(0, 2, "x")) == []  # would leave no prefill instance
    w = advising()
    w.observe(0.0, [])
    assert w.observe(10.0, [*cluster()[:3], view("d1", "decode", 0.9, state="draining")], SplitAdvice(1, 3, "x")) == []
    w = advising()
    w.observe(0.0, [])
    assert w.observe(10.0, cluster(), SplitAdvice(1, 4, "x")) == []  # advice for five instances, four active


def test_advise_is_not_due_under_other_policies() -> None:
    assert not watcher().advice_due(1e9)
    assert not TransitionWatcher(policy="off").advice_due(1e9)


# --- flip_path: the fewest allowed flips from one split of the roles to another --------------------------
def test_flip_path_takes_the_fewest_allowed_flips() -> None:
    from tetri.scheduling.flip import flip_path

    assert flip_path({"colocated": 4}, {"colocated": 4}) == []
    # colocated → a hybrid: the prefill instance first would serve nothing alone, but nothing is left unserved
    assert flip_path({"colocated": 4}, {"colocated": 2, "prefill": 1, "decode": 1}) == [
        ("colocated", "prefill"),
        ("colocated", "decode"),
    ]
    two = flip_path({"prefill": 2, "decode": 2}, {"colocated": 4})
    assert two is not None and len(two) == 4 and two[-1] == ("decode", "colocated")
    assert flip_path({"prefill": 1, "decode": 1}, {"colocated": 2}) is None  # either flip leaves it unserved
    assert flip_path({"colocated": 2}, {"colocated": 3}) is None  # not the same instances


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["colocated", "prefill", "decode"]), min_size=1, max_size=6), st.randoms())
def test_every_flip_on_the_path_is_allowed_when_it_starts(roles: list[str], rnd) -> None:
    from collections import Counter

    from tetri.scheduling.flip import ROLES, flip_path, flip_refusal

    current = Counter(roles)
    target = Counter(rnd.choice(ROLES) for _ in roles)
    path = flip_path(current, target)
    if path is None:
        return
    counts = Counter(current)
    for a, b in path:
        assert flip_refusal("x", a, "active", b, counts) is None
        counts[a] -= 1
        counts[b] += 1
    assert +counts == +target
    assert len(path) >= sum((current - target).values())  # no shorter way: each surplus instance flips once


def test_the_last_decode_instance_stays_while_a_prefill_instance_drains() -> None:
    from tetri.scheduling.flip import flip_refusal

    # 1C+1P+1D: the prefill instance is flipping to colocated; its held KV still goes to the decode instance
    after = {"colocated": 1, "decode": 1}
    assert flip_refusal("d0", "decode", "active", "colocated", after) is None  # once it is gone
    held = flip_refusal("d0", "decode", "active", "colocated", after, draining_prefill=1)
    assert held is not None and "last active decode" in held.reason
