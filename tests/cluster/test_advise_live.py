"""`tetrictl advise` against a live sim cluster, as an operator runs it: the history served live is
exported as a trace (`tetrictl requests export`), advised on (`tetrictl advise --trace … --apply`: the
policies set and the instances flipped to the advised split), and the same trace served again gets the
goodput the simulator predicted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tetri.des.advise import AdviceSpec, expected_outcome, offered_rate, outcome
from tetri.des.mixes import make_mix
from tetri.des.slo import parse_slos
from tetri.des.trace import read_trace
from tetri.des.workloads import make_workload
from tetri.scheduling.flip import ROLES, flip_path
from tetrictl.advise_cmd import describe
from tetrictl.bench_live import replay_on

from .harness import start_cluster

pytestmark = pytest.mark.slow

PROFILE = "llama3-8b-h100"
SCALE = 0.25  # model seconds per wall second: 250 requests/s of model time are 62/s of the wall
SLO = ["ttft=0.2,tpot=0.015"]


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=600)


def test_advise_on_an_exported_trace_applies_and_the_live_rerun_gets_the_predicted_goodput(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode", "decode", "decode"], profile=PROFILE, time_scale=SCALE)
    try:
        history = make_workload("Mixed", 160, seed=0, rate=250.0, max_model_len=8192)
        replay_on(c.url, history, SCALE, 4)
        trace_file = tmp_path / "trace.jsonl"
        r = tetrictl("requests", "export", "--url", c.url, "--output", str(trace_file))
        assert r.returncode == 0, r.stderr
        trace = read_trace(trace_file.read_text().splitlines())
        assert len(trace) == 160
        # a P/D split or a hybrid (colocated instances as vllm-v1): at this rate the advice is a hybrid, the
        # long prompts split and the short colocated (the same JCT-deciding goodput tie as the simulator's
        # 1C+2P+1D over 3P+1D on this trace), which takes flips between the three roles
        args = ["advise", "--trace", str(trace_file), "--profile", PROFILE, "--gpus", "4", "--chunks", "256"]
        args += ["--baseline", "vllm-v1", "--mode", "disaggregated,hybrid", "--slo", SLO[0]]
        args += ["--apply", "--url", c.url, "--json"]
        r = tetrictl(*args)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        advice = doc["advice"]
        assert advice["mode"] == "hybrid", describe(advice)
        want = {r: advice[r] for r in ROLES}
        assert len(doc["applied"]["flips"]) == len(flip_path({"prefill": 1, "decode": 3}, want) or "?")
        with httpx.Client(base_url=c.url, timeout=10) as h:
            insts = h.get("/api/v1/instances").json()["instances"]
            policies = h.get("/api/v1/policies").json()["policies"]
            audit = h.get("/api/v1/policies/history").json()["changes"]
        assert Counter(i["role"] for i in insts) == Counter({r: n for r, n in want.items() if n})
        assert all(policies[k] == v for k, v in advice["policies"].items())
        assert sorted(a["field"] for a in audit) == doc["applied"]["changed"]  # every change audited
        result = replay_on(c.url, trace, SCALE, 4)
    finally:
        c.stop()
    spec = AdviceSpec(profile=PROFILE, gpus=4, slo=parse_slos(SLO))
    live = outcome(result, spec.slo, spec.price, offered_rate(trace))
    assert live["goodput_rps"] == pytest.approx(advice["outcome"]["goodput_rps"], rel=0.10)


def test_past_vllm_v1s_capacity_the_advised_colocated_policies_get_the_predicted_goodput(tmp_path: Path):
    """An overloaded point of the SLO matrix's chat mix (docs/bench.md): 240 requests at 400 req/s on 4 GPUs,
    where vllm-v1 serves under half within TTFT ≤ 0.5 s and TPOT ≤ 50 ms. An operator of a colocated vllm-v1
    cluster exports the history, advises among the colocated setups (rejecting allowed), applies it in place
    (policies only) and serves the same trace again: the live goodput and rejections are the predicted.

    The advice sorts by lengths from an oracle right 74.9% of the time, which draws its mistakes per request
    id: the rerun keeps ids of its own, and the prediction it is held to is the simulator's for those ids
    (the advice's figure is one draw of those mistakes; docs/bench.md gives their spread).

    At this point the goodput is also a draw of the arrival times: moving them by up to a wall millisecond
    (0.2 ms of model time; the control plane's own latency is of that order) moves the advice's goodput
    from −6% to +9% of its mean and vllm-v1's up to +17% (docs/bench.md), so one simulated figure against
    one live run fails now and then, either way. The win and the live run are held to the simulator's mean
    over moved arrivals (`expected_outcome`)."""
    chat_scale = 0.2
    jitter = 1e-3 * chat_scale  # a wall millisecond, in model seconds
    c = start_cluster(tmp_path, ["colocated"] * 4, mode="colocated", profile=PROFILE, time_scale=chat_scale)
    slo = "ttft=0.5,tpot=0.05"
    try:
        with httpx.Client(base_url=c.url, timeout=10) as h:  # vLLM v1's schedule, as vLLM runs it
            assert h.put("/api/v1/policies", json={"colocated_schedule": "vllm-v1"}).status_code == 200
        replay_on(c.url, make_mix("chat", 240, 400.0, seed=0), chat_scale, 4)
        trace_file = tmp_path / "trace.jsonl"
        r = tetrictl("requests", "export", "--url", c.url, "--output", str(trace_file))
        assert r.returncode == 0, r.stderr
        trace = read_trace(trace_file.read_text().splitlines())
        args = ["advise", "--trace", str(trace_file), "--profile", PROFILE, "--gpus", "4", "--mode", "colocated"]
        args += ["--baseline", "vllm-v1", "--slo", slo, "--ttft-miss", "last,reject", "--apply", "--url", c.url]
        r = tetrictl(*args, "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        advice = doc["advice"]
        assert advice["mode"] == "colocated" and advice["policies"]["ttft_target_s"] == 0.5
        spec = AdviceSpec(profile=PROFILE, gpus=4, slo=parse_slos([slo]))
        base = expected_outcome(trace, spec, {"mode": "colocated"} | doc["baselines"]["vllm-v1"], jitter)
        win = expected_outcome(trace, spec, advice, jitter)
        assert win["goodput_rps"] >= 1.3 * base["goodput_rps"]  # the matrix's win, on this history
        with httpx.Client(base_url=c.url, timeout=10) as h:
            policies = h.get("/api/v1/policies").json()["policies"]
        assert all(policies[k] == advice["policies"][k] for k in doc["applied"]["changed"])
        again = [replace(r, request_id=f"again-{r.request_id}") for r in trace]
        result = replay_on(c.url, again, chat_scale, 4, keep_ids=True)
    finally:
        c.stop()
    predicted = expected_outcome(again, spec, advice, jitter)
    live = outcome(result, spec.slo, spec.price, offered_rate(trace))
    assert live["goodput_rps"] == pytest.approx(predicted["goodput_rps"], rel=0.10)
    # the rejections sit on the TTFT deadline, where the control plane's own latency (unmodelled; a client-
    # chosen id adds a status-table lookup) moves them: 55 live against 71 simulated (one draw) in one
    # full-suite run, the goodput within 10% all the same
    assert live["rejected"] == pytest.approx(predicted["rejected"], abs=0.1 * len(trace))
