"""`ttft_miss` reject (colocated, with `ttft_target_s`): a request not started that has waited past the
target leaves its instance (the plan lists it; the shells answer 429 and record it rejected) instead of
waiting behind those that can still meet theirs; `last` (the default) keeps it, after them."""

from __future__ import annotations

import pytest

from tetri.costmodel import CostModel, load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.metrics import summarize
from tetri.des.mixes import make_mix
from tetri.des.slo import parse_slos
from tetri.scheduling.instance import InstanceScheduler, SchedRequest
from tetri.scheduling.policyset import PolicyError, PolicySet

COST = CostModel(load_profile("llama3-8b-h100"))
REJECT = PolicySet(colocated_schedule="vllm-v1", ttft_target_s=0.5, ttft_miss="reject")


def test_a_request_past_its_target_leaves_and_the_plan_names_it() -> None:
    s = InstanceScheduler("colocated", COST, REJECT, max_num_seqs=1)
    s.add(SchedRequest("busy", 10, 100, arrival=0.0, output_len=100))
    plan = s.schedule(0.0)
    assert plan is not None and plan.admitted == ("busy",) and plan.rejected == ()
    s.complete(plan)
    s.add(SchedRequest("old", 100, 100, arrival=0.1, output_len=5))  # no room: max_num_seqs 1
    s.add(SchedRequest("new", 100, 100, arrival=0.5, output_len=5))
    plan = s.schedule(0.6)  # old has waited exactly its target: not past it
    assert plan is not None and plan.rejected == ()
    s.complete(plan)
    plan = s.schedule(0.7)  # old has waited 0.6 s; new 0.2 s
    assert plan is not None and plan.rejected == ("old",)
    assert "old" not in s and "new" in s and "busy" in s
    s.check()
    s.complete(plan)  # the rest of the plan runs as usual
    assert s.usage().waiting == 1


def test_only_requests_not_started_are_rejected_and_only_when_asked() -> None:
    for pol, gone in (
        (REJECT, ("late",)),
        (REJECT.changed(ttft_miss="last"), ()),
        (REJECT.changed(ttft_target_s=0), ()),
    ):
        s = InstanceScheduler("colocated", COST, pol)
        s.add(SchedRequest("running", 10, 100, arrival=0.0, output_len=100))
        plan = s.schedule(0.0)
        assert plan is not None
        s.complete(plan)
        s.add(SchedRequest("late", 10, 100, arrival=0.0, output_len=5))
        plan = s.schedule(5.0)  # both arrived 5 s ago; one has its first token
        assert plan is not None and plan.rejected == gone, pol
        assert "running" in s


def test_an_idle_instance_still_reports_what_it_rejected() -> None:
    """Nothing else to run: the plan is empty but for the rejection (the shells must see it)."""
    s = InstanceScheduler("colocated", COST, REJECT)
    s.add(SchedRequest("late", 10, 100, arrival=0.0, output_len=5))
    plan = s.schedule(1.0)
    assert plan is not None and plan.pieces == () and plan.rejected == ("late",)
    assert s.schedule(1.0) is None


def test_the_simulator_counts_the_rejected_outside_the_slo() -> None:
    slo = parse_slos(["ttft=0.5,tpot=0.05"])
    reqs = make_mix("rag", 200, 60.0, seed=0)  # far past 4 GPUs' capacity (about 33 req/s)
    cfg = ClusterConfig(mode="vanilla", profile="llama3-8b-h100", instances=4, policy=REJECT, seed=0)
    result = simulate(reqs, cfg)
    assert result.rejected and result.offered == len(reqs) == len(result.requests) + len(result.rejected)
    served = {r.request_id for r in result.requests}
    assert not served & {x.request_id for x in result.rejected}
    assert all(x.rejected - x.arrival > 0.5 for x in result.rejected)
    m = summarize(result, 2.0, slo)
    assert m["rejected"] == len(result.rejected) and m["n"] == len(reqs)
    assert m["slo_attainment"] == sum(slo.met(r) for r in result.requests) / len(reqs)


def test_the_choice_is_a_validated_policy_field() -> None:
    assert PolicySet().ttft_miss == "last"
    with pytest.raises(PolicyError, match="ttft_miss"):
        PolicySet(ttft_miss="drop")


def test_a_migrated_request_is_never_rejected_and_goes_first() -> None:
    """A request resumed on this instance after its first one died has streamed tokens already: it is not
    late whatever it waits, and it goes before the requests not started (as a preempted one does)."""
    s = InstanceScheduler("colocated", COST, REJECT, max_num_seqs=1)
    s.add(SchedRequest("busy", 10, 100, arrival=0.0, output_len=100))
    plan = s.schedule(0.0)
    assert plan is not None
    s.complete(plan)
    s.add(SchedRequest("new", 100, 100, arrival=0.0, output_len=5))
    s.add(SchedRequest("moved", 120, 100, arrival=0.0, output_len=5, resumed=True))
    plan = s.schedule(5.0)
    assert plan is not None and plan.rejected == ("new",) and "moved" in s
    s.abort("busy")
    plan = s.schedule(5.0)
    assert plan is not None and plan.admitted == ("moved",)


def test_a_small_budget_still_gives_a_prompt_a_token_beside_many_decodes() -> None:
    pol = PolicySet(colocated_schedule="vllm-v1", token_budget=2)
    s = InstanceScheduler("colocated", COST, pol)
    for i in range(3):
        s.add(SchedRequest(f"d{i}", 1, 100, arrival=0.0, output_len=50))
    for _ in range(3):
        plan = s.schedule(0.0)
        assert plan is not None
        s.complete(plan)
    s.add(SchedRequest("p", 50, 100, arrival=0.0, output_len=5))
    plan = s.schedule(0.0)
    assert plan is not None and ("p", 0, 1) in [tuple(x) for x in plan.pieces]  # 3 decodes + 1 prompt token


def test_a_prefill_instance_rejects_the_prompts_not_started_past_their_target() -> None:
    """On the split path too: a prompt admitted to the prefill queue (its KV taken eagerly) but with no
    chunk run yet, or still waiting for KV, leaves at the target; one part-way through its prefill stays."""
    pol = PolicySet(chunk_size=512, ttft_target_s=0.5, ttft_miss="reject")
    s = InstanceScheduler("prefill", COST, pol)
    s.add(SchedRequest("started", 2000, 10, arrival=0.0, output_len=5))
    plan = s.schedule(0.0)  # the first 512 tokens of the long prompt
    assert plan is not None and [p.request_id for p in plan.pieces] == ["started"] and plan.rejected == ()
    s.complete(plan)
    s.add(SchedRequest("queued", 100, 10, arrival=0.1, output_len=5))
    s.add(SchedRequest("fresh", 100, 10, arrival=0.6, output_len=5))
    plan = s.schedule(0.7)  # queued waited 0.6 s with nothing run: out; started and fresh stay
    assert plan is not None and plan.kind == "prefill" and plan.rejected == ("queued",)
    assert "queued" not in s and "started" in s and "fresh" in s
    s.check()
    assert all(p.request_id != "queued" for p in plan.pieces)
    # with nothing else to run the plan is empty but for the rejection
    idle = InstanceScheduler("prefill", COST, pol)
    idle.add(SchedRequest("late", 100, 10, arrival=0.0, output_len=5))
    plan = idle.schedule(1.0)
    assert plan is not None and plan.pieces == () and plan.rejected == ("late",) and plan.kind == "prefill"
    assert len(idle) == 0


def test_a_migrated_request_is_never_rejected_on_a_prefill_instance_either() -> None:
    """Its client already has tokens: a rejection then would be a failure (daemon/front/run.py)."""
    s = InstanceScheduler("prefill", COST, PolicySet(ttft_target_s=0.5, ttft_miss="reject"))
    s.add(SchedRequest("moved", 100, 10, arrival=0.0, output_len=5, resumed=True))
    s.add(SchedRequest("late", 100, 10, arrival=0.0, output_len=5))
    plan = s.schedule(2.0)
    assert plan is not None and plan.rejected == ("late",) and "moved" in s
