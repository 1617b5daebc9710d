"""workers.service's token path: a call's `_Feed` on its Serve stream's one `out` queue (an entry per call and
event-loop turn), and the writer's `_down`, which packs what that queue held into one `ServeDown`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from tetri.proto import pb
from workers.service import _down, _Feed, _Out


def _run(scenario: Callable[[_Out], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        await scenario(_Out(asyncio.get_running_loop()))

    asyncio.run(main())


async def _turn() -> None:
    """Let the event loop finish this turn (and `_Out` seal it)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _take(out: _Out) -> pb.ServeDown | None:
    """What the stream's writer sends for all that `out` holds now."""
    batch: list[tuple[int, list[int]] | pb.TokenChunk | pb.AcceptReply] = []
    while not out.empty():
        item = out.get_nowait()
        assert item is not None
        batch.append(item)
    return _down(batch)


def _tokens(down: pb.ServeDown | None) -> tuple[list[int], list[int], list[int]]:
    assert down is not None
    return list(down.token_calls), list(down.token_counts), list(down.tokens)


def _end(rid: str = "r") -> pb.TokenChunk:
    return pb.TokenChunk(request_id=rid, finished=True, finish_reason="length")


def test_a_calls_tokens_of_one_turn_share_an_entry_and_every_call_shares_the_message() -> None:
    async def scenario(out: _Out) -> None:
        a, b = _Feed(1, out), _Feed(2, out)
        for tok in (10, 11):
            a.extend([tok])
        b.extend([20])
        a.extend([12])
        assert out.qsize() == 2  # one entry per call, however many tokens it has this turn
        assert _tokens(_take(out)) == ([1, 2], [3, 1], [10, 11, 12, 20])
        a.extend([13])  # taken: the same turn's next token opens another entry
        assert _tokens(_take(out)) == ([1], [1], [13])

    _run(scenario)


def test_each_turns_tokens_stay_apart_when_the_writer_takes_several_turns_at_once() -> None:
    async def scenario(out: _Out) -> None:
        feed = _Feed(5, out)
        feed.extend([1])
        feed.extend([2])
        await _turn()
        feed.extend([3])
        await _turn()
        feed.extend([4])
        assert _tokens(_take(out)) == ([5, 5, 5], [2, 1, 1], [1, 2, 3, 4])

    _run(scenario)


def test_the_end_takes_this_turns_tokens_and_nothing_goes_after_it() -> None:
    async def scenario(out: _Out) -> None:
        feed = _Feed(3, out)
        feed.extend([1])
        await _turn()
        feed.extend([2])
        feed.extend([3])
        feed.finish(_end())
        feed.finish(pb.TokenChunk(request_id="r", finished=True, finish_reason="abort"))  # the first end stands
        feed.extend([4])
        down = _take(out)
        assert _tokens(down) == ([3], [1], [1])  # an earlier turn's entry goes as it is; this turn's is empty
        assert down is not None
        (end,) = down.chunks
        assert (end.call, list(end.token_ids), end.finish_reason) == (3, [2, 3], "length")
        assert out.empty()

    _run(scenario)


def test_an_unbound_feed_holds_its_tokens_and_end_until_bound() -> None:
    async def scenario(out: _Out) -> None:
        feed = _Feed()  # a decode job's, made at Accept
        feed.extend([5])
        await _turn()
        feed.extend([6])
        assert out.empty()
        feed.bind(7, out)
        feed.extend([8])
        assert _tokens(_take(out)) == ([7], [3], [5, 6, 8])

        done = _Feed()
        done.extend([1])
        await _turn()
        done.extend([2])
        done.finish(_end())
        done.bind(9, out)  # attached after the job ended: its end, with every token, at once
        down = _take(out)
        assert _tokens(down) == ([], [], [])
        assert down is not None
        (end,) = down.chunks
        assert (end.call, list(end.token_ids)) == (9, [1, 2])

    _run(scenario)


def test_after_unbind_nothing_more_goes_out() -> None:
    async def scenario(out: _Out) -> None:
        feed = _Feed(4, out)
        feed.extend([1])
        feed.unbind()  # the caller left
        feed.extend([2])
        feed.finish(_end())
        down = _take(out)  # what was on `out` before it left still goes; nothing after
        assert _tokens(down) == ([4], [1], [1])
        assert down is not None and not down.chunks
        feed.extend([3])
        assert _take(out) is None

    _run(scenario)


def test_replies_and_other_calls_ends_share_the_message() -> None:
    async def scenario(out: _Out) -> None:
        _Feed(1, out).extend([4])
        out.put_nowait(pb.AcceptReply(accepted=True, call=2))
        _Feed(3, out).finish(_end())
        down = _take(out)
        assert _tokens(down) == ([1], [1], [4])
        assert down is not None
        assert [r.call for r in down.replies] == [2] and [c.call for c in down.chunks] == [3]

    _run(scenario)
