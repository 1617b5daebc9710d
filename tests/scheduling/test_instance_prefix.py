"""The instance scheduler's prefix cache (`tetri.scheduling.prefixcache`): a prompt's cached leading blocks
are referenced, not computed, in every role; KV stays conserved with blocks shared between requests and
cached blocks kept in the room left; what the cache reports (its events) is what it holds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetri.costmodel import CostModel, load_profile
from tetri.scheduling.instance import InstanceScheduler, IterationPlan, Phase, SchedRequest
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefix import block_keys

from .driver import LIFECYCLE, Driver

COST = CostModel(load_profile("tiny"))
B = COST.profile.block_size


def tokens(group: int, shared: int, rid: str, length: int) -> list[int]:
    """`length` tokens: the first `shared` those of `group`, the rest this request's own."""
    own = sum(map(ord, rid)) * 7919
    return [group * 100_000 + i if i < shared else own + i for i in range(length)]


def request(rid: str, prompt: list[int], max_tokens: int, **kw) -> SchedRequest:
    return SchedRequest(rid, len(prompt), max_tokens, block_keys=tuple(block_keys(prompt, B)), **kw)


def run(s: InstanceScheduler) -> list[IterationPlan]:
    """Iterate until idle (releasing held prompts and loading pulled ones); the plans."""
    plans = []
    for _ in range(10_000):
        plan = s.schedule(0.0)
        if plan is None:
            held = [rid for rid in list(s._reqs) if s.phase(rid) in (Phase.HELD, Phase.LOADING)]
            if not held:
                return plans
            for rid in held:
                (s.release if s.phase(rid) is Phase.HELD else s.loaded)(rid)
            continue
        plans.append(plan)
        for rid in plan.pulled:
            s.loaded(rid)
        if plan.pieces:
            s.complete(plan)
        s.check()
    raise AssertionError("did not finish")


def test_a_second_prompt_with_the_same_prefix_computes_only_its_own_tokens():
    for role, chunked in (("prefill", True), ("prefill", False), ("colocated", True)):
        s = InstanceScheduler(role, COST, PolicySet(chunk_size=4096), chunked=chunked, kv_capacity=4000)
        first = tokens(1, 200, "a", 260)
        s.add(request("a", first, 4))
        run(s)
        second = tokens(1, 200, "b", 300)
        s.add(request("b", second, 4))
        plans = run(s)
        prefill = [p for plan in plans for p in plan.pieces if p.request_id == "b" and plan.kind != "decode"]
        hit = (200 // B) * B  # the full blocks of the shared 200 tokens
        assert prefill[0].start == hit and sum(p.tokens for p in prefill) == 300 - hit, (role, prefill)
        u = s.usage()
        assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (560, hit)


def test_a_whole_prompt_cached_still_computes_its_last_token():
    s = InstanceScheduler("colocated", COST, PolicySet(), kv_capacity=4000)
    prompt = tokens(1, 64, "a", 64)  # 4 whole blocks
    s.add(request("a", prompt, 1))
    run(s)
    s.add(request("b", prompt, 1))
    plans = run(s)
    (piece,) = [p for plan in plans for p in plan.pieces]
    assert (piece.start, piece.tokens) == (48, 16)  # at most all but the last token: 3 blocks


def test_a_decode_instance_pulls_only_the_blocks_it_does_not_hold():
    s = InstanceScheduler("decode", COST, PolicySet(), kv_capacity=4000)
    turn1 = tokens(1, 300, "t1", 300)
    s.add(request("t1", turn1, 3), produced=1)
    plan = s.schedule()
    assert plan is not None and plan.pulled == ("t1",) and s.transfer_tokens("t1") == 300
    s.loaded("t1")
    run(s)
    turn2 = tokens(1, 300, "t2", 420)  # the same conversation, one turn on
    s.add(request("t2", turn2, 3), produced=1)
    plan = s.schedule()
    assert plan is not None and plan.pulled == ("t2",)
    assert s.transfer_tokens("t2") == 420 - (300 // B) * B
    s.loaded("t2")
    run(s)
    assert len(s) == 0 and s.usage().kv_used_tokens == 0


def test_free_blocks_are_evicted_least_recently_freed_first_when_room_is_needed():
    s = InstanceScheduler("colocated", COST, PolicySet(), kv_capacity=320)
    a, b = tokens(1, 160, "a", 160), tokens(2, 160, "b", 160)
    s.add(request("a", a, 1))
    run(s)
    s.add(request("b", b, 1))
    run(s)
    assert s.cache is not None and s.cache.free == 20  # a's 10 full blocks, b's 10, referenced by none
    stored, removed = s.drain_cache_events()
    assert len(stored) == 20 and removed == []
    s.add(request("c", tokens(3, 0, "c", 100), 1))  # needs 100 tokens: 7 cached blocks must go
    run(s)
    stored, removed = s.drain_cache_events()
    assert removed == block_keys(a, B)[3:][::-1]  # a's (freed first), its tail first
    assert s.cache.lookup(tuple(block_keys(a, B)), 10) == 3
    assert s.cache.lookup(tuple(block_keys(b, B)), 10) == 10  # b's survived


prefixes = st.tuples(st.integers(0, 3), st.integers(0, 300))  # (group, tokens shared with the group)
operations = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 300), st.integers(1, 120), prefixes),
    *LIFECYCLE,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    role=st.sampled_from(["prefill", "decode", "colocated"]),
    schedule=st.sampled_from(["prefill-first", "vllm-v0", "vllm-v1"]),
    chunked=st.booleans(),
    capacity=st.sampled_from([400, 700, 2000]),
    ops=st.lists(operations, max_size=80),
)
def test_kv_is_conserved_with_shared_blocks_and_the_events_say_what_is_cached(
    role: str, schedule: str, chunked: bool, capacity: int, ops: list[tuple]
):
    policy = PolicySet(colocated_schedule=schedule, chunk_size=64)
    s = InstanceScheduler(role, COST, policy, chunked=chunked, kv_capacity=capacity, max_num_seqs=8)
    first = 1 if role == "decode" else 0
    ids: list[str] = []
    mirror: set[int] = set()  # what the drained events say is cached

    def follow() -> None:
        stored, removed = s.drain_cache_events()
        assert not set(stored) & set(removed)
        mirror.update(stored)
        mirror.difference_update(removed)
        assert s.cache is not None and mirror == set(s.cache.keys())

    def planned(plan: IterationPlan) -> None:
        for rid in plan.pulled:
            assert 0 < s.transfer_tokens(rid) <= len(s._reqs[rid].req.block_keys) * B + B

    engine = Driver(s, on_plan=planned)
    step = engine.step

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, prompt, max_tokens, (group, shared) = op
            peak = prompt + max_tokens - 1 if role != "prefill" else prompt
            if peak > s.capacity or (role == "decode" and max_tokens < 2):
                continue
            rid = f"r{len(ids)}"
            ids.append(rid)
            s.add(request(rid, tokens(group, shared, rid, prompt), max_tokens), produced=first)
        elif kind in ("abort", "release", "loaded") and ids:
            getattr(s, kind)(ids[op[1] % len(ids)])
        else:
            step()
        s.check()
        follow()
        u = s.usage()
        assert 0 <= u.prefix_hit_tokens <= u.prefix_query_tokens
    engine.finish_all(ids, after=follow)  # liveness: everything finishes
    assert len(s) == 0
    assert s.usage().kv_used_tokens == 0 and s.cache is not None and s.cache.pinned == 0
