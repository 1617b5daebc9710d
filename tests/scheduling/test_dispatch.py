"""Inter-decode dispatch (TetriInfer §3.3.4): power-of-two with heavy/light requests, and least-KV."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.dispatch import DecodeLoad, DispatchView, dispatch, least_kv, power_of_two

HEAVY, LIGHT = 401, 1  # lower ends of predicted ranges around the 128-token threshold


def load(iid: str, kv: int = 0, cap: int = 10_000, heavy: int = 0, light: int = 0, growth: int = 0) -> DecodeLoad:
    return DecodeLoad(iid, kv, cap, heavy=heavy, light=light, predicted_growth_tokens=growth)


def test_no_instances() -> None:
    assert power_of_two([], HEAVY, random.Random(0)) is None
    assert least_kv([]) is None
    assert dispatch("pot", [], None, random.Random(0)) is None


@pytest.mark.parametrize("predicted", [None, LIGHT, HEAVY])
def test_power_of_two_with_one_instance_returns_it(predicted: int | None) -> None:
    only = load("d0", kv=9_999, heavy=50)
    assert power_of_two([only], predicted, random.Random(0)) == "d0"


@pytest.mark.parametrize("seed", range(20))
def test_heavy_request_goes_to_the_instance_with_fewer_heavy_requests(seed: int) -> None:
    # d0 has fewer heavy decodes but the larger predicted load: heavy requests look at heavy counts
    a = load("d0", kv=8_000, heavy=1, light=0)
    b = load("d1", kv=1_000, heavy=5, light=0)
    assert power_of_two([a, b], HEAVY, random.Random(seed)) == "d0"
    assert power_of_two([b, a], HEAVY, random.Random(seed)) == "d0"


@pytest.mark.parametrize("seed", range(20))
def test_light_request_goes_to_the_instance_with_lower_predicted_load(seed: int) -> None:
    a = load("d0", kv=8_000, heavy=1)
    b = load("d1", kv=1_000, heavy=5, growth=2_000)  # 30% predicted load vs 80%
    assert power_of_two([a, b], LIGHT, random.Random(seed)) == "d1"
    assert power_of_two([a, b], None, random.Random(seed)) == "d1"  # no prediction: light


def test_predicted_load_includes_predicted_growth() -> None:
    a = load("d0", kv=3_000, growth=0)
    b = load("d1", kv=1_000, growth=5_000)  # less used now, more later
    assert b.predicted_load == pytest.approx(0.6)
    assert power_of_two([a, b], LIGHT, random.Random(0)) == "d0"


def test_heavy_threshold_is_strict_and_configurable() -> None:
    a = load("d0", kv=9_000, heavy=0)
    b = load("d1", kv=0, heavy=3)
    assert power_of_two([a, b], 128, random.Random(0)) == "d1"  # at the threshold: light
    assert power_of_two([a, b], 129, random.Random(0)) == "d0"
    assert power_of_two([a, b], 129, random.Random(0), heavy_threshold=500) == "d1"


def test_sent_counts_as_load_between_reports() -> None:
    a = dataclasses.replace(load("d0", heavy=1), sent=3)
    b = load("d1", heavy=2)
    assert power_of_two([a, b], HEAVY, random.Random(0)) == "d1"


def test_only_the_two_sampled_instances_are_compared() -> None:
    # the best instance overall is not always chosen: power-of-two samples two
    loads = [load(f"d{i}", kv=1_000 * i) for i in range(8)]
    picks = Counter(power_of_two(loads, LIGHT, random.Random(s)) for s in range(400))
    assert picks["d0"] < 400
    assert "d7" not in picks  # the worst instance always loses its pair


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(2, 8),
    seed=st.integers(0, 2**32 - 1),
    heavy=st.lists(st.integers(0, 20), min_size=8, max_size=8),
    kv=st.lists(st.integers(0, 10_000), min_size=8, max_size=8),
    predicted=st.sampled_from([None, LIGHT, HEAVY]),
)
def test_choice_is_the_better_of_the_two_sampled(
    n: int, seed: int, heavy: list[int], kv: list[int], predicted: int | None
) -> None:
    loads = [load(f"d{i}", kv=kv[i], heavy=heavy[i]) for i in range(n)]
    pick = power_of_two(loads, predicted, random.Random(seed))
    a, b = random.Random(seed).sample(loads, 2)  # the same draw
    assert pick in (a.instance_id, b.instance_id)
    chosen, other = (a, b) if pick == a.instance_id else (b, a)
    if predicted == HEAVY:
        assert chosen.heavy <= other.heavy
    else:
        assert chosen.predicted_load <= other.predicted_load


@pytest.mark.parametrize("mix", ["light", "heavy", "mixed"])
def test_power_of_two_spreads_load(mix: str) -> None:
    rng = random.Random(42)
    loads = {f"d{i}": load(f"d{i}", cap=100_000) for i in range(4)}
    got: Counter[str] = Counter()
    for k in range(2_000):
        heavy = mix == "heavy" or (mix == "mixed" and k % 3 == 0)
        iid = power_of_two(list(loads.values()), HEAVY if heavy else LIGHT, rng)
        assert iid is not None
        got[iid] += 1
        d = loads[iid]
        loads[iid] = dataclasses.replace(
            d,
            kv_used_tokens=d.kv_used_tokens + 20,
            heavy=d.heavy + heavy,
            light=d.light + (not heavy),
            predicted_growth_tokens=d.predicted_growth_tokens + (HEAVY if heavy else LIGHT),
        )
    assert set(got) == set(loads)
    assert max(got.values()) < 2_000 * 0.35  # nobody gets everything (fair share: 25%)
    assert min(got.values()) > 2_000 * 0.15


def test_least_kv_picks_the_most_free_kv() -> None:
    loads = [load("d0", kv=5_000), load("d1", kv=1_000), load("d2", kv=9_000)]
    assert least_kv(loads) == "d1"
    assert dispatch("least-kv", loads, HEAVY, random.Random(0)) == "d1"


def test_least_kv_compares_usage_fractions_and_counts_sent() -> None:
    assert least_kv([load("d0", kv=500, cap=1_000), load("d1", kv=600, cap=2_000)]) == "d1"
    busy = dataclasses.replace(load("d0", kv=100), sent=5_000)
    assert least_kv([busy, load("d1", kv=1_000)]) == "d1"
    assert least_kv([load("b", kv=10), load("a", kv=10)]) == "a"  # ties by id: deterministic


def test_dispatch_routes_to_the_policy() -> None:
    loads = [load("d0", kv=100), load("d1", kv=9_000)]
    assert dispatch("pot", loads, LIGHT, random.Random(0)) == "d0"


def test_unknown_dispatch_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"round-robin.*pot, least-kv"):
        dispatch("round-robin", [load("d0")], None, random.Random(0))


decode_load = st.builds(
    DecodeLoad,
    instance_id=st.just(""),
    kv_used_tokens=st.integers(0, 1000),
    kv_capacity_tokens=st.sampled_from([0, 500, 1000]),
    heavy=st.integers(0, 3),
    light=st.integers(0, 3),
    predicted_growth_tokens=st.integers(0, 500),
)
choice = st.tuples(
    st.sampled_from(["pot", "least-kv"]),
    st.sampled_from([None, LIGHT, HEAVY]),
    st.frozensets(st.sampled_from([f"d{i}" for i in range(6)]), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(decode_load, max_size=6), st.lists(choice, max_size=30), st.integers(0, 2**32))
def test_the_dispatch_view_chooses_what_dispatch_chooses_over_the_whole_list(
    broadcast: list[DecodeLoad], choices: list[tuple[str, int | None, frozenset[str]]], seed: int
) -> None:
    loads = [dataclasses.replace(d, instance_id=f"d{i}") for i, d in enumerate(broadcast)]
    view = DispatchView(loads)
    mine, theirs = random.Random(seed), random.Random(seed)
    sent = Counter[str]()
    for policy, predicted, exclude in choices:
        whole = [dataclasses.replace(d, sent=sent[d.instance_id]) for d in loads if d.instance_id not in exclude]
        expected = dispatch(policy, whole, predicted, theirs)
        assert view.choose(policy, predicted, mine, exclude) == expected
        if expected is not None:
            sent[expected] += 1
