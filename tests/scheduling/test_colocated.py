"""The colocated schedules by name (tetri.scheduling.colocated): vllm-v0 pads a prompt batch to its
longest prompt and counts the padding against the budget; vllm-v1 batches prompt chunks with the running
requests' decodes under a token budget, and prices the mixed iteration with one read of the weights."""

from __future__ import annotations

import pytest

from tetri.costmodel import CostModel, load_profile
from tetri.scheduling.instance import InstanceScheduler, Piece, SchedRequest
from tetri.scheduling.policyset import PolicyError, PolicySet

COST = CostModel(load_profile("opt-13b-v100"))


def _sched(schedule: str, budget: int) -> InstanceScheduler:
    return InstanceScheduler("colocated", COST, PolicySet(colocated_schedule=schedule), prefill_budget=budget)


def test_the_schedule_is_a_validated_policy_field() -> None:
    assert PolicySet().colocated_schedule == "prefill-first"
    with pytest.raises(PolicyError, match="colocated_schedule"):
        PolicySet(colocated_schedule="vllm-v2")


@pytest.mark.parametrize(("schedule", "padding"), [("prefill-first", 0), ("vllm-v0", 200)])
def test_vllm_v0_pads_each_prompt_to_the_longest_of_its_batch(schedule: str, padding: int) -> None:
    s = _sched(schedule, 2048)
    s.add(SchedRequest("a", 100, 4))
    s.add(SchedRequest("b", 300, 4))
    plan = s.schedule()
    assert plan is not None and plan.kind == "prefill"
    assert plan.pieces == (Piece("a", 0, 100), Piece("b", 0, 300)) and plan.padding == padding
    priced = [(300, 0), (300, 0)] if padding else [(100, 0), (300, 0)]
    assert plan.duration == COST.prefill_batch_time(priced)
    assert s.padding_tokens == padding


def test_vllm_v0_counts_the_padding_against_the_budget() -> None:
    # unpadded 100 + 500 = 600 fits a 700-token budget; padded 2 × 500 = 1000 does not
    for schedule, batch in (("prefill-first", ("a", "b")), ("vllm-v0", ("a",))):
        s = _sched(schedule, 700)
        s.add(SchedRequest("a", 100, 4))
        s.add(SchedRequest("b", 500, 4))
        plan = s.schedule()
        assert plan is not None and tuple(p.request_id for p in plan.pieces) == batch, schedule


def test_vllm_v1_chunks_a_prompt_into_the_decode_batches_under_the_token_budget() -> None:
    s = _sched("vllm-v1", 512)
    s.add(SchedRequest("a", 100, 50))
    first = s.schedule()
    assert first is not None and first.kind == "prefill" and first.pieces == (Piece("a", 0, 100),)
    assert s.complete(first).tokens == (("a", 0),)
    s.add(SchedRequest("b", 1000, 50))
    mixed = s.schedule()  # a's next token first, then as much of b's prompt as the budget has left
    assert mixed is not None and mixed.kind == "mixed"
    assert mixed.pieces == (Piece("a", 100, 1), Piece("b", 0, 511)) and mixed.admitted == ("b",)
    assert mixed.duration == COST.mixed_batch_time([(511, 0)], 1, 101)
    assert s.complete(mixed).tokens == (("a", 1),)  # b's prompt is not done: no first token yet
    second = s.schedule()
    assert second is not None and second.pieces == (Piece("a", 101, 1), Piece("b", 511, 489))
    assert s.complete(second).tokens == (("a", 2), ("b", 0))  # b's last chunk gives its first token
    third = s.schedule()
    assert third is not None and third.kind == "decode" and third.pieces == (Piece("a", 102, 1), Piece("b", 1000, 1))
    s.check()


def test_switching_away_from_vllm_v1_finishes_a_prompt_part_way_through_its_prefill() -> None:
    s = _sched("vllm-v1", 256)
    s.add(SchedRequest("a", 600, 3))
    plan = s.schedule()
    assert plan is not None and plan.pieces == (Piece("a", 0, 256),)
    s.complete(plan)
    s.configure(PolicySet(colocated_schedule="vllm-v0"))
    rest = s.schedule()
    assert rest is not None and rest.kind == "prefill" and rest.pieces == (Piece("a", 256, 344),)
    assert s.complete(rest).tokens == (("a", 0),)
    s.check()


def test_a_mixed_iteration_reads_the_weights_once() -> None:
    chunks = [(256, 0)]
    mixed = COST.mixed_batch_time(chunks, 8, 4000)
    assert COST.mixed_batch_time(chunks, 0, 0) == COST.prefill_batch_time(chunks)
    assert COST.mixed_batch_time([], 8, 4000) == COST.decode_step_time(8, 4000)
    assert max(COST.prefill_batch_time(chunks), COST.decode_step_time(8, 4000)) <= mixed
    assert mixed < COST.prefill_batch_time(chunks) + COST.decode_step_time(8, 4000)
