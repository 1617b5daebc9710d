"""`token_budget` (colocated vllm-v1): fewer prompt tokens ride with the decodes in an iteration, so an
iteration is shorter; with `ttft_target_s`, an iteration takes the engine's whole budget once the oldest
prompt not started has waited half the target, so the TTFT's slack is what pays for the lower TPOT."""

from __future__ import annotations

import pytest

from tetri.costmodel import CostModel, load_profile
from tetri.scheduling.instance import URGENT, InstanceScheduler, SchedRequest
from tetri.scheduling.policyset import PolicyError, PolicySet

COST = CostModel(load_profile("llama3-8b-h100"))  # the engine's budget: 2048 tokens an iteration
V1 = PolicySet(colocated_schedule="vllm-v1")


def _prompt_tokens(s: InstanceScheduler, now: float) -> int:
    plan = s.schedule(now)
    assert plan is not None
    running = {p.request_id for p in plan.pieces if p.tokens == 1 and p.start > 0}
    tokens = sum(p.tokens for p in plan.pieces if p.request_id not in running)
    s.complete(plan)
    s.check()
    return tokens


def test_off_by_default_the_engine_budget_is_taken() -> None:
    s = InstanceScheduler("colocated", COST, V1)
    s.add(SchedRequest("a", 3000, 100, arrival=0.0, output_len=5))
    assert _prompt_tokens(s, 0.0) == 2048


def test_the_budget_caps_an_iterations_tokens_and_the_iteration_is_shorter() -> None:
    durations = {}
    for budget in (0, 256):
        s = InstanceScheduler("colocated", COST, V1.changed(token_budget=budget))
        s.add(SchedRequest("a", 3000, 100, arrival=0.0, output_len=5))
        plan = s.schedule(0.0)
        assert plan is not None
        durations[budget] = plan.duration
        assert sum(p.tokens for p in plan.pieces) == (budget or 2048)
    assert durations[256] < durations[0] / 4
    # a budget above the engine's is the engine's (vLLM's max_num_batched_tokens bounds an iteration)
    s = InstanceScheduler("colocated", COST, V1.changed(token_budget=8192))
    s.add(SchedRequest("a", 3000, 100, arrival=0.0, output_len=5))
    assert _prompt_tokens(s, 0.0) == 2048


def test_the_running_requests_decode_tokens_count_against_the_budget() -> None:
    s = InstanceScheduler("colocated", COST, V1.changed(token_budget=256))
    s.add(SchedRequest("a", 100, 100, arrival=0.0, output_len=50))
    assert _prompt_tokens(s, 0.0) == 100  # its prompt; it decodes from the next iteration
    s.add(SchedRequest("b", 3000, 100, arrival=0.0, output_len=5))
    plan = s.schedule(0.0)
    assert plan is not None and plan.kind == "mixed"
    assert sum(p.tokens for p in plan.pieces) == 256  # a's token and 255 of b's prompt


def test_with_a_ttft_target_an_urgent_prompt_lifts_the_budget() -> None:
    pol = V1.changed(token_budget=256, ttft_target_s=0.5)
    s = InstanceScheduler("colocated", COST, pol)
    s.add(SchedRequest("a", 3000, 100, arrival=0.0, output_len=5))
    assert _prompt_tokens(s, 0.0) == 256  # waited 0 s
    assert _prompt_tokens(s, URGENT * 0.5 - 0.01) == 256  # part-way through its prefill, not urgent yet
    assert _prompt_tokens(s, URGENT * 0.5) == 2048  # waited half the target: the whole budget
    # a prompt still waiting counts too: srpt starts the short one first, the long one's wait decides
    srpt = pol.changed(ttft_target_s=1.0, queue_order="srpt", predictor="oracle")
    s = InstanceScheduler("colocated", COST, srpt, max_num_seqs=1)
    s.add(SchedRequest("long", 3000, 2000, (801, 1000), arrival=0.0, output_len=900))
    s.add(SchedRequest("short", 2500, 2000, (1, 200), arrival=0.4, output_len=5))
    assert _prompt_tokens(s, 0.4) == 256  # short starts; long waited 0.4 s of its 1 s
    assert s.phase("long") is not None and s.phase("long").name == "WAITING"
    assert _prompt_tokens(s, 0.5) == 2048  # long has waited half its target; short only 0.1 s


def test_a_bad_budget_names_the_field() -> None:
    for bad in (-1, 1.5, True, "256"):
        with pytest.raises(PolicyError, match="token_budget"):
            PolicySet(token_budget=bad)
