"""SimEngine driven by the `tetri.scheduling` policy objects: chunked prefill (ChunkSize, padding,
fcfs / sjf / ljf within PrefillSchedBatch, chunked off), decode admission (greedy, reserve-static,
reserve-dynamic, plan), and hot-swapping them with `configure`.

Plain `asyncio.run` on a fast `ScaledClock` and the `tiny` profile (4,192 KV tokens, 64 sequences); the
tests assert what the engine does (iteration records, counters, tokens), never wall-clock time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

import pytest

from tetri.clock import ScaledClock
from tetri.costmodel import load_profile
from tetri.scheduling.policyset import PolicySet
from workers.engines.base import EngineRequest, KVHandle
from workers.engines.sim import IterationStats, SimEngine, sim_token

SCALE = 10_000.0
VOCAB = 1000  # tiny's vocabulary


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, timeout=30)

    return asyncio.run(main())


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 31) % 1000 for i in range(n))


def req(rid: str, n_prompt: int, max_tokens: int = 1, predicted: tuple[int, int] | None = None) -> EngineRequest:
    return EngineRequest(rid, prompt(sum(map(ord, rid)), n_prompt), max_tokens, predicted)


def exact(rid: str, n_prompt: int, max_tokens: int) -> EngineRequest:
    """A request whose predicted output range is exactly right."""
    return req(rid, n_prompt, max_tokens, (max_tokens, max_tokens))


async def engine(role: str, **kw: Any) -> tuple[SimEngine, list[IterationStats]]:
    e = SimEngine(load_profile("tiny"), role, f"{role}-0", ScaledClock(SCALE), **kw)
    log: list[IterationStats] = []
    e.on_iteration = log.append
    await e.start()
    return e, log


def pieces(log: Iterable[IterationStats], kind: str = "prefill") -> list[tuple[tuple[str, int], ...]]:
    return [s.requests for s in log if s.kind == kind]


def completion_order(log: Iterable[IterationStats], lengths: dict[str, int]) -> list[str]:
    """Request ids in the order their prompts' last tokens were prefilled."""
    done: dict[str, int] = {}
    order: list[str] = []
    for s in log:
        for rid, n in s.requests:
            done[rid] = done.get(rid, 0) + n
            if done[rid] == lengths[rid]:
                order.append(rid)
    return order


async def prefill_all(e: SimEngine, reqs: list[EngineRequest]) -> None:
    """Submit every prompt before the engine plans its first iteration, then wait for all of them."""
    outs = await asyncio.gather(*(e.prefill(r) for r in reqs))
    assert [o.first_token for o in outs] == [sim_token(r.prompt_token_ids, 0, VOCAB) for r in reqs]
    assert [o.kv.num_tokens for o in outs] == [r.prompt_len for r in reqs]


# --- prefill role: ChunkSize and padding ----------------------------------------------------------


def test_fixed_size_chunks_with_the_last_one_padded():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=128))
        await prefill_all(pre, [req("a", 100), req("b", 100), req("c", 100)])
        assert pieces(log) == [(("a", 100), ("b", 28)), (("b", 72), ("c", 56)), (("c", 44),)]
        assert [s.padding for s in log] == [0, 0, 84]
        assert [sum(n for _, n in s.requests) + s.padding for s in log] == [128, 128, 128]
        assert pre.wasted_prefill_tokens == 84 and pre.prefill_iterations == 3
        assert pre.prompt_tokens_processed == 300  # padding is not prompt work
        # Padding costs compute: the last chunk (c's last 44 tokens after its first 56) is priced as 128.
        c = pre.cost
        assert log[2].duration == pytest.approx(c.prefill_time(128, 56))
        assert log[2].duration > c.prefill_time(44, 56)
        assert log[0].duration == pytest.approx(c.prefill_batch_time([(100, 0), (28, 0)]))
        assert log[1].duration == pytest.approx(c.prefill_batch_time([(72, 28), (56, 0)]))
        stats = pre.policy_stats()
        assert stats == {
            "preemptions": 0,
            "wasted_prefill_tokens": 84,
            "prefill_iterations": 3,
            "decode_iterations": 0,
            "mixed_iterations": 0,
            "admitted_by_policy": 0,
        }
        await pre.stop()

    run(main())


def test_a_long_prompt_spans_chunks_and_later_chunks_see_its_context():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=256))
        await prefill_all(pre, [req("long", 700)])
        assert pieces(log) == [(("long", 256),), (("long", 256),), (("long", 188),)]
        assert [s.padding for s in log] == [0, 0, 68]
        c = pre.cost
        assert [s.duration for s in log] == pytest.approx(
            [c.prefill_time(256, 0), c.prefill_time(256, 256), c.prefill_time(256, 512)]
        )
        await pre.stop()

    run(main())


# --- prefill role: scheduling order ----------------------------------------------------------------

LENGTHS = {"w": 400, "x": 100, "y": 300, "z": 200}  # arrival order w, x, y, z


@pytest.mark.parametrize(
    ("policy", "sched_batch", "order"),
    [
        ("fcfs", 16, ["w", "x", "y", "z"]),
        ("sjf", 16, ["x", "z", "y", "w"]),
        ("ljf", 16, ["w", "y", "z", "x"]),
        # PrefillSchedBatch 2: {w, x} then {y, z}, each sorted: nobody overtakes a whole group.
        ("sjf", 2, ["x", "w", "z", "y"]),
        ("ljf", 2, ["w", "x", "y", "z"]),
    ],
)
def test_prefill_order_within_sched_batch(policy: str, sched_batch: int, order: list[str]):
    async def main() -> None:
        policies = PolicySet(chunk_size=128, prefill_policy=policy, prefill_sched_batch=sched_batch)
        pre, log = await engine("prefill", policies=policies)
        await prefill_all(pre, [req(rid, n) for rid, n in LENGTHS.items()])
        assert completion_order(log, LENGTHS) == order
        assert all(sum(n for _, n in s.requests) + s.padding == 128 for s in log)
        assert pre.wasted_prefill_tokens == 128 * len(log) - sum(LENGTHS.values())
        await pre.stop()

    run(main())


def test_sjf_lowers_mean_completion_iteration_over_fcfs():
    async def main() -> None:
        means = {}
        for policy in ("fcfs", "sjf"):
            pre, log = await engine("prefill", policies=PolicySet(chunk_size=128, prefill_policy=policy))
            done_at: dict[str, int] = {}
            tallies: dict[str, int] = {}
            await prefill_all(pre, [req(rid, n) for rid, n in LENGTHS.items()])
            for s in log:
                for rid, n in s.requests:
                    tallies[rid] = tallies.get(rid, 0) + n
                    if tallies[rid] == LENGTHS[rid]:
                        done_at[rid] = s.index
            means[policy] = sum(done_at.values()) / len(done_at)
            await pre.stop()
        assert means["sjf"] < means["fcfs"]

    run(main())


# --- prefill role: chunked prefill off ----------------------------------------------------------------


def test_chunked_off_runs_whole_prompts_up_to_the_token_budget():
    async def main() -> None:
        pre, log = await engine("prefill", chunked=False, max_batched_tokens=512)
        reqs = [req("a", 300), req("b", 300), req("c", 100), req("d", 600)]
        await prefill_all(pre, reqs)
        # Whole prompts in fcfs order while they fit in 512 tokens; a longer prompt runs alone.
        assert pieces(log) == [(("a", 300),), (("b", 300), ("c", 100)), (("d", 600),)]
        assert all(s.padding == 0 for s in log) and pre.wasted_prefill_tokens == 0
        c = pre.cost
        assert log[1].duration == pytest.approx(c.prefill_batch_time([(300, 0), (100, 0)]))
        assert log[2].duration == pytest.approx(c.prefill_time(600))
        await pre.stop()

        sjf, log = await engine(
            "prefill", chunked=False, max_batched_tokens=512, policies=PolicySet(prefill_policy="sjf")
        )
        await prefill_all(sjf, reqs)
        assert pieces(log) == [(("c", 100), ("a", 300)), (("b", 300),), (("d", 600),)]
        await sjf.stop()

    run(main())


# --- prefill role: hot swap ------------------------------------------------------------------------------


def test_chunk_size_hot_swap_takes_effect_on_later_iterations():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=128))
        assert pre.policies.chunk_size == 128

        def swap(stats: IterationStats) -> None:
            log.append(stats)
            if stats.index == 2:  # planned and running: this iteration keeps its 128 tokens
                pre.configure(pre.policies.changed(chunk_size=256))

        pre.on_iteration = swap
        await prefill_all(pre, [req("long", 1000)])
        assert pieces(log) == [(("long", 128),), (("long", 128),), (("long", 256),), (("long", 256),), (("long", 232),)]
        assert [s.padding for s in log] == [0, 0, 0, 0, 24]
        assert pre.policies.chunk_size == 256
        await pre.stop()

    run(main())


def test_turning_chunked_off_lets_started_prompts_finish_chunked():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=256))

        def switch(stats: IterationStats) -> None:
            log.append(stats)
            if stats.index == 1:
                pre.configure(chunked=False)

        pre.on_iteration = switch
        await prefill_all(pre, [req("a", 600), req("b", 300), req("c", 100)])
        # `a` was part-way through its chunked prefill: it finishes in chunks (the last padded); `b` and
        # `c` had not started: they run whole, unpadded, in one iteration.
        assert pieces(log) == [(("a", 256),), (("a", 256),), (("a", 88),), (("b", 300), ("c", 100))]
        assert [s.padding for s in log] == [0, 0, 168, 0]
        assert not pre.chunked
        await pre.stop()

        whole, log = await engine("prefill", chunked=False, max_batched_tokens=300, policies=PolicySet(chunk_size=128))

        def switch_on(stats: IterationStats) -> None:
            log.append(stats)
            if stats.index == 1:
                whole.configure(chunked=True)

        whole.on_iteration = switch_on
        await prefill_all(whole, [req("a", 300), req("b", 300), req("c", 100)])
        assert pieces(log) == [(("a", 300),), (("b", 128),), (("b", 128),), (("b", 44), ("c", 84)), (("c", 16),)]
        assert log[-1].padding == 112
        await whole.stop()

    run(main())


def test_prefill_queue_waits_for_kv_then_chunks_in_policy_order():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=512, prefill_policy="sjf"))
        hog = await pre.prefill(req("hog", 2000))  # holds its KV: 2,192 of 4,192 tokens stay free
        assert pre.kv_capacity == 4192
        assert hog.kv.num_tokens == 2000
        log.clear()
        big, small = req("big", 1900), req("small", 300)
        t_big = asyncio.create_task(pre.prefill(big))
        t_small = asyncio.create_task(pre.prefill(small))
        await asyncio.sleep(0)
        await t_big
        for _ in range(20):
            await asyncio.sleep(0)
        # `small` arrived after `big` and its KV did not fit then: the outer FIFO kept it out of the
        # scheduler, so sjf could not reorder it ahead of `big`.
        assert not t_small.done()
        assert completion_order(log, {"big": 1900, "small": 300}) == ["big"]
        await pre.release_kv("hog")
        await t_small
        assert pre.usage().kv_used_tokens == 2200
        await pre.stop()

    run(main())


def test_abort_mid_chunked_prefill_drops_the_prompt_from_the_scheduler():
    async def main() -> None:
        pre, log = await engine("prefill", policies=PolicySet(chunk_size=128))

        def abort_b(stats: IterationStats) -> None:
            log.append(stats)
            if stats.index == 2:  # b's first 56 tokens are in this chunk: abort while it runs
                asyncio.get_running_loop().create_task(pre.abort("b"))

        pre.on_iteration = abort_b
        tasks = [asyncio.create_task(pre.prefill(req(rid, 200))) for rid in "abc"]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [isinstance(r, Exception) for r in results] == [False, True, False]
        # After the abort the chunks carry only c: b's progress is dropped from the chunker.
        assert pieces(log) == [(("a", 128),), (("a", 72), ("b", 56)), (("c", 128),), (("c", 72),)]
        assert pre.usage().kv_used_tokens == 400
        await pre.stop()

    run(main())


# --- decode role: admission policies ----------------------------------------------------------------


async def decode_all(dec: SimEngine, reqs: list[EngineRequest]) -> None:
    """Load every request's KV, decode them all concurrently and check every token."""

    async def one(r: EngineRequest) -> None:
        await dec.load_kv(r, KVHandle(r.request_id, r.prompt_len, dec.cost.kv_bytes(r.prompt_len), "p"))
        first = sim_token(r.prompt_token_ids, 0, VOCAB)
        rest = [t async for t in dec.decode(r, first)]
        assert [first, *rest] == [sim_token(r.prompt_token_ids, i, VOCAB) for i in range(r.max_tokens)]

    await asyncio.gather(*(one(r) for r in reqs))


def max_running(log: Iterable[IterationStats]) -> int:
    return max(len(s.requests) for s in log if s.kind == "decode")


def overload(predicted: bool = True) -> list[EngineRequest]:
    """40 requests of 200 + 300 tokens: each grows to 499 KV tokens, ~20K in all for a 4,192 cache."""
    return [exact(f"r{i}", 200, 300) if predicted else req(f"r{i}", 200, 300) for i in range(40)]


@pytest.mark.parametrize("policy", ["greedy", "reserve-static", "reserve-dynamic", "plan"])
def test_decode_admission_under_overload(policy: str):
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission=policy))
        reqs = overload()
        await decode_all(dec, reqs)
        cap = dec.kv_capacity
        assert all(s.kv_used_tokens <= cap for s in log)
        assert dec.tokens_emitted == 40 * 299
        stats = dec.policy_stats()
        assert stats["admitted_by_policy"] == 40 + stats["preemptions"]
        if policy == "greedy":
            # vLLM: admit while the next step fits now (20 × 201 tokens), then thrash.
            assert len(log[0].requests) == 20
            assert stats["preemptions"] > 0 and dec.recomputed_tokens > 0
        else:
            # Reserving each request's predicted peak (499 tokens): 8 at a time, never preempted. (plan, with
            # no plan set, takes the waiting requests in arrival order with its future-fits test.)
            assert stats["preemptions"] == 0 and dec.recomputed_tokens == 0
            assert len(log[0].requests) == max_running(log) == cap // 499 == 8
        u = dec.usage()
        assert (u.kv_used_tokens, u.running, u.waiting) == (0, 0, 0)
        await dec.stop()

    run(main())


def test_reserve_without_a_prediction_reserves_max_tokens():
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission="reserve-static"))
        await decode_all(dec, overload(predicted=False))
        assert dec.preemptions == 0 and max_running(log) == 8
        await dec.stop()

    run(main())


def test_reserve_with_underpredictions_still_completes_everything():
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission="reserve-static"))
        # Predicted 20 tokens, produce 300: the reservation is far too small, the batch outgrows the
        # cache and the preemption safety net kicks in; every token is still right.
        reqs = [req(f"r{i}", 200, 300, (20, 220)) for i in range(30)]
        await decode_all(dec, reqs)
        assert dec.preemptions > 0
        assert all(s.kv_used_tokens <= dec.kv_capacity for s in log)
        assert dec.tokens_emitted == 30 * 299
        await dec.stop()

    run(main())


def long_then_short() -> list[EngineRequest]:
    """Three long requests (peak 999 tokens) first, then 37 short ones (peak 129)."""
    return [exact(f"L{i}", 100, 900) for i in range(3)] + [exact(f"s{i}", 100, 30) for i in range(37)]


def test_reserve_dynamic_admits_more_than_reserve_static_without_preempting():
    async def main() -> None:
        seen: dict[str, int] = {}
        for policy in ("reserve-static", "reserve-dynamic"):
            dec, log = await engine("decode", policies=PolicySet(decode_admission=policy))
            await decode_all(dec, long_then_short())
            assert dec.preemptions == 0, policy
            seen[policy] = max_running(log)
            await dec.stop()
        # static: 3 × 999 + 9 × 129 ≤ 4,192; dynamic also admits what fits until the shortest finishes.
        assert seen["reserve-static"] == 12
        assert seen["reserve-dynamic"] > seen["reserve-static"] + 10

    run(main())


def test_reserve_dynamic_preempts_less_than_greedy_on_mixed_lengths():
    async def main() -> None:
        reqs = [exact(f"m{i}", 100 + (i * 53) % 200, 20 + (i * 137) % 500) for i in range(40)]
        preemptions = {}
        for policy in ("greedy", "reserve-dynamic"):
            dec, _ = await engine("decode", policies=PolicySet(decode_admission=policy))
            await decode_all(dec, reqs)
            preemptions[policy] = dec.preemptions
            await dec.stop()
        # reserve-dynamic only checks memory up to the shortest job's completion, so with mixed lengths
        # it can still preempt even with exact predictions, but far less than greedy.
        assert preemptions["reserve-dynamic"] < preemptions["greedy"] / 2

    run(main())


# --- decode role: plan admission ----------------------------------------------------------------------


def test_plan_admission_follows_the_given_order():
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission="plan"))
        # Each peaks at 1,400 + 599 = 1,999 tokens: two fit at a time in 4,192.
        reqs = [exact(rid, 1400, 600) for rid in "abcd"]
        dec.set_plan(["c", "a", "d", "b"])
        await decode_all(dec, reqs)
        starts: list[str] = []
        for s in log:
            starts += [rid for rid, _ in s.requests if rid not in starts]
        assert starts == ["c", "a", "d", "b"]  # not arrival order
        assert log[0].requests == (("c", 1), ("a", 1))
        assert max_running(log) == 2 and dec.preemptions == 0
        assert dec.policy_stats()["admitted_by_policy"] == 4
        assert dec.sched.plan_order == ()  # admitted ids leave the plan
        await dec.stop()

    run(main())


def test_plan_does_not_wait_for_a_planned_request_that_has_not_arrived():
    # Waiting could stall or deadlock: b's prompt may be stuck behind prefill KV held for a, waiting here.
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission="plan"))
        a = exact("a", 100, 50)
        dec.set_plan(["b", "a"])
        await decode_all(dec, [a])
        assert log[0].requests[0][0] == "a"
        assert dec.sched.plan_order == ("b",)  # b keeps its place for when it comes
        await dec.stop()

    run(main())


def test_plan_drops_aborted_ids_and_admits_unplanned_requests_after_the_plan():
    async def main() -> None:
        dec, log = await engine("decode", policies=PolicySet(decode_admission="plan"))
        a, b, c = exact("a", 100, 50), exact("b", 100, 50), exact("c", 100, 50)
        dec.set_plan(["b", "a"])
        await dec.load_kv(b, KVHandle("b", 100, 0, "p"))
        await dec.abort("b")  # the plan no longer waits for it
        assert dec.sched.plan_order == ("a",)
        await decode_all(dec, [c, a])  # `c` is not in the plan: it comes after `a`
        assert log[0].requests[0][0] == "a"
        await dec.stop()

    run(main())


# --- colocated role ----------------------------------------------------------------------------------


def test_colocated_admission_goes_through_the_policy():
    async def main() -> None:
        preempted = {}
        for policy in ("greedy", "reserve-static"):
            co, log = await engine("colocated")
            co.configure(PolicySet(decode_admission=policy))  # hot swap before any work
            reqs = [exact(f"r{i}", 150 + 10 * (i % 7), 250) for i in range(30)]
            outs = await asyncio.gather(*(collect(co.generate(r)) for r in reqs))
            for r, o in zip(reqs, outs, strict=True):
                assert o == [sim_token(r.prompt_token_ids, i, VOCAB) for i in range(r.max_tokens)]
            assert all(s.kv_used_tokens <= co.kv_capacity for s in log)
            # Colocated keeps whole-budget prefill chunks (no ChunkSize padding).
            assert co.wasted_prefill_tokens == 0
            preempted[policy] = co.preemptions
            assert co.policy_stats()["admitted_by_policy"] == 30 + co.preemptions
            await co.stop()
        assert preempted["greedy"] > 0 and preempted["reserve-static"] == 0

    run(main())


async def collect(it: Any) -> list[int]:
    return [t async for t in it]
