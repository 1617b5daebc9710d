"""Parsing the workload and plan formats: every malformed input names its line and field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tetri.planner.generate import Mix, generate, with_width
from tetri.planner.planfile import build_plan, parse_plan, plan_order
from tetri.planner.policies import run_policy
from tetri.planner.workload import Workload, WorkloadError, dump_jsonl, parse_jsonl

GOOD = '{"id": "a", "prompt_tokens": 3, "output_tokens": 2}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([GOOD, "{not json"], "line 2: malformed JSON"),
        (['{"id": "a", "output_tokens": 2}'], "line 1: missing field 'prompt_tokens'"),
        (['{"id": "a", "prompt_tokens": 0, "output_tokens": 2}'], "'prompt_tokens' must be positive"),
        (['{"id": "a", "prompt_tokens": 2, "output_tokens": -1}'], "'output_tokens' must be positive"),
        (['{"id": "a", "prompt_tokens": 2.5, "output_tokens": 1}'], "'prompt_tokens' must be an integer"),
        ([GOOD, GOOD], "line 2: duplicate id 'a' (first on line 1)"),
        (['{"id": "a", "prompt_tokens": 2, "output_tokens": 1, "arrival": -3}'], "'arrival' must be at least 0"),
        (['{"id": "a", "prompt_tokens": 2, "output_tokens": 1, "predicted_output": [5, 2]}'], "lo ≤ hi"),
        (['{"id": "a", "prompt_tokens": 2, "output_tokens": 1, "colour": 1}'], "unknown field 'colour'"),
        (["[1, 2]"], "expected a JSON object"),
        ([""], "no requests"),
    ],
)
def test_bad_lines_are_named(lines, message):
    with pytest.raises(WorkloadError) as e:
        parse_jsonl(lines, "W.jsonl")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_roundtrip_and_optional_fields():
    w = generate(Mix.parse("short:0.5,long:0.5"), 50, seed=4, rate=0.5, accuracy=0.75)
    back = parse_jsonl(dump_jsonl(w).splitlines())
    assert back.ids == w.ids
    for field in ("s", "o", "a", "lo", "hi"):
        assert np.array_equal(getattr(back, field), getattr(w, field))


def test_oversized_requests_fail_or_drop():
    w = Workload.from_arrays([10, 1], [10, 1], ids=["big", "ok"])
    with pytest.raises(WorkloadError, match="request 'big' needs 20 KV slots"):
        w.check_memory(15)
    kept, dropped = w.check_memory(15, drop_oversized=True)
    assert kept.ids == ("ok",) and dropped == 1


def test_generator_classes_follow_their_sources():
    short = generate(Mix.parse("short"), 20000, seed=1)
    long = generate(Mix.parse("long"), 20000, seed=1)
    assert short.s.mean() == pytest.approx(69.5, rel=0.05)
    assert short.o.mean() == pytest.approx(214.5, rel=0.05)
    assert np.median(long.s) == pytest.approx(2730, rel=0.03)
    assert np.median(long.o) == pytest.approx(167, rel=0.05)
    assert np.percentile(long.o, 90) == pytest.approx(372, rel=0.06)


def test_predicted_ranges_hit_at_the_requested_accuracy():
    w = generate(Mix.parse("short"), 20000, seed=2, accuracy=0.749, bucket=200)
    assert w.lo is not None and w.hi is not None
    hit = (w.lo <= w.o) & (w.o <= w.hi)
    assert hit.mean() == pytest.approx(0.749, abs=0.02)
    assert np.all(w.hi - w.lo == 199)
    wide = with_width(w, 100, seed=3)
    assert np.all((wide.lo <= wide.o) & (wide.o <= wide.hi))


def test_poisson_arrivals_have_the_requested_rate():
    w = generate(Mix.parse("short"), 5000, seed=3, rate=0.25)
    assert np.all(np.diff(w.a) >= 0)
    assert w.n / w.a.max() == pytest.approx(0.25, rel=0.08)


@pytest.mark.parametrize("text", ["short:x", "medium:1", "short:0"])
def test_bad_mix(text):
    with pytest.raises(WorkloadError, match="--mix"):
        Mix.parse(text)


def test_plan_file_round_trip_and_errors():
    w = Workload.from_arrays([3, 4, 5], [2, 2, 2], ids=["a", "b", "c"])
    res = run_policy("sorted-f", w, 20, solver="dp")
    doc = build_plan(w, 20, res)
    for key in (
        "memory",
        "policy",
        "solver",
        "batches",
        "schedule",
        "tel",
        "avg_latency",
        "makespan",
        "peak_memory",
        "solver_stats",
    ):
        assert key in doc
    plan = parse_plan(json.dumps(doc))
    assert plan_order(plan, w).tolist() == [w.ids.index(x) for x in plan.order]
    # the plan is its own backlog: every row carries the request's lengths and planned finish
    assert {rid: (v.prompt_tokens, v.output_tokens) for rid, v in plan.backlog.items()} == {
        w.ids[i]: (int(w.s[i]), int(w.o[i])) for i in range(w.n)
    }
    assert all(v.finish is not None for v in plan.backlog.values())
    bad = dict(doc, batches=[["a", "zz"]])
    with pytest.raises(WorkloadError, match="unknown request 'zz'"):
        plan_order(parse_plan(json.dumps(bad)), w)
    short = dict(doc, batches=[["a"]])
    with pytest.raises(WorkloadError, match="does not plan request 'b'"):
        plan_order(parse_plan(json.dumps(short)), w)
    twice = dict(doc, batches=[["a", "a"]])
    with pytest.raises(WorkloadError, match="'a' planned twice"):
        parse_plan(json.dumps(twice))
    bad_row = dict(doc, schedule=[{"id": "a", "prompt_tokens": 0, "output_tokens": 3, "start": 0}])
    with pytest.raises(WorkloadError, match="schedule entry 0 \\(a\\): field 'prompt_tokens'"):
        parse_plan(json.dumps(bad_row))
    with pytest.raises(WorkloadError, match="not valid JSON"):
        parse_plan("{")
    with pytest.raises(WorkloadError, match="'memory'"):
        parse_plan(json.dumps({"batches": []}))
