"""The runtime policy set: one validated value object; errors name the offending field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.policyset import PolicyError, PolicySet

INVALID: list[tuple[str, Any]] = [
    ("prefill_policy", "lifo"),
    ("prefill_policy", None),
    ("prefill_sched_batch", 0),
    ("prefill_sched_batch", -3),
    ("prefill_sched_batch", 2.5),
    ("prefill_sched_batch", True),
    ("prefill_sched_batch", "16"),
    ("chunk_size", 0),
    ("chunk_size", -512),
    ("chunk_size", 512.0),
    ("predictor", "psychic"),
    ("predictor_accuracy", -0.01),
    ("predictor_accuracy", 1.01),
    ("predictor_accuracy", math.nan),
    ("predictor_granularity", 0),
    ("predictor_granularity", False),
    ("dispatch", "random"),
    ("decode_admission", "optimistic"),
    ("flip_policy", "always"),
    ("flip_low", -0.1),
    ("flip_low", 0.8),  # not below flip_high
    ("flip_low", math.nan),
    ("flip_window_s", 0.0),
    ("flip_window_s", -1.0),
]


def test_defaults_are_valid() -> None:
    p = PolicySet()
    assert p.prefill_policy == "fcfs"
    assert p.chunk_size == 512
    assert p.prefill_sched_batch == 16
    assert (p.flip_low, p.flip_high, p.flip_window_s) == (0.10, 0.80, 60.0)


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_each_invalid_field_is_named(field: str, value: Any) -> None:
    with pytest.raises(PolicyError) as err:
        PolicySet(**{field: value})
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
    with pytest.raises(PolicyError) as err2:
        PolicySet().changed(**{field: value})
    assert err2.value.field == field


def test_policy_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        PolicySet(chunk_size=0)


def test_unknown_value_error_lists_the_choices() -> None:
    with pytest.raises(PolicyError, match="fcfs, sjf, ljf"):
        PolicySet(prefill_policy="lifo")


@pytest.mark.parametrize("name", ["chunksize", "flip", "", "__class__"])
def test_unknown_field_is_rejected(name: str) -> None:
    with pytest.raises(PolicyError) as err:
        PolicySet().changed(**{name: 1})
    assert err.value.field == name


def test_changed_returns_a_new_object_and_leaves_the_old_one() -> None:
    old = PolicySet()
    new = old.changed(prefill_policy="sjf", chunk_size=256, decode_admission="reserve-dynamic")
    assert new is not old
    assert (new.prefill_policy, new.chunk_size, new.decode_admission) == ("sjf", 256, "reserve-dynamic")
    assert old == PolicySet()
    assert new.dispatch == old.dispatch
    with pytest.raises(dataclasses.FrozenInstanceError):
        old.chunk_size = 1  # type: ignore[misc]


def test_failed_change_leaves_the_old_one() -> None:
    old = PolicySet(chunk_size=128)
    with pytest.raises(PolicyError):
        old.changed(chunk_size=64, prefill_sched_batch=0)
    assert old.chunk_size == 128


def test_changing_both_flip_thresholds_at_once() -> None:
    p = PolicySet().changed(flip_low=0.85, flip_high=0.95)
    assert (p.flip_low, p.flip_high) == (0.85, 0.95)


policy_sets = st.builds(
    PolicySet,
    prefill_policy=st.sampled_from(["fcfs", "sjf", "ljf"]),
    prefill_sched_batch=st.integers(1, 1024),
    chunk_size=st.integers(1, 8192),
    predictor=st.sampled_from(["none", "oracle", "learned"]),
    predictor_accuracy=st.floats(0, 1),
    predictor_granularity=st.integers(1, 1000),
    dispatch=st.sampled_from(["pot", "least-kv"]),
    decode_admission=st.sampled_from(["greedy", "reserve-static", "reserve-dynamic", "plan"]),
    flip_policy=st.sampled_from(["off", "idle"]),
    flip_low=st.floats(0, 0.49),
    flip_high=st.floats(0.5, 1),
    flip_window_s=st.floats(0.001, 1e6),
)


@settings(max_examples=100, deadline=None)
@given(p=policy_sets)
def test_to_dict_round_trips(p: PolicySet) -> None:
    d = p.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(PolicySet)}
    assert PolicySet(**d) == p
    assert p.changed(**d) == p


@pytest.mark.parametrize("value", [1.5, -0.2, math.nan])
def test_invalid_flip_high_is_named(value: float) -> None:
    with pytest.raises(PolicyError) as err:
        PolicySet(flip_high=value)
    assert err.value.field == "flip_high"


def test_nan_flip_window_is_rejected() -> None:
    with pytest.raises(PolicyError) as err:
        PolicySet(flip_window_s=math.nan)
    assert err.value.field == "flip_window_s"


@pytest.mark.parametrize("field", ["predictor_accuracy", "flip_low", "flip_high", "flip_window_s"])
def test_wrong_type_for_a_float_field_is_a_policy_error(field: str) -> None:
    with pytest.raises(PolicyError) as err:
        kwargs: dict[str, Any] = {field: "0.5"}
        PolicySet(**kwargs)
    assert err.value.field == field
