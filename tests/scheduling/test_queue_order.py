"""`queue_order` srpt (decode and colocated instances): waiting requests are admitted least predicted work
first — a colocated prompt's share of the token budget plus its predicted output, a decode request's
predicted output — with the preempted first and aging, so that a request passed over while
`aging_admissions` others were admitted goes before any newer one; fcfs keeps arrival order."""

from __future__ import annotations

import pytest

from tetri.costmodel import CostModel, load_profile
from tetri.scheduling.instance import InstanceScheduler, SchedRequest
from tetri.scheduling.policyset import PolicyError, PolicySet

COST = CostModel(load_profile("llama3-8b-h100"))
SRPT = PolicySet(colocated_schedule="vllm-v1", queue_order="srpt", predictor="oracle")


def _admit_order(s: InstanceScheduler) -> list[str]:
    """Run iterations until every request has been admitted; the admission order."""
    order: list[str] = []
    while (plan := s.schedule()) is not None:
        order += plan.admitted
        s.complete(plan)
        s.check()
    return order


def test_the_order_and_its_aging_are_validated_policy_fields() -> None:
    assert PolicySet().queue_order == "fcfs"
    with pytest.raises(PolicyError, match="queue_order"):
        PolicySet(queue_order="lifo")
    with pytest.raises(PolicyError, match="aging_admissions"):
        PolicySet(aging_admissions=0)


def test_colocated_srpt_admits_the_least_predicted_work_first_and_fcfs_in_arrival_order() -> None:
    reqs = [
        SchedRequest("long-answer", 100, 4000, (801, 1000)),
        SchedRequest("long-prompt", 4000, 4000, (1, 200)),  # 2 iterations of the 2048-token budget
        SchedRequest("short", 100, 4000, (1, 200)),
        SchedRequest("middle", 100, 4000, (201, 400)),
    ]
    orders = {}
    for order in ("fcfs", "srpt"):
        s = InstanceScheduler("colocated", COST, SRPT.changed(queue_order=order), max_num_seqs=1)
        for r in reqs:
            s.add(SchedRequest(r.request_id, r.prompt_len, r.max_tokens, r.predicted, output_len=3))
        orders[order] = _admit_order(s)
    assert orders["fcfs"] == ["long-answer", "long-prompt", "short", "middle"]
    assert orders["srpt"] == ["short", "long-prompt", "middle", "long-answer"]


def test_without_a_prediction_srpt_orders_by_the_prompt_alone() -> None:
    """max_tokens is a client's limit, not a length: it does not count."""
    s = InstanceScheduler("colocated", COST, SRPT.changed(predictor="none"), max_num_seqs=1)
    s.add(SchedRequest("big", 3000, 10, output_len=2))
    s.add(SchedRequest("small-prompt-big-limit", 10, 8000, output_len=2))
    assert _admit_order(s) == ["small-prompt-big-limit", "big"]


def test_aging_lets_a_long_request_in_after_aging_admissions_others() -> None:
    s = InstanceScheduler("colocated", COST, SRPT.changed(aging_admissions=3), max_num_seqs=1)
    s.add(SchedRequest("long", 100, 4000, (801, 1000), output_len=2))
    for i in range(8):
        s.add(SchedRequest(f"s{i}", 100, 4000, (1, 200), output_len=2))
    order = _admit_order(s)
    assert order.index("long") == 3  # three short ones overtook it, then it went first
    never = InstanceScheduler("colocated", COST, SRPT, max_num_seqs=1)  # aging 256: it waits for all eight
    for r in ("long", *(f"s{i}" for i in range(8))):
        never.add(SchedRequest(r, 100, 4000, (801, 1000) if r == "long" else (1, 200), output_len=2))
    assert _admit_order(never)[-1] == "long"


def test_decode_srpt_orders_by_predicted_output_alone() -> None:
    s = InstanceScheduler("decode", COST, SRPT, max_num_seqs=1)
    s.add(SchedRequest("short-prompt-long-answer", 10, 900, (401, 600), output_len=3), produced=1)
    s.add(SchedRequest("long-prompt-short-answer", 3000, 900, (1, 200), output_len=3), produced=1)
    plan = s.schedule()
    assert plan is not None and plan.pulled == ("long-prompt-short-answer",)


def test_a_preempted_request_goes_before_less_work() -> None:
    """As in vLLM: its client has part of its answer."""
    s = InstanceScheduler("colocated", COST, SRPT, kv_capacity=230, max_num_seqs=2)
    s.add(SchedRequest("a", 100, 900, (401, 600), output_len=40))
    s.add(SchedRequest("b", 100, 900, (401, 600), output_len=40))
    preempted: tuple[str, ...] = ()
    while not preempted:
        plan = s.schedule()
        assert plan is not None
        preempted = plan.preempted
        s.complete(plan)
    s.add(SchedRequest("tiny", 5, 900, (1, 200), output_len=2))
    order = _admit_order(s)
    assert order[0] == preempted[0] and "tiny" in order


def test_a_request_past_its_ttft_target_goes_after_those_that_can_still_meet_theirs() -> None:
    """`ttft_target_s` (colocated): serving a request that has already missed its TTFT delays the ones
    that can still make it; off (0) by default, as in vLLM."""
    for target, first in ((0.0, "old"), (0.5, "new")):
        s = InstanceScheduler(
            "colocated", COST, PolicySet(colocated_schedule="vllm-v1", ttft_target_s=target), max_num_seqs=1
        )
        s.add(SchedRequest("old", 100, 900, arrival=0.0, output_len=2))
        s.add(SchedRequest("new", 100, 900, arrival=0.9, output_len=2))
        plan = s.schedule(1.0)  # old has waited 1 s: past a 0.5 s target; new 0.1 s
        assert plan is not None and plan.admitted == (first,), target
        order = list(plan.admitted)
        s.complete(plan)
        while (plan := s.schedule(2.0)) is not None:
            order += plan.admitted
            s.complete(plan)
        assert sorted(order) == ["new", "old"]  # the late one is still served, after


def test_the_ttft_target_is_a_validated_policy_field() -> None:
    for bad in (-1, float("nan"), float("inf"), True):
        with pytest.raises(PolicyError, match="ttft_target_s"):
            PolicySet(ttft_target_s=bad)


def test_a_late_request_is_served_once_aging_admissions_others_went_before_it() -> None:
    """Put last for missing its TTFT, it does not starve under a stream of requests that are on time."""
    pol = PolicySet(colocated_schedule="vllm-v1", ttft_target_s=0.5, aging_admissions=2)
    s = InstanceScheduler("colocated", COST, pol, max_num_seqs=1)
    s.add(SchedRequest("old", 100, 900, arrival=0.0, output_len=1))
    order: list[str] = []
    for i in range(5):  # a fresh request at every iteration: on time, ahead of the late one until it aged
        now = 10.0 + i
        s.add(SchedRequest(f"new{i}", 100, 900, arrival=now, output_len=1))
        plan = s.schedule(now)
        assert plan is not None
        order += plan.admitted
        s.complete(plan)
    assert order[:3] == ["new0", "new1", "old"]
