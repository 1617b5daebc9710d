"""The discrete-event simulator: determinism, conservation, chunking arithmetic, decode admission with
exact predictions, flips under load, and the paper's direction on LPHD. Assertions are on what the
simulated cluster did (records, counters), never on wall-clock time."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.costmodel import CostModel, load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.experiments import TETRI_POLICY, BenchSetup, ablation_flip, run_bench
from tetri.des.metrics import HEADLINE, relative_change, summarize
from tetri.des.records import RequestRecord, RunResult
from tetri.des.slo import Slo, SloSet, parse_slos, request_class
from tetri.des.workloads import (
    LIGHT_OUTPUT_MAX,
    LIGHT_PROMPT_MAX,
    WORKLOADS,
    Request,
    WorkloadSpecError,
    make_workload,
    shifting_workload,
)
from tetri.scheduling.flip import FlipDecision, InstanceView
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefill import ChunkedPrefill, PrefillItem

OPT = load_profile("opt-13b-v100")
COST = CostModel(OPT)
TETRI = ClusterConfig(mode="tetri", policy=TETRI_POLICY)
VANILLA = ClusterConfig(mode="vanilla")


def exact(admission: str) -> PolicySet:
    """Exact predictions: 1-token buckets, so the predicted lower end is the true output length."""
    return PolicySet(predictor="oracle", predictor_accuracy=1.0, predictor_granularity=1, decode_admission=admission)


def check_conservation(requests: Sequence[Request], result: RunResult) -> None:
    by_id = {r.request_id: r for r in requests}
    ids = [r.request_id for r in result.requests]
    assert len(ids) == len(set(ids)) == len(requests)
    assert set(ids) == set(by_id)
    for rec in result.requests:
        req = by_id[rec.request_id]
        assert rec.output_len == req.output_len and rec.prompt_len == req.prompt_len
        assert rec.arrival == req.arrival
        assert rec.arrival <= rec.prefill_start < rec.first_token <= rec.finish
        assert 0 < rec.ttft <= rec.jct
        if req.output_len > 1:
            assert rec.decode_start is not None and rec.first_token <= rec.decode_start < rec.finish
            assert rec.decode_instance is not None
        else:
            assert rec.finish == rec.first_token
    for inst in result.instances:
        assert inst.busy_s <= inst.span_s + 1e-9
    assert result.makespan == max(r.finish for r in result.requests)


# --- workloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_classes_and_limits(name: str):
    reqs = make_workload(name, 300, seed=3, max_model_len=2048, kv_capacity=3408)
    assert len(reqs) == 300 and reqs[0].arrival == 0
    assert all(b.arrival >= a.arrival for a, b in itertools.pairwise(reqs))
    for r in reqs:
        assert r.prompt_len + r.output_len <= 2048 and r.peak_kv <= 3408
        assert r.max_tokens == 2048 - r.prompt_len >= r.output_len
        if name in ("LPLD", "LPHD"):
            assert 2 <= r.prompt_len <= LIGHT_PROMPT_MAX
        if name in ("HPLD", "HPHD"):
            assert r.prompt_len > LIGHT_PROMPT_MAX
        if name in ("LPLD", "HPLD"):
            assert 20 <= r.output_len <= LIGHT_OUTPUT_MAX
        if name in ("LPHD", "HPHD"):
            assert r.output_len > LIGHT_OUTPUT_MAX
    assert make_workload(name, 50, seed=1) == make_workload(name, 50, seed=1)
    lengths = [(r.prompt_len, r.output_len) for r in make_workload(name, 50, seed=1, rate=math.inf)]
    assert lengths == [(r.prompt_len, r.output_len) for r in make_workload(name, 50, seed=1, rate=0.5)]


def test_workload_errors():
    with pytest.raises(WorkloadSpecError, match="unknown workload"):
        make_workload("XPXD")
    with pytest.raises(WorkloadSpecError):
        make_workload("LPLD", 0)
    assert make_workload("mixed", 3)[0].request_id == "mixed-0"


# --- determinism and conservation ----------------------------------------------------------------


@pytest.mark.parametrize("config", [TETRI, VANILLA], ids=["tetri", "vanilla"])
def test_same_seed_same_result(config: ClusterConfig):
    reqs = make_workload("Mixed", 80, seed=5)
    assert simulate(reqs, config) == simulate(reqs, config)
    other = make_workload("Mixed", 80, seed=6)
    assert simulate(other, config) != simulate(reqs, config)


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("config", [TETRI, VANILLA], ids=["tetri", "vanilla"])
def test_every_request_finishes_once(name: str, config: ClusterConfig):
    reqs = make_workload(name, 48, seed=2)
    res = simulate(reqs, config)
    check_conservation(reqs, res)
    if config.mode == "tetri":
        for rec in res.requests:
            assert rec.prefill_instance == "gpu0" and rec.decode_instance == "gpu1"
            assert rec.decode_start is not None
            assert rec.decode_start >= rec.first_token + COST.transfer_time(rec.prompt_len) - 1e-9


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 3), st.integers(1, 1500), st.integers(1, 400)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["greedy", "reserve-static", "reserve-dynamic"]),
    st.sampled_from(["fcfs", "sjf", "ljf"]),
    st.booleans(),
    st.booleans(),
)
def test_conservation_property(
    spec: list[tuple[float, int, int]], admission: str, order: str, chunked: bool, vanilla: bool
):
    reqs = [Request(f"r{i}", a, p, o, 2048 - p) for i, (a, p, o) in enumerate(spec)]
    pol = TETRI_POLICY.changed(decode_admission=admission, prefill_policy=order)
    cfg = ClusterConfig(mode="vanilla" if vanilla else "tetri", instances=3, policy=pol, chunked=chunked)
    check_conservation(reqs, simulate(reqs, cfg))


# --- chunked prefill ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [128, 512])
def test_chunk_arithmetic_matches_chunked_prefill(chunk: int):
    prompts = [300, 700, 100, 1024, 33]
    pol = PolicySet(chunk_size=chunk)
    # All at once: one queue, chunked back to back, exactly as ChunkedPrefill does it.
    burst = [Request(f"b{i}", 0.0, p, 2, 2048 - p) for i, p in enumerate(prompts)]
    res = simulate(burst, ClusterConfig(policy=pol))
    ref = ChunkedPrefill(chunk_size=chunk)
    for i, p in enumerate(prompts):
        ref.add(PrefillItem(f"b{i}", p, i))
    while ref.next_chunk() is not None:
        pass
    assert res.instances[0].prefill_iterations == ref.chunks == math.ceil(sum(prompts) / chunk)
    assert res.padding_tokens == ref.wasted_tokens == ref.chunks * chunk - sum(prompts)
    # One at a time (each arrives after the previous is done): every prompt pads its own last chunk.
    spaced = [Request(f"s{i}", 10.0 * i, p, 2, 2048 - p) for i, p in enumerate(prompts)]
    res = simulate(spaced, ClusterConfig(policy=pol))
    assert res.instances[0].prefill_iterations == sum(math.ceil(p / chunk) for p in prompts)
    assert res.padding_tokens == sum(math.ceil(p / chunk) * chunk - p for p in prompts)
    # A lone prompt's TTFT is its chunks' time: the padding extends the last piece.
    rec = res.requests[1]  # 700 tokens
    pieces = [(min(chunk, 700 - k), k) for k in range(0, 700, chunk)]
    pieces[-1] = (chunk, pieces[-1][1])
    assert rec.ttft == pytest.approx(sum(COST.prefill_batch_time([x]) for x in pieces))


def test_fixed_batch_prefill_has_no_padding():
    reqs = [Request(f"r{i}", 0.0, p, 2, 2048 - p) for i, p in enumerate([300, 700, 100])]
    res = simulate(reqs, ClusterConfig(chunked=False))
    assert res.padding_tokens == 0 and res.instances[0].prefill_iterations == 1
    assert len({r.first_token for r in res.requests}) == 1  # one whole-prompt batch


def test_sjf_orders_within_a_sched_batch():
    prompts = [900, 50, 400, 20]
    reqs = [Request(f"r{i}", 0.0, p, 2, 2048 - p) for i, p in enumerate(prompts)]
    res = simulate(reqs, ClusterConfig(policy=PolicySet(prefill_policy="sjf", chunk_size=64)))
    order = sorted(res.requests, key=lambda r: r.first_token)
    assert [r.prompt_len for r in order] == sorted(prompts)


# --- decode admission ----------------------------------------------------------------------------


def waves(n_waves: int = 4, per_wave: int = 6, gap_s: float = 60.0) -> list[Request]:
    """Waves of identical requests (prompt 100, output 600: peak 699 KV tokens) on a 3,408-token decode
    instance: greedy admits a whole wave (101 tokens each now) and must preempt as they grow; only 4
    fit at their peak."""
    return [Request(f"w{w}-{i}", w * gap_s, 100, 600, 1948) for w in range(n_waves) for i in range(per_wave)]


def test_reserve_policies_with_exact_predictions_never_preempt():
    reqs = waves()
    results = {
        adm: simulate(reqs, ClusterConfig(policy=exact(adm))) for adm in ("greedy", "reserve-static", "reserve-dynamic")
    }
    for res in results.values():
        check_conservation(reqs, res)
    assert results["greedy"].preemptions > 0 and results["greedy"].recomputed_tokens > 0
    assert results["reserve-static"].preemptions == 0
    assert results["reserve-dynamic"].preemptions == 0


def test_reserve_static_on_a_memory_bound_mix():
    reqs = make_workload("LPHD", 40, seed=4, rate=1.0)
    greedy = simulate(reqs, ClusterConfig(policy=exact("greedy")))
    static = simulate(reqs, ClusterConfig(policy=exact("reserve-static")))
    dynamic = simulate(reqs, ClusterConfig(policy=exact("reserve-dynamic")))
    assert greedy.preemptions > 0 and static.preemptions == 0
    assert dynamic.preemptions < greedy.preemptions  # it only looks until the shortest job finishes


def test_greedy_preempts_the_most_recent_and_recomputes():
    reqs = waves(n_waves=1)
    res = simulate(reqs, ClusterConfig(policy=exact("greedy")))
    assert res.preemptions == sum(r.preemptions for r in res.requests) > 0
    assert res.requests[0].preemptions == 0  # the first admitted is never the most recent


# --- flips ---------------------------------------------------------------------------------------


class Scripted:
    """A flip watcher that issues the given decisions at (or after) the given times and records views."""

    def __init__(self, plan: list[tuple[float, FlipDecision]]) -> None:
        self.plan = sorted(plan, key=lambda x: x[0])
        self.views: list[tuple[float, list[InstanceView]]] = []

    def observe(self, now: float, instances: Sequence[InstanceView], advice: object = None) -> list[FlipDecision]:
        self.views.append((now, list(instances)))
        out = []
        while self.plan and self.plan[0][0] <= now:
            out.append(self.plan.pop(0)[1])
        return out


def test_flip_under_load_loses_and_duplicates_nothing():
    reqs = make_workload("Mixed", 300, seed=7, rate=3.0)
    watcher = Scripted([(5.0, FlipDecision("gpu0", "decode", "test")), (15.0, FlipDecision("gpu3", "prefill", "test"))])
    cfg = ClusterConfig(instances=4, prefill_instances=2, policy=TETRI_POLICY)
    res = simulate(reqs, cfg, watcher=watcher)
    check_conservation(reqs, res)
    flips = {f.instance_id: f for f in res.flips}
    assert set(flips) == {"gpu0", "gpu3"}
    p0, d3 = flips["gpu0"], flips["gpu3"]
    assert p0.started == 5.0 and p0.started <= p0.drained <= p0.done
    assert d3.started == 15.0 and d3.started <= d3.drained <= d3.done
    roles = {i.instance_id: i.roles for i in res.instances}
    assert roles["gpu0"] == ("prefill", "decode") and roles["gpu3"] == ("decode", "prefill")
    for rec in res.requests:
        if rec.prefill_instance == "gpu0":
            assert rec.arrival < p0.started and rec.first_token <= p0.drained
        if rec.decode_instance == "gpu0":
            assert rec.first_token >= p0.done  # served as a decode instance only after the flip
        if rec.decode_instance == "gpu3":
            assert rec.first_token < d3.started and rec.finish <= d3.drained
        if rec.prefill_instance == "gpu3":
            assert rec.arrival >= d3.done
    assert any(r.decode_instance == "gpu0" for r in res.requests)
    assert any(r.prefill_instance == "gpu3" for r in res.requests)
    # the watcher saw d3 draining (its batch took a while to finish), then serving as a prefill instance
    seen = [(v.state, v.role) for t, views in watcher.views for v in views if v.instance_id == "gpu3" and t > 15.0]
    assert ("draining", "decode") in seen and seen[-1] == ("active", "prefill")


def test_never_flips_the_last_instance_of_a_role():
    reqs = make_workload("LPLD", 60, seed=1)
    watcher = Scripted([(1.0, FlipDecision("gpu0", "decode", "t")), (2.0, FlipDecision("gpu1", "prefill", "t"))])
    res = simulate(reqs, ClusterConfig(policy=TETRI_POLICY), watcher=watcher)
    check_conservation(reqs, res)
    assert res.flips == [] and [i.roles for i in res.instances] == [("prefill",), ("decode",)]
    # the idle TransitionWatcher on 1P+1D never flips either, however idle the prefill instance is
    idle = TETRI_POLICY.changed(flip_policy="idle", flip_window_s=1.0, flip_high=0.5)
    res = simulate(make_workload("LPHD", 30, seed=1), ClusterConfig(policy=idle))
    assert res.flips == []


def test_idle_watcher_flips_an_idle_prefill_instance_to_decode():
    reqs = shifting_workload(64, seed=0, rates=(1.5, 0.3), kv_capacity=3408)
    pol = TETRI_POLICY.changed(flip_policy="idle", flip_window_s=10.0)
    cfg = ClusterConfig(instances=4, prefill_instances=2, policy=pol)
    res = simulate(reqs, cfg)
    check_conservation(reqs, res)
    assert res.flips and res.flips[0].from_role == "prefill" and res.flips[0].to_role == "decode"
    assert res.flips[0].started >= 10.0
    fixed = simulate(reqs, ClusterConfig(instances=4, prefill_instances=2, policy=TETRI_POLICY))
    assert fixed.flips == []


# --- the paper's direction and the experiments ------------------------------------------------------


def test_lphd_tetri_ttft_lower_than_vanilla():
    reqs = make_workload("LPHD", 64, seed=0)
    tetri = summarize(simulate(reqs, TETRI))
    vanilla = summarize(simulate(reqs, VANILLA))
    assert tetri["avg_ttft_s"] < vanilla["avg_ttft_s"]
    assert tetri["p99_ttft_s"] < vanilla["p99_ttft_s"]


def test_metrics_definitions():
    reqs = make_workload("LPLD", 30, seed=0)
    res = simulate(reqs, TETRI)
    slo = SloSet(Slo(ttft_s=0.5, tpot_s=0.05), {"LPHD": Slo(ttft_s=0.01, tpot_s=0.05)})
    m = summarize(res, price_per_gpu_hour=3.0, slo=slo)
    assert m["avg_ttft_s"] == pytest.approx(sum(r.ttft for r in res.requests) / 30)
    tpots = [(r.jct - r.ttft) / (r.output_len - 1) for r in res.requests if r.output_len > 1]
    assert m["p99_tpot_s"] == pytest.approx(float(np.percentile(tpots, 99)))
    good = [r for r in res.requests if r.ttft <= 0.5 and r.tpot <= 0.05]  # LPLD: no request is LPHD
    assert len(good) > 0 and m["within_slo"] == len(good) and m["slo_attainment"] == pytest.approx(len(good) / 30)
    wall = max(r.finish for r in res.requests) - min(r.arrival for r in res.requests)
    assert m["wall_s"] == pytest.approx(wall) and m["gpus"] == 2
    assert m["goodput_rps"] == pytest.approx(len(good) / wall)
    assert m["cost_gpu_s"] == pytest.approx(2 * wall)  # provisioned GPUs × wall time
    assert m["busy_s"] == pytest.approx(sum(i.busy_s for i in res.instances)) and m["busy_s"] < m["cost_gpu_s"]
    assert m["perf_per_dollar"] == pytest.approx(len(good) / (2 * wall / 3600 * 3.0))
    change = relative_change(m, {**m, "avg_ttft_s": m["avg_ttft_s"] * 2, "perf_per_dollar": m["perf_per_dollar"] / 2})
    assert change["avg_ttft_s"] == pytest.approx(-0.5) and change["perf_per_dollar"] == pytest.approx(2.0)


def test_a_provisioned_gpu_that_never_runs_still_costs():
    reqs = make_workload("LPLD", 1, seed=0)
    res = simulate(reqs, ClusterConfig(instances=3, prefill_instances=1, policy=TETRI_POLICY))
    idle = [i for i in res.instances if i.first_activity is None]
    assert len(idle) == 1  # one request: one of the two decode instances never runs
    m = summarize(res)
    assert m["gpus"] == 3 and m["cost_gpu_s"] == pytest.approx(3 * m["wall_s"])
    assert m["active_span_s"] < m["cost_gpu_s"]  # the span-based figure counted the idle GPU as free


def test_slos_by_class_and_their_specs():
    slo = parse_slos(["ttft=2,tpot=0.2", "hpld:ttft=5", "LPHD:tpot=0.05"])
    assert slo.default == Slo(2.0, 0.2)
    assert slo.by_class == {"HPLD": Slo(5.0, 0.2), "LPHD": Slo(2.0, 0.05)}
    assert request_class(600, 20) == "HPLD" and request_class(512, 129) == "LPHD"
    rec = RequestRecord("r", 0.0, 600, 21, 0.0, 4.0, 4.0, 6.0, "p", "d", 0, None)  # TTFT 4 s, TPOT 0.1 s
    assert slo.met(rec) and not SloSet(Slo(2.0, 0.2)).met(rec)
    assert parse_slos([]) == SloSet()
    for bad, named in (("ttft=0", "ttft"), ("XX:ttft=1", "'XX'"), ("ttft=fast", "'fast'"), ("lat=1", "'lat=1'"),
                       ("HPLD:", "names no target")):  # fmt: skip
        with pytest.raises(WorkloadSpecError, match=named):
            parse_slos([bad])


def test_run_bench_is_plain_data():
    doc = run_bench(["LPLD", "HPLD"], BenchSetup(n=16))
    json.dumps(doc, allow_nan=False)
    assert [w["workload"] for w in doc["workloads"]] == ["LPLD", "HPLD"]
    for w in doc["workloads"]:
        for system in ("TetriInfer", "vllm-v0", "vllm-v1"):
            assert {k for k, _, _ in HEADLINE} <= set(w["systems"][system])
        assert w["rate_rps"] > 0


def test_flip_ablation_reports_the_flip():
    out = ablation_flip(BenchSetup(n=64))
    fixed, idle, advise = out["rows"]
    assert [r["system"] for r in out["rows"]] == ["fixed split", "flips (idle watcher)", "flips (advise)"]
    assert fixed["flips"] == [] and idle["flips"]
    # 32 decode-heavy requests at 0.19 req/s: 2 a window, too few for the advisor (8), so it keeps the split
    assert advise["flips"] == [] and advise["avg_jct_s"] == fixed["avg_jct_s"]
    json.dumps(out, allow_nan=False)


def test_bad_setups():
    with pytest.raises(WorkloadSpecError):
        BenchSetup(instances=1)
    with pytest.raises(WorkloadSpecError):
        BenchSetup(n=0)
    with pytest.raises(ValueError):
        simulate([Request("x", 0.0, 2000, 100, 100)], TETRI)  # beyond max_model_len
    with pytest.raises(ValueError):
        ClusterConfig(mode="tetri", instances=2, prefill_instances=2)
