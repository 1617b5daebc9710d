"""SimEngine behaviour on a fast model clock: tokens, chunking, admission, preemption, abort, errors.

Every test runs real asyncio (`asyncio.run`) and asserts on what the engine does (tokens, iteration
records, counters, usage), never on wall-clock time.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

import pytest

from tests.des.virtual_clock import VirtualClock
from tetri.clock import ScaledClock
from tetri.costmodel import load_profile
from workers.engines.base import EngineError, EngineRequest, KVHandle
from workers.engines.sim import IterationStats, SimEngine, sim_token

SCALE = 10_000.0  # model seconds per wall second: tiny's millisecond iterations become sub-microsecond


class RecordingClock(VirtualClock):
    """A virtual clock (exact model time) that remembers how long each wait was, except the zero-length
    yields the engine loop makes before planning."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []

    async def sleep_until(self, deadline: float) -> None:
        if deadline > self.now():
            self.sleeps.append(deadline - self.now())
        await super().sleep_until(deadline)


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, timeout=30)

    return asyncio.run(main())


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 31) % 1000 for i in range(n))


def req(rid: str, n_prompt: int, max_tokens: int, seed: int | None = None) -> EngineRequest:
    return EngineRequest(rid, prompt(zlib.crc32(rid.encode()) % 1000 if seed is None else seed, n_prompt), max_tokens)


async def engine(role: str, profile: str = "tiny", clock: Any = None, **kw: Any) -> SimEngine:
    e = SimEngine(load_profile(profile), role, f"{role}-0", clock or ScaledClock(SCALE), **kw)
    await e.start()
    return e


def record(e: SimEngine) -> list[IterationStats]:
    log: list[IterationStats] = []
    e.on_iteration = log.append
    return log


async def collect(it: Any) -> list[int]:
    return [t async for t in it]


def expected(r: EngineRequest, vocab: int) -> list[int]:
    return [sim_token(r.prompt_token_ids, i, vocab) for i in range(r.max_tokens)]


# --- tokens ------------------------------------------------------------------------------------


def test_disaggregated_tokens_equal_colocated_tokens():
    async def main() -> None:
        co, pre, dec = await engine("colocated"), await engine("prefill"), await engine("decode")
        r = req("r1", 300, 40, seed=5)
        together = await collect(co.generate(r))
        out = await pre.prefill(r)
        assert out.kv == KVHandle("r1", 300, pre.cost.kv_bytes(300), "prefill-0", {})
        await dec.load_kv(r, out.kv)
        await pre.release_kv("r1")
        rest = await collect(dec.decode(r, out.first_token))
        assert [out.first_token, *rest] == together
        assert together == expected(r, co.vocab_size)
        assert len(together) == 40 and all(0 <= t < co.vocab_size for t in together)
        for e in (co, pre, dec):
            assert e.usage().kv_used_tokens == 0
            await e.stop()

    run(main())


def test_tokens_depend_on_prompt_and_index_only():
    a = prompt(1, 50)
    assert sim_token(a, 3, 50272) == sim_token(list(a), 3, 50272)
    assert [sim_token(a, i, 1000) for i in range(20)] != [sim_token(prompt(2, 50), i, 1000) for i in range(20)]
    assert len({sim_token(a, i, 1000) for i in range(200)}) > 100  # not a constant


def test_token_counts_are_exactly_max_tokens():
    async def main() -> None:
        co, pre, dec = await engine("colocated"), await engine("prefill"), await engine("decode")
        lens = [1, 2, 7, 100]
        outs = await asyncio.gather(*(collect(co.generate(req(f"c{n}", 20 + n, n))) for n in lens))
        assert [len(o) for o in outs] == lens
        for n in lens:
            r = req(f"d{n}", 30, n)
            out = await pre.prefill(r)
            await dec.load_kv(r, out.kv)
            assert len(await collect(dec.decode(r, out.first_token))) == n - 1
            await pre.release_kv(r.request_id)
        assert dec.usage().kv_used_tokens == 0 and dec.usage().running == 0
        for e in (co, pre, dec):
            await e.stop()

    run(main())


def test_iteration_durations_come_from_the_cost_model():
    async def main(clock: RecordingClock) -> None:
        co = await engine("colocated", clock=clock)
        await collect(co.generate(req("a", 100, 4)))
        c = co.cost
        # One prefill iteration, then three decode steps, each feeding one more token of context.
        assert clock.sleeps == pytest.approx(
            [c.prefill_time(100), c.decode_step_time(1, 101), c.decode_step_time(1, 102), c.decode_step_time(1, 103)]
        )
        assert co.busy_time == pytest.approx(sum(clock.sleeps))
        await co.stop()

        dec = await engine("decode", clock=clock)
        clock.sleeps.clear()
        r = req("b", 500, 2)
        await dec.load_kv(r, KVHandle("b", 500, dec.cost.kv_bytes(500), "elsewhere"))
        assert clock.sleeps == []  # load_kv returns when admission pulls the KV; the transfer comes after
        assert await collect(dec.decode(r, sim_token(r.prompt_token_ids, 0, dec.vocab_size))) == expected(r, 1000)[1:]
        assert clock.sleeps == pytest.approx([dec.cost.transfer_time(500), dec.cost.decode_step_time(1, 501)])
        await dec.stop()

    clock = RecordingClock()
    asyncio.run(clock.run(main(clock)))


# --- prefill role: chunking and KV admission ---------------------------------------------------------


def test_chunked_prefill_splits_long_prompts_and_packs_short_ones():
    async def main() -> None:
        pre = await engine("prefill")  # tiny: 512-token budget per iteration
        log = record(pre)
        reqs = [req("long", 1200, 1), req("s1", 100, 1), req("s2", 100, 1), req("s3", 100, 1)]
        outs = await asyncio.gather(*(pre.prefill(r) for r in reqs))
        assert [o.first_token for o in outs] == [expected(r, 1000)[0] for r in reqs]
        assert [s.requests for s in log] == [
            (("long", 512),),
            (("long", 512),),
            (("long", 176), ("s1", 100), ("s2", 100), ("s3", 100)),
        ]
        assert pre.prefill_iterations == pre.iterations == 3
        assert pre.prompt_tokens_processed == 1500
        # ChunkSize (by default the iteration budget, 512) is fixed: the last chunk is padded (TetriInfer).
        assert [s.padding for s in log] == [0, 0, 36] and pre.wasted_prefill_tokens == 36
        # The later chunks of the long prompt attend to the earlier ones: they take longer.
        assert log[1].duration > log[0].duration
        await pre.stop()

        small = await engine("prefill", max_batched_tokens=256)
        await small.prefill(req("long", 1200, 1))
        assert small.prefill_iterations == 5  # ⌈1200 / 256⌉
        await small.stop()

    run(main())


def test_prefill_admission_waits_for_free_kv_and_release_frees_it():
    async def main() -> None:
        pre = await engine("prefill")
        cap = pre.usage().kv_capacity_tokens  # 4192: two 2000-token prompts fit, a third does not
        assert 2 * 2000 <= cap < 3 * 2000
        a, b, c = (req(x, 2000, 8) for x in "abc")
        ta, tb, tc = (asyncio.create_task(pre.prefill(r)) for r in (a, b, c))
        out_a, out_b = await ta, await tb
        for _ in range(20):
            await asyncio.sleep(0)
        assert not tc.done()
        u = pre.usage()
        assert (u.kv_used_tokens, u.running, u.waiting) == (4000, 0, 1)
        await pre.release_kv("a")
        out_c = await tc
        assert out_c.kv.num_tokens == 2000
        assert pre.usage().kv_used_tokens == 4000
        await pre.release_kv("b")
        await pre.release_kv("c")
        await pre.release_kv("c")  # already released: no-op
        await pre.release_kv("unknown")
        assert pre.usage().kv_used_tokens == 0
        assert out_a.kv.source_instance_id == out_b.kv.source_instance_id == "prefill-0"
        await pre.stop()

    run(main())


# --- decode role: greedy admission, preemption ------------------------------------------------------


def test_decode_greedy_admission_respects_capacity_and_preempts_when_overloaded():
    async def main() -> None:
        pre, dec = await engine("prefill"), await engine("decode")
        cap = dec.usage().kv_capacity_tokens
        log: list[IterationStats] = []
        samples: list[Any] = []

        def on_iteration(stats: IterationStats) -> None:
            log.append(stats)
            samples.append(dec.usage())

        dec.on_iteration = on_iteration
        reqs = [req(f"r{i}", 200, 300) for i in range(40)]  # each grows to 499 tokens: 20K ≫ 4,192

        async def hand_over(r: EngineRequest) -> list[int]:  # as the worker service does
            out = await pre.prefill(r)
            await dec.load_kv(r, out.kv)  # returns when the decode instance pulls the KV
            await pre.release_kv(r.request_id)
            return [out.first_token, *await collect(dec.decode(r, out.first_token))]

        outs = await asyncio.gather(*(hand_over(r) for r in reqs))

        for r, tokens in zip(reqs, outs, strict=True):
            assert tokens == expected(r, dec.vocab_size)
        # Greedy admission: at most 20 requests × (200 prompt + 1 slot) = 4,020 fit; a 21st would not.
        assert max(len(s.requests) for s in log) <= cap // 201 == 20
        assert all(s.kv_used_tokens <= cap for s in log)
        assert all(u.kv_used_tokens <= cap and u.running <= dec.max_num_seqs for u in samples)
        assert dec.preemptions > 0 and dec.usage().preemptions == dec.preemptions
        assert dec.recomputed_tokens > 0
        assert dec.tokens_emitted == 40 * 299
        u = dec.usage()
        assert (u.kv_used_tokens, u.running, u.waiting) == (0, 0, 0)
        await pre.stop()
        await dec.stop()

    run(main())


def test_decode_needs_loaded_kv():
    async def main() -> None:
        dec = await engine("decode")
        r = req("x", 10, 5)
        with pytest.raises(EngineError, match="load_kv"):
            await collect(dec.decode(r, 0))
        with pytest.raises(EngineError, match="tokens"):
            await dec.load_kv(r, KVHandle("x", 11, 0, "p"))
        await dec.stop()

    run(main())


# --- colocated role --------------------------------------------------------------------------------


def test_colocated_prioritises_a_new_prefill_over_a_running_decode():
    async def main() -> None:
        co = await engine("colocated")
        log = record(co)
        long = req("long", 50, 1500)
        new = req("new", 100, 5)
        submitted_at: list[int] = []
        new_first_token_at: list[int] = []  # tokens of `long` seen when `new`'s first token arrived
        seen = 0
        new_task: asyncio.Task[list[int]] | None = None

        async def consume_new() -> list[int]:
            it = co.generate(new)
            submitted_at.append(co.iterations)
            first = await anext(it)
            new_first_token_at.append(seen)
            return [first, *[t async for t in it]]

        async for _ in co.generate(long):
            seen += 1
            if seen == 10:
                new_task = asyncio.create_task(consume_new())
        assert new_task is not None
        new_tokens = await new_task
        assert new_tokens == expected(new, 1000)
        assert seen == 1500
        assert new_first_token_at[0] < 100  # long before the long decode finished
        # The very next iteration after `new` arrived was its prefill, with no decode step for `long`.
        nxt = next(s for s in log if s.index == submitted_at[0] + 1)
        assert nxt.kind == "prefill" and nxt.requests == (("new", 100),)
        assert co.prefill_iterations == 2
        await co.stop()

    run(main())


def test_colocated_under_overload_preempts_but_finishes_everything():
    async def main() -> None:
        co = await engine("colocated")
        cap = co.usage().kv_capacity_tokens
        log = record(co)
        reqs = [req(f"r{i}", 150 + 10 * (i % 7), 250) for i in range(30)]
        outs = await asyncio.gather(*(collect(co.generate(r)) for r in reqs))
        assert all(o == expected(r, 1000) for r, o in zip(reqs, outs, strict=True))
        assert co.preemptions > 0
        assert all(s.kv_used_tokens <= cap for s in log)
        assert co.usage().kv_used_tokens == 0
        await co.stop()

    run(main())


def test_hundreds_of_concurrent_requests():
    async def main() -> None:
        co = await engine("colocated", "llama3-8b-h100", ScaledClock(1000))
        reqs = [req(f"r{i}", 50 + (i * 37) % 700, 20 + (i * 13) % 150) for i in range(400)]
        outs = await asyncio.gather(*(collect(co.generate(r)) for r in reqs))
        assert [len(o) for o in outs] == [r.max_tokens for r in reqs]
        assert co.tokens_emitted == sum(r.max_tokens for r in reqs)
        assert co.usage().running == co.usage().waiting == 0
        await co.stop()

    run(main())


def test_usage_reports_recent_throughput():
    async def main() -> None:
        co = await engine("colocated", clock=ScaledClock(100))
        assert co.usage().tokens_per_s == 0
        rates: list[float] = []
        async for _ in co.generate(req("a", 100, 300)):
            rates.append(co.usage().tokens_per_s)  # a token was emitted just now
        assert min(rates) > 0
        await co.stop()

    run(main())


# --- abort, stop, errors ---------------------------------------------------------------------------


def test_abort_ends_a_token_stream_and_frees_its_kv():
    async def main() -> None:
        co = await engine("colocated")
        r = req("a", 100, 1000)
        got: list[int] = []
        async for t in co.generate(r):
            got.append(t)
            if len(got) == 5:
                await co.abort("a")
        assert 5 <= len(got) < 1000
        assert got == expected(r, 1000)[: len(got)]
        u = co.usage()
        assert (u.kv_used_tokens, u.running, u.waiting) == (0, 0, 0)
        await co.abort("a")  # gone already
        await co.abort("never-seen")
        await co.stop()

    run(main())


def test_closing_a_stream_early_aborts_the_request():
    async def main() -> None:
        co = await engine("colocated")
        it = cast(AsyncGenerator[int, None], co.generate(req("a", 100, 1000)))
        await anext(it)
        assert co.usage().kv_used_tokens > 0
        await it.aclose()
        assert co.usage().kv_used_tokens == 0 and co.usage().running == 0
        await co.stop()

    run(main())


def test_abort_a_waiting_prefill_and_a_kv_load():
    async def main() -> None:
        pre, dec = await engine("prefill"), await engine("decode")
        hog = await pre.prefill(req("hog", 2000, 1))
        hog2 = await pre.prefill(req("hog2", 2000, 1))
        blocked = asyncio.create_task(pre.prefill(req("blocked", 2000, 1)))
        await asyncio.sleep(0)
        assert pre.usage().waiting == 1
        await pre.abort("blocked")
        with pytest.raises(EngineError, match="aborted"):
            await blocked
        assert pre.usage().waiting == 0
        await pre.abort("hog")  # abort also frees held KV
        assert pre.usage().kv_used_tokens == 2000

        r = req("load", 2000, 5)
        loading = asyncio.create_task(dec.load_kv(r, KVHandle("load", 2000, hog2.kv.num_bytes, "prefill-0")))
        await asyncio.sleep(0)
        await dec.abort("load")
        with pytest.raises(EngineError, match="aborted"):
            await loading
        with pytest.raises(EngineError, match="load_kv"):
            await collect(dec.decode(r, hog.first_token))
        await pre.stop()
        await dec.stop()

    run(main())


def test_stop_ends_pending_requests_with_engine_error():
    async def main() -> None:
        co = await engine("colocated")
        it = co.generate(req("a", 100, 1000))
        await anext(it)
        await co.stop()
        with pytest.raises(EngineError, match="stopped"):
            await collect(it)
        with pytest.raises(EngineError, match="not running"):
            await collect(co.generate(req("b", 10, 10)))

    run(main())


def bad_requests(max_model_len: int) -> list[EngineRequest]:
    return [
        EngineRequest("empty", (), 5),
        EngineRequest("zero", (1, 2, 3), 0),
        EngineRequest("long", tuple(range(max_model_len - 3)), 4),
    ]


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_invalid_requests_raise_engine_error(role: str):
    async def main() -> None:
        e = await engine(role)
        by_role: dict[str, list[Callable[[EngineRequest], Awaitable[Any]]]] = {
            "prefill": [e.prefill],
            "decode": [
                lambda r: e.load_kv(r, KVHandle(r.request_id, r.prompt_len, 0, "p")),
                lambda r: collect(e.decode(r, 0)),
            ],
            "colocated": [lambda r: collect(e.generate(r))],
        }
        for call in by_role[role]:
            for bad in bad_requests(e.max_model_len):
                with pytest.raises(EngineError) as info:
                    await call(bad)
                assert "\n" not in str(info.value) and bad.request_id in str(info.value)
        assert e.usage().kv_used_tokens == 0 and e.usage().waiting == 0
        await e.stop()

    run(main())


def test_wrong_role_duplicate_id_and_bad_construction():
    async def main() -> None:
        pre, co = await engine("prefill"), await engine("colocated")
        with pytest.raises(EngineError, match="colocated"):
            await collect(pre.generate(req("a", 10, 2)))
        with pytest.raises(EngineError, match="prefill"):
            await co.prefill(req("a", 10, 2))
        it = co.generate(req("dup", 10, 500))
        await anext(it)
        with pytest.raises(EngineError, match="already active"):
            await collect(co.generate(req("dup", 10, 5)))
        await co.abort("dup")
        for e in (pre, co):
            await e.stop()

    run(main())
    profile = load_profile("tiny")
    with pytest.raises(ValueError, match="role"):
        SimEngine(profile, "both", "x", ScaledClock())
    e = SimEngine(profile, "decode", "d1", ScaledClock(), vocab_size=7, max_batched_tokens=64)
    assert (e.model_name, e.max_model_len, e.instance_id, e.role) == ("tetri/tiny-sim", 2048, "d1", "decode")
    assert (e.vocab_size, e.max_batched_tokens, e.cost.profile.name) == (7, 64, "tiny")
    # Default policies: fcfs chunked prefill with the iteration budget as ChunkSize, greedy admission.
    assert (e.policies.chunk_size, e.policies.prefill_policy, e.policies.decode_admission) == (64, "fcfs", "greedy")
    assert e.chunked is True
    assert e.policy_stats() == dict.fromkeys(
        (
            "preemptions",
            "wasted_prefill_tokens",
            "prefill_iterations",
            "decode_iterations",
            "mixed_iterations",
            "admitted_by_policy",
        ),
        0,
    )
    e.configure(e.policies.changed(chunk_size=128, decode_admission="reserve-static"), chunked=False)
    assert (e.policies.chunk_size, e.policies.decode_admission, e.chunked) == (128, "reserve-static", False)
