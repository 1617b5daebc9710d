"""Exact parity: the discrete-event simulator and the live sim engine, fed the same requests at the same
model times, make the same iterations — the same plans (pieces, padding, admissions, preemptions, KV
pulls, durations, KV in use) at the same instants, compared with ==, not within a tolerance.

The live side is the real `SimEngine` (its asyncio loop, its token streams) on a `VirtualClock`, with a
client per request doing what the worker service does: prefill, hand the KV to the decode engine
(`load_kv` returns when the decode instance pulls it), release it on the prefill engine, stream the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Sequence

import pytest

from tetri.costmodel import load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.sessions import make_sessions
from tetri.des.workloads import Request, make_workload, replay_tokens
from tetri.scheduling.instance import IterationPlan
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import make_predictor
from workers.engines.base import EngineRequest, Rejected
from workers.engines.sim import SimEngine

from .virtual_clock import VirtualClock

PROFILE = "opt-13b-v100"
Trace = dict[str, list[tuple[float, IterationPlan]]]


def _workload(name: str, n: int, rate: float, seed: int) -> list[Request]:
    cap = load_profile(PROFILE)
    reqs = make_workload(name, n, seed=seed, rate=rate, max_model_len=cap.model.max_model_len, kv_capacity=3408)
    # The sim engine produces max_tokens tokens: make that the answer length on both sides.
    return [dataclasses.replace(r, max_tokens=r.output_len) for r in reqs]


def _simulated(reqs: Sequence[Request], config: ClusterConfig) -> Trace:
    trace: Trace = {}
    simulate(reqs, config, on_plan=lambda iid, t, plan: trace.setdefault(iid, []).append((t, plan)), check_kv=True)
    return trace


def _roles(config: ClusterConfig) -> list[tuple[str, str]]:
    """The instances' ids and roles, as the simulator numbers them."""
    if config.mode != "tetri":
        return [(f"gpu{i}", "colocated") for i in range(config.instances)]
    n_p, n_c = config.prefill_instances, config.colocated_instances
    roles = ["prefill"] * n_p + ["decode"] * (config.instances - n_p - n_c) + ["colocated"] * n_c
    return [(f"gpu{i}", role) for i, role in enumerate(roles)]


def _live(
    reqs: Sequence[Request], config: ClusterConfig, routes: dict[str, tuple[str, str | None]] | None = None
) -> Trace:
    """The live engines' plans; `routes` (request id → entry instance, decode instance) where the cluster
    has more than one instance of a role (the simulator's choices), else the one prefill/decode pair or
    colocated instance."""
    profile = load_profile(PROFILE)
    pol = config.policy
    predictor = make_predictor(pol.predictor, pol.predictor_accuracy, pol.predictor_granularity, config.seed)
    trace: Trace = {}

    async def main() -> None:
        clock = VirtualClock()

        def engine(role: str, iid: str) -> SimEngine:
            e = SimEngine(profile, role, iid, clock, policies=pol, chunked=config.chunked)
            e.on_plan = lambda t, plan: trace.setdefault(iid, []).append((t, plan))
            return e

        async def tetri(pre: SimEngine, dec: SimEngine, r: Request, ereq: EngineRequest) -> None:
            try:
                out = await pre.prefill(ereq)
            except Rejected:  # turned away past its TTFT target, before its first token
                assert pol.ttft_miss == "reject"
                return
            if ereq.max_tokens > 1:
                await dec.load_kv(ereq, out.kv)  # returns once the decode engine's admission pulled it
            await pre.release_kv(ereq.request_id)
            if ereq.max_tokens > 1:
                tokens = [t async for t in dec.decode(ereq, out.first_token)]
                assert len(tokens) == ereq.max_tokens - 1

        async def vanilla(co: SimEngine, ereq: EngineRequest) -> None:
            tokens: list[int] = []
            try:
                async for t in co.generate(ereq):
                    tokens.append(t)
            except Rejected:  # turned away past its TTFT target, before its first token
                assert pol.ttft_miss == "reject" and not tokens
                return
            assert len(tokens) == ereq.max_tokens

        async def client(r: Request, engines: dict[str, SimEngine]) -> None:
            await clock.sleep_until(r.arrival)
            pred = predictor.predict((), r.request_id, r.output_len) if predictor is not None else None
            ereq = EngineRequest(r.request_id, tuple(replay_tokens(r)), r.max_tokens, pred)
            entry, decode = (
                routes[r.request_id] if routes else (("gpu0", "gpu1") if config.mode == "tetri" else ("gpu0", None))
            )
            if engines[entry].role == "prefill":
                assert decode is not None or r.max_tokens == 1
                await tetri(engines[entry], engines[decode or entry], r, ereq)
            else:
                await vanilla(engines[entry], ereq)

        async def cluster() -> None:
            engines = {iid: engine(role, iid) for iid, role in _roles(config)}
            for e in engines.values():
                await e.start()
                if e.role != "prefill" and config.plan_order:
                    e.set_plan(config.plan_order)
            await asyncio.gather(*(client(r, engines) for r in reqs))
            for e in engines.values():
                await e.stop()

        await clock.run(cluster())

    asyncio.run(main())
    return trace


def _assert_same(live: Trace, sim: Trace) -> None:
    assert live.keys() == sim.keys()
    for iid in sim:
        assert len(live[iid]) == len(sim[iid]), iid
        for i, (a, b) in enumerate(zip(live[iid], sim[iid], strict=True)):
            assert a == b, f"{iid}: plan {i} differs\n live: {a}\n  sim: {b}"


TETRI = ClusterConfig(mode="tetri", profile=PROFILE, instances=2, prefill_instances=1)


@pytest.mark.parametrize(
    ("workload", "policy"),
    [
        ("LPHD", PolicySet()),
        ("Mixed", PolicySet(prefill_policy="sjf", predictor="oracle", decode_admission="reserve-dynamic")),
        ("HPHD", PolicySet(predictor="oracle", decode_admission="reserve-static", reserve_point="upper")),
        ("LPLD", PolicySet(decode_admission="plan", predictor="oracle")),
        ("Mixed", PolicySet(queue_order="srpt", predictor="oracle", predictor_accuracy=0.749, aging_admissions=8)),
        ("HPLD", PolicySet(ttft_target_s=0.5, ttft_miss="reject")),
    ],
)
def test_simulator_and_live_engines_make_the_same_iterations_disaggregated(workload: str, policy: PolicySet):
    reqs = _workload(workload, 48, rate=4.0, seed=3)
    config = dataclasses.replace(TETRI, policy=policy)
    if policy.decode_admission == "plan":  # a plan admission order unlike arrival order, some ids not sent
        order = [r.request_id for r in reqs]
        random.Random(1).shuffle(order)
        config = dataclasses.replace(config, plan_order=(*order[:40], "never-sent"))
    sim = _simulated(reqs, config)
    rejected = [rid for _, p in sim["gpu0"] for rid in p.rejected]
    if policy.ttft_miss == "reject":  # the prefill instance turned some away; the rest were served
        assert rejected and len(set(rejected)) == len(rejected) < len(reqs)
    # every request served was pulled once
    assert sum(len(p.pulled) for _, p in sim["gpu1"]) == len(reqs) - len(rejected)
    _assert_same(_live(reqs, config), sim)


def test_simulator_and_live_engines_agree_on_a_burst_arriving_at_one_instant():
    reqs = _workload("Mixed", 40, rate=math.inf, seed=11)  # every event of t = 0 is in before anyone plans
    sim = _simulated(reqs, TETRI)
    assert len(sim["gpu0"][0][1].pieces) > 1  # the first chunk already merges several prompts
    _assert_same(_live(reqs, TETRI), sim)


def test_simulator_and_live_engine_make_the_same_iterations_with_chunking_off_and_preemptions():
    reqs = _workload("HPHD", 40, rate=8.0, seed=5)
    config = dataclasses.replace(TETRI, chunked=False)
    sim = _simulated(reqs, config)
    assert any(p.preempted for _, p in sim["gpu1"])  # the run exercises preemption and recomputation
    _assert_same(_live(reqs, config), sim)


@pytest.mark.parametrize(
    "policy",
    [
        PolicySet(),
        PolicySet(predictor="oracle", decode_admission="reserve-dynamic"),
        PolicySet(colocated_schedule="vllm-v0"),
        PolicySet(colocated_schedule="vllm-v1"),
        PolicySet(colocated_schedule="vllm-v1", queue_order="srpt", predictor="oracle", predictor_accuracy=0.749),
        PolicySet(colocated_schedule="vllm-v1", queue_order="srpt", aging_admissions=4),
        PolicySet(colocated_schedule="vllm-v1", queue_order="srpt", predictor="oracle", ttft_target_s=0.5),
        PolicySet(colocated_schedule="vllm-v1", ttft_target_s=0.5),
        PolicySet(colocated_schedule="vllm-v1", ttft_target_s=0.05, token_budget=96),
        PolicySet(
            colocated_schedule="vllm-v1", queue_order="srpt", predictor="oracle", ttft_target_s=0.5, ttft_miss="reject"
        ),
        PolicySet(colocated_schedule="vllm-v0", ttft_target_s=0.5, ttft_miss="reject"),
    ],
    ids=[
        "prefill-first",
        "prefill-first-reserve-dynamic",
        "vllm-v0",
        "vllm-v1",
        "vllm-v1-srpt",
        "vllm-v1-srpt-aged",
        "vllm-v1-srpt-ttft",
        "vllm-v1-ttft",
        "vllm-v1-token-budget",
        "vllm-v1-srpt-reject",
        "vllm-v0-reject",
    ],
)
def test_simulator_and_live_engine_make_the_same_iterations_colocated(policy: PolicySet):
    reqs = _workload("Mixed", 48, rate=6.0, seed=7)
    config = ClusterConfig(mode="vanilla", profile=PROFILE, instances=1, policy=policy)
    sim = _simulated(reqs, config)
    kinds = {p.kind for _, p in sim["gpu0"]}
    if policy.colocated_schedule == "vllm-v1":  # prefill chunks ride in the decode batches
        assert "mixed" in kinds
    else:
        assert {"prefill", "decode"} <= kinds and "mixed" not in kinds
    if policy.colocated_schedule == "vllm-v0":
        assert any(p.padding for _, p in sim["gpu0"])
    if policy.ttft_miss == "reject":  # some requests turned away, the rest served
        rejected = [rid for _, p in sim["gpu0"] for rid in p.rejected]
        assert rejected and len(set(rejected)) == len(rejected) < len(reqs)
    if policy.token_budget:  # iterations both within the budget and, a prompt urgent, past it
        sizes = {sum(x.tokens for x in p.pieces) for _, p in sim["gpu0"]}
        assert policy.token_budget in sizes and max(sizes) > policy.token_budget
    _assert_same(_live(reqs, config), sim)


@pytest.mark.parametrize(
    "policy",
    [
        PolicySet(colocated_schedule="vllm-v1", pd_route="length", pd_prompt_tokens=100),
        PolicySet(
            colocated_schedule="vllm-v1",
            pd_route="length",
            pd_prompt_tokens=300,
            pd_output_tokens=400,
            pd_backlog_slack=2,
            predictor="oracle",
            predictor_accuracy=0.749,
            queue_order="srpt",
        ),
    ],
    ids=["length", "length-predicted-srpt-slack"],
)
def test_simulator_and_live_engines_make_the_same_iterations_in_a_hybrid_cluster(policy: PolicySet):
    """Colocated, prefill and decode instances at once: each request on the path the simulator's
    `choose_path` gave it, the live engines plan exactly as the simulated ones."""
    reqs = _workload("Mixed", 48, rate=6.0, seed=9)
    config = ClusterConfig(mode="tetri", profile=PROFILE, instances=3, prefill_instances=1, colocated_instances=1)
    config = dataclasses.replace(config, policy=policy)
    routes: dict[str, tuple[str, str | None]] = {}

    sim: Trace = {}
    result = simulate(
        reqs, config, on_plan=lambda iid, t, plan: sim.setdefault(iid, []).append((t, plan)), check_kv=True
    )
    for rec in result.requests:
        routes[rec.request_id] = (rec.prefill_instance, rec.decode_instance)
    assert {entry for entry, _ in routes.values()} == {"gpu0", "gpu2"}  # both paths taken
    _assert_same(_live(reqs, config, routes), sim)


def _sessions(name: str, n: int, rate: float, seed: int) -> list[Request]:
    cap = load_profile(PROFILE)
    reqs = make_sessions(name, n, rate, seed, max_model_len=cap.model.max_model_len)
    return [dataclasses.replace(r, max_tokens=r.output_len) for r in reqs]


@pytest.mark.parametrize("name", ["chat-sessions", "rag-docs"])
def test_the_prefix_caches_hit_alike_live_and_simulated_colocated(name: str):
    """Conversations and a shared document set on one colocated instance: the live engine keys its prompts
    on their tokens, the simulator on the trace's hash ids; the plans (each prefill starting after its
    cached blocks, evictions, preemptions) are the same."""
    reqs = _sessions(name, 60, rate=3.0, seed=2)
    config = ClusterConfig(mode="vanilla", profile=PROFILE, instances=1, policy=PolicySet(colocated_schedule="vllm-v1"))
    sim = _simulated(reqs, config)
    assert any(p.start > 0 and p.tokens > 1 for _, plan in sim["gpu0"] for p in plan.pieces if plan.kind != "decode")
    _assert_same(_live(reqs, config), sim)


def test_the_prefix_caches_hit_alike_live_and_simulated_split_and_across_instances():
    """Agent loops on 2 prefill and 2 decode instances, routed cache-aware by the simulator: the live engines
    given the same routes hit their caches as the simulated ones (a decode instance pulls only the blocks
    it lacks: its transfer is shorter, and the plans' times say so)."""
    reqs = _sessions("agent", 40, rate=2.0, seed=4)
    config = ClusterConfig(
        mode="tetri", profile=PROFILE, instances=4, prefill_instances=2, policy=PolicySet(cache_slack=1)
    )
    sim: Trace = {}
    result = simulate(
        reqs, config, on_plan=lambda iid, t, plan: sim.setdefault(iid, []).append((t, plan)), check_kv=True
    )
    routes = {rec.request_id: (rec.prefill_instance, rec.decode_instance) for rec in result.requests}
    assert {entry for entry, _ in routes.values()} == {"gpu0", "gpu1"}
    assert sum(rec.cached_tokens for rec in result.requests) > 0  # prefill instances hit
    assert all(i.prefix_hit_tokens > 0 for i in result.instances if i.instance_id in ("gpu2", "gpu3"))  # and decode
    _assert_same(_live(reqs, config, routes), sim)
