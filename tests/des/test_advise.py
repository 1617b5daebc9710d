"""The advisor (tetri.des.advise) and workload traces (tetri.des.trace): every candidate is simulated on
the workload's own arrivals, the advice is the best by goodput, and disaggregation is advised only when it
beats the best colocated setup."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tetri.des.advise import AdviceSpec, advise, expected_outcome, jittered, offered_rate, outcome, setup_config
from tetri.des.cluster import simulate
from tetri.des.slo import parse_slos
from tetri.des.trace import read_trace, rows_to_trace
from tetri.des.workloads import WorkloadSpecError, make_workload
from tetri.scheduling.policyset import PolicySet

TIGHT = parse_slos(["ttft=0.2,tpot=0.015"])
H100 = "llama3-8b-h100"  # the expectations below were made on it (8K context; TIGHT is within its reach)


def _score(o: dict) -> tuple[float, float]:
    return (round(o["goodput_rps"], 9), -o["avg_jct_s"])


@pytest.mark.parametrize(("rate", "baselines"), [(20.0, ("vllm-v0", "vllm-v1")), (200.0, ("vllm-v0",))])
def test_the_advice_is_the_best_candidate_and_disaggregation_must_beat_colocated(rate, baselines):
    reqs = make_workload("Mixed", 96, seed=1, rate=rate, max_model_len=8192)
    spec = AdviceSpec(profile=H100, gpus=3, slo=TIGHT, chunks=(192, 512), baselines=baselines)
    doc = advise(reqs, spec)
    json.dumps(doc, allow_nan=False)
    # vllm-v1 with srpt alone; with the TTFT target, in either order, alone and with each token budget
    budgets = len(spec.token_budgets)
    srpt = 1 + 2 * (1 + budgets) if "vllm-v1" in baselines else 0
    # hybrids: 1 colocated + 1 prefill + 1 decode, prompts split at the median, 75th and 90th percentiles
    quantiles = {max(1, int(q)) for q in np.quantile([r.prompt_len for r in reqs], (0.5, 0.75, 0.9))}
    hybrids = [c for c in doc["candidates"] if c["mode"] == "hybrid"]
    assert {c["policies"]["pd_prompt_tokens"] for c in hybrids} == quantiles
    # the colocated instances of a hybrid run each named baseline's schedule
    assert {c["policies"]["colocated_schedule"] for c in hybrids} == set(baselines)
    # each with the length alone deciding and with the backlog guard
    assert {c["policies"]["pd_backlog_slack"] for c in hybrids} == {0, 4}
    assert len(hybrids) == len(quantiles) * len(baselines) * 2
    assert all((c["colocated"], c["prefill"], c["decode"]) == (1, 1, 1) for c in hybrids)
    assert all(c["policies"]["pd_route"] == "length" for c in hybrids)
    assert doc["best_hybrid"] in hybrids
    # splits × chunks × orders × admissions
    assert len(doc["candidates"]) == len(baselines) + srpt + 2 * 2 * 2 * 2 + len(hybrids)
    # every named baseline as vLLM runs it: first come first served, no predictor, its own schedule
    assert set(doc["baselines"]) == set(baselines)
    for name, b in doc["baselines"].items():
        assert b["policies"]["colocated_schedule"] == name and b["policies"]["queue_order"] == "fcfs"
        assert b["policies"]["predictor"] == "none" and b["outcome"]["goodput_rps"] >= 0
    srpts = [c for c in doc["candidates"] if c["policies"]["queue_order"] == "srpt"]
    assert len(srpts) == (2 + budgets if srpt else 0)
    assert all(c["policies"]["predictor_accuracy"] == 0.749 for c in srpts)
    for c in doc["candidates"]:  # a token budget only beside the TTFT target that lifts it
        assert not c["policies"]["token_budget"] or c["policies"]["ttft_target_s"] == 0.2
    assert {c["policies"]["token_budget"] for c in doc["candidates"]} == ({0, *spec.token_budgets} if srpt else {0})
    targets = {c["policies"]["ttft_target_s"] for c in doc["candidates"] if c["mode"] == "colocated"}
    assert targets <= {0.0, 0.2} and (not srpt or 0.2 in targets)  # TIGHT's TTFT
    colocated, advice = doc["best_colocated"], doc["advice"]
    top = max(c["outcome"]["goodput_rps"] for c in doc["candidates"])
    for kind, chosen in (("colocated", colocated), (advice["mode"], advice)):
        pool = [c for c in doc["candidates"] if c["mode"] == kind]
        g = chosen["outcome"]["goodput_rps"]
        assert chosen["mode"] == kind and g * 1.01 >= max(c["outcome"]["goodput_rps"] for c in pool)
        # no setup of its kind within 1% of the best goodput has a lower mean JCT
        assert all(
            c["outcome"]["avg_jct_s"] >= chosen["outcome"]["avg_jct_s"]
            for c in pool
            if c["outcome"]["goodput_rps"] * 1.01 >= max(x["outcome"]["goodput_rps"] for x in pool)
        )
    assert advice["outcome"]["goodput_rps"] * 1.01 >= top  # the advice is within 1% of the best of all
    if advice["mode"] != "colocated":  # it had to beat the best colocated setup
        c, a = colocated["outcome"], advice["outcome"]
        assert a["goodput_rps"] > c["goodput_rps"] * 1.01 or a["avg_jct_s"] < c["avg_jct_s"]
    o = doc["advice"]["outcome"]
    assert o["goodput_rps"] == pytest.approx(offered_rate(reqs) * o["within_slo"])
    assert 0 < o["p50_ttft_s"] <= o["p99_ttft_s"] and o["usd_per_m_tokens"] > 0


def test_at_a_load_only_disaggregation_serves_well_the_advice_is_disaggregated():
    # against the paper's baseline alone at a high rate, vllm-v0's prefills stall its decodes (docs/bench.md)
    reqs = make_workload("Mixed", 256, seed=0, rate=250.0, max_model_len=8192)
    spec = AdviceSpec(
        profile=H100, gpus=4, slo=TIGHT, chunks=(256,), baselines=("vllm-v0",), modes=("colocated", "disaggregated")
    )
    doc = advise(reqs, spec)
    assert doc["advice"]["mode"] == "disaggregated"
    assert doc["advice"]["outcome"]["within_slo"] > doc["best_colocated"]["outcome"]["within_slo"]
    # a hybrid's colocated instances run the named baseline's schedule: as vllm-v0, no hybrid beats the split
    hybrid = advise(reqs, dataclasses.replace(spec, modes=("colocated", "disaggregated", "hybrid")))
    assert (
        hybrid["advice"]["mode"] == "disaggregated"
        and hybrid["best_hybrid"]["policies"]["colocated_schedule"] == "vllm-v0"
    )
    # as vllm-v1, one beats every P:D split: as good a goodput at a lower mean JCT (the short prompts skip
    # the hand-over and the prefill queue)
    v1 = advise(reqs, dataclasses.replace(spec, baselines=("vllm-v1",), modes=("disaggregated", "hybrid")))
    assert v1["advice"]["mode"] == "hybrid" and v1["advice"] == v1["best_hybrid"]
    h, d = v1["advice"]["outcome"], v1["best_disaggregated"]["outcome"]
    assert h["goodput_rps"] * 1.01 >= d["goodput_rps"] and h["avg_jct_s"] < d["avg_jct_s"]


def test_a_trace_round_trips_through_the_status_rows():
    rows = [
        {"id": "b", "status": "finished", "arrival_ts": 101.5, "prompt_tokens": 30, "output_tokens": 7},
        {"id": "a", "status": "finished", "arrival_ts": 100.0, "prompt_tokens": 12, "output_tokens": 40},
        {"id": "c", "status": "failed", "arrival_ts": 100.2, "prompt_tokens": 5, "output_tokens": 0},
    ]
    lines = rows_to_trace(rows)
    assert lines == [
        {"id": "a", "arrival_s": 0.0, "prompt_tokens": 12, "output_tokens": 40},
        {"id": "b", "arrival_s": 1.5, "prompt_tokens": 30, "output_tokens": 7},
    ]
    reqs = read_trace(json.dumps(x) for x in lines)
    assert [(r.request_id, r.arrival, r.prompt_len, r.output_len, r.max_tokens) for r in reqs] == [
        ("a", 0.0, 12, 40, 40),
        ("b", 1.5, 30, 7, 7),
    ]


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        (["{"], "line 1: not a JSON object"),
        (['{"arrival_s": 0, "prompt_tokens": 3}'], "line 1: output_tokens is missing"),
        (["", '{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}'], "line 2: arrival_s must be ≥ 0"),
        (['{"arrival_s": 0, "prompt_tokens": 3.5, "output_tokens": 2}'], "line 1: prompt_tokens must be a whole"),
        (['{"arrival_s": 0, "prompt_tokens": 9000, "output_tokens": 2}'], "exceeds the model's context"),
        ([""], "no requests"),
    ],
)
def test_a_bad_trace_line_is_named(lines, needle):
    with pytest.raises(WorkloadSpecError, match=needle):
        read_trace(lines, max_model_len=8192)


def test_rejecting_is_tried_only_when_asked() -> None:
    """`ttft_miss` reject changes what clients see (429s), so advise tries it only with ttft_misses."""
    base = AdviceSpec(profile=H100, gpus=2, slo=TIGHT, modes=("colocated",))
    asked = AdviceSpec(profile=H100, gpus=2, slo=TIGHT, modes=("colocated",), ttft_misses=("last", "reject"))
    for spec, want in ((base, {"last"}), (asked, {"last", "reject"})):
        assert {c["policies"]["ttft_miss"] for c in spec.candidates()} == want
    rejecting = [c for c in asked.candidates() if c["policies"]["ttft_miss"] == "reject"]
    assert rejecting and all(c["policies"]["ttft_target_s"] == 0.2 for c in rejecting)
    reqs = make_workload("Mixed", 64, seed=2, rate=400.0, max_model_len=8192)  # past 2 GPUs' capacity
    doc = advise(reqs, asked)
    outcomes = [c["outcome"] for c in doc["candidates"] if c["policies"]["ttft_miss"] == "reject"]
    assert any(o["rejected"] for o in outcomes)
    for o in outcomes:  # a rejected request counts outside the SLO: at most the served share is within it
        assert o["within_slo"] <= 1 - o["rejected"] / len(reqs)
    for bad in ((), ("drop",)):
        with pytest.raises(WorkloadSpecError, match="--ttft-miss"):
            AdviceSpec(ttft_misses=bad)


def test_jittered_moves_each_arrival_within_its_bound_the_same_way_for_a_seed() -> None:
    reqs = make_workload("Mixed", 64, seed=2, rate=100.0, max_model_len=8192)
    a, b, c = jittered(reqs, 1e-3, 0), jittered(reqs, 1e-3, 0), jittered(reqs, 1e-3, 1)
    assert a == b and a != c  # a draw per seed
    by_id = {r.request_id: r for r in reqs}
    assert sorted(r.request_id for r in a) == sorted(by_id)
    assert all(abs(r.arrival - by_id[r.request_id].arrival) <= 1e-3 and r.arrival >= 0 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    assert {dataclasses.replace(r, arrival=0.0) for r in a} == {dataclasses.replace(r, arrival=0.0) for r in reqs}


def test_the_expected_outcome_is_the_mean_of_its_draws() -> None:
    reqs = make_workload("Mixed", 64, seed=2, rate=150.0, max_model_len=8192)
    spec = AdviceSpec(profile=H100, gpus=2, slo=TIGHT)
    setup = {"mode": "colocated", "policies": PolicySet(colocated_schedule="vllm-v1").to_dict()}
    rate = offered_rate(reqs)
    draws = [
        outcome(simulate(jittered(reqs, 2e-3, k), setup_config(spec, setup)), spec.slo, spec.price, rate)
        for k in range(3)
    ]
    got = expected_outcome(reqs, spec, setup, 2e-3, draws=3)
    assert got["goodput_rps"] == pytest.approx(np.mean([d["goodput_rps"] for d in draws]), rel=1e-12)
    assert got["rejected"] == pytest.approx(np.mean([d["rejected"] for d in draws]), rel=1e-12)
    assert (got["goodput_min"], got["goodput_max"]) == (
        min(d["goodput_rps"] for d in draws),
        max(d["goodput_rps"] for d in draws),
    )
    # with no move every draw is the plain run
    plain = outcome(simulate(reqs, setup_config(spec, setup)), spec.slo, spec.price, rate)
    assert expected_outcome(reqs, spec, setup, 0.0, draws=2)["goodput_rps"] == pytest.approx(plain["goodput_rps"])
    with pytest.raises(ValueError, match="draws"):
        expected_outcome(reqs, spec, setup, 0.0, draws=0)
