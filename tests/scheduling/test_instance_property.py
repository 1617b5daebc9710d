"""The instance scheduler under random operation sequences (add, abort, release, loaded, iterations,
policy hot-swaps, plan changes), for every role: after every step its KV invariants hold (`check()`),
its counts add up and token indices run without gaps; at the end every request finishes — no policy,
plan included, can leave a request stuck."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetri.costmodel import CostModel, load_profile
from tetri.scheduling.instance import InstanceScheduler, IterationPlan, Outcome, Phase, SchedRequest
from tetri.scheduling.policyset import PolicySet

from .driver import LIFECYCLE, Driver

COST = CostModel(load_profile("tiny"))

policies = st.builds(
    PolicySet,
    prefill_policy=st.sampled_from(["fcfs", "sjf", "ljf"]),
    chunk_size=st.sampled_from([16, 64, 512]),
    decode_admission=st.sampled_from(["greedy", "reserve-static", "reserve-dynamic", "plan"]),
    reserve_point=st.sampled_from(["lower", "mid", "upper"]),
    prefill_sched_batch=st.sampled_from([1, 4, 16]),
    colocated_schedule=st.sampled_from(["prefill-first", "vllm-v0", "vllm-v1"]),
    queue_order=st.sampled_from(["fcfs", "srpt"]),
    aging_admissions=st.sampled_from([1, 3, 256]),
    ttft_target_s=st.sampled_from([0.0, 0.01, 1.0]),
    token_budget=st.sampled_from([0, 1, 64]),
    ttft_miss=st.sampled_from(["last", "reject"]),
)
predictions = st.one_of(st.none(), st.tuples(st.integers(1, 100), st.integers(100, 300)))
operations = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 300), st.integers(1, 200), predictions),
    *LIFECYCLE,
    st.tuples(st.just("configure"), policies, st.booleans()),
    st.tuples(st.just("plan"), st.lists(st.integers(0, 60), max_size=8)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    role=st.sampled_from(["prefill", "decode", "colocated"]),
    policy=policies,
    chunked=st.booleans(),
    capacity=st.sampled_from([None, 400, 700]),
    ops=st.lists(operations, max_size=80),
)
def test_invariants_hold_at_every_step_and_every_request_finishes(
    role: str, policy: PolicySet, chunked: bool, capacity: int | None, ops: list[tuple]
):
    s = InstanceScheduler(role, COST, policy, chunked=chunked, kv_capacity=capacity, max_num_seqs=8)
    first = 1 if role == "decode" else 0
    ids: list[str] = []
    produced: dict[str, int] = {}
    clock = [0.0]  # model time: each planned iteration advances it by its duration (the deadline's clock)

    def planned(plan: IterationPlan) -> None:
        assert plan.kv_used <= s.capacity
        assert not any(rid in s for rid in plan.rejected)  # a rejected request is gone

    def done(plan: IterationPlan, out: Outcome) -> None:
        clock[0] += plan.duration
        for rid, index in out.tokens:
            assert index == produced.get(rid, first), (rid, index)  # no token skipped or repeated
            produced[rid] = index + 1

    engine = Driver(s, lambda: clock[0], planned, done)
    step = engine.step

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, prompt, max_tokens, predicted = op
            peak = prompt + max_tokens - 1 if role != "prefill" else prompt
            if peak > s.capacity or (role == "decode" and max_tokens < 2):
                continue
            rid = f"r{len(ids)}"
            ids.append(rid)
            s.add(SchedRequest(rid, prompt, max_tokens, predicted, arrival=clock[0]), produced=first)
        elif kind in ("abort", "release", "loaded") and ids:
            getattr(s, kind)(ids[op[1] % len(ids)])
        elif kind == "step":
            step()
        elif kind == "configure":
            s.configure(op[1], chunked=op[2])
        elif kind == "plan" and ids:
            s.set_plan([ids[i % len(ids)] for i in op[1]])
        s.check()
        u = s.usage()
        assert u.running + u.waiting + u.held == len(s)
        assert u.heavy + u.light == (len(s) if role == "decode" else 0)
        assert u.predicted_growth_tokens >= 0
        assert u.held == sum(1 for rid in ids if s.phase(rid) is Phase.HELD)

    # Liveness: with the plan left as it is, release what is held and load what is pulled: all finish.
    engine.finish_all(ids)
    assert len(s) == 0, {rid: s.phase(rid) for rid in ids if rid in s} | {"plan": s.plan_order}


def test_plan_admission_does_not_wait_for_a_planned_request_that_is_not_here():
    # A decode instance whose plan names a request that has not arrived (it may be queued on the prefill
    # instance behind KV held for the requests waiting here) still admits those: no stall, no deadlock.
    s = InstanceScheduler("decode", COST, PolicySet(decode_admission="plan"), kv_capacity=3000)
    s.set_plan(["absent", "b"])
    s.add(SchedRequest("c", 1000, 100), produced=1)  # not in the plan
    s.add(SchedRequest("b", 1000, 100), produced=1)
    plan = s.schedule()
    assert plan is not None and plan.pulled == ("b", "c")  # the planned one first, then the others
    assert s.plan_order == ("absent",)
