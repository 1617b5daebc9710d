"""KV is conserved at every event: over random workloads, policies and cluster shapes, each instance's used
KV equals the sum of what its requests hold and never exceeds its capacity, and every request whose KV
exists is charged to exactly one instance (prefill until the decode instance pulls it, then decode).
The simulator checks this after every event and every planning round (`check_kv=True`); a break raises."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetri.costmodel import CostModel, load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.workloads import Request
from tetri.scheduling.instance import IterationPlan
from tetri.scheduling.policyset import PolicySet

PROFILE = load_profile("opt-13b-v100")
CAP = CostModel(PROFILE).kv_capacity_tokens()  # 3,408 tokens: memory binds quickly


@st.composite
def workloads(draw: st.DrawFn) -> list[Request]:
    n = draw(st.integers(1, 40))
    reqs = []
    t = 0.0
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 1.0, 5.0]))  # bursts and gaps
        prompt = draw(st.integers(1, 1500))
        room = PROFILE.model.max_model_len - prompt  # prompt + max_tokens fits the model
        output = draw(st.integers(1, min(800, CAP - prompt + 1, room)))
        reqs.append(Request(f"r{i}", t, prompt, output, min(room, output + draw(st.integers(0, 50)))))
    return reqs


policies = st.builds(
    PolicySet,
    prefill_policy=st.sampled_from(["fcfs", "sjf", "ljf"]),
    chunk_size=st.sampled_from([64, 512, 2048]),
    predictor=st.sampled_from(["none", "oracle"]),
    predictor_accuracy=st.sampled_from([1.0, 0.5]),
    dispatch=st.sampled_from(["pot", "least-kv"]),
    decode_admission=st.sampled_from(["greedy", "reserve-static", "reserve-dynamic", "plan"]),
    reserve_point=st.sampled_from(["lower", "mid", "upper"]),
    flip_policy=st.sampled_from(["off", "idle"]),
    flip_window_s=st.sampled_from([0.5, 5.0]),
    flip_low=st.just(0.3),
    flip_high=st.just(0.5),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=workloads(),
    policy=policies,
    shape=st.sampled_from([("tetri", 2, 1), ("tetri", 3, 1), ("tetri", 4, 2), ("vanilla", 1, 1), ("vanilla", 2, 1)]),
    chunked=st.booleans(),
)
def test_kv_is_charged_to_exactly_one_instance_at_every_event(
    reqs: list[Request], policy: PolicySet, shape: tuple[str, int, int], chunked: bool
):
    mode, instances, prefill = shape
    config = ClusterConfig(
        mode=mode,
        profile=PROFILE,
        instances=instances,
        prefill_instances=prefill,
        policy=policy,
        chunked=chunked,
        watch_interval_s=0.5,
    )
    result = simulate(reqs, config, check_kv=True)  # raises AssertionError at the first broken invariant
    assert len(result.requests) == len(reqs)
    assert all(r.finish >= r.first_token >= r.prefill_start >= r.arrival for r in result.requests)


def test_a_prefill_instance_full_of_unpulled_kv_stops_admitting_prompts():
    # The decode instance reserves for the whole answer (exact prediction, reserve-static): two requests
    # of 1,000 + 600 fit its 3,408 tokens, a third does not. Prefilled prompts then wait for it with their
    # KV still held on the prefill instance (3 × 1,000 tokens fill it), which admits no more prompts
    # until a pull frees room: the 6th prompt starts only after the decode instance finished a request.
    reqs = [Request(f"r{i}", 0.0, 1000, 600, 600) for i in range(8)]
    held: list[int] = []

    def on_plan(iid: str, t: float, plan: IterationPlan) -> None:
        if iid == "gpu0":
            held.append(plan.kv_used)

    policy = PolicySet(predictor="oracle", predictor_granularity=1, decode_admission="reserve-static")
    config = ClusterConfig(mode="tetri", profile=PROFILE, instances=2, prefill_instances=1, policy=policy)
    result = simulate(reqs, config, on_plan=on_plan, check_kv=True)
    assert CAP - 1000 < max(held) <= CAP  # it filled up with held KV
    starts = sorted(r.prefill_start for r in result.requests)
    finishes = sorted(r.finish for r in result.requests)
    assert starts[4] < finishes[0] <= starts[5]
