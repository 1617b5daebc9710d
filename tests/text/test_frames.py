"""A streamed token chunk built as bytes from its stream's templates (`_Frames`) is byte for byte the frame
the chunk's dict builders (`chat_chunk`, `completion_chunk`) and `sse_data` make, for any text (Unicode
line breaks, quotes, NULs), token ids or none, and an id or model name with characters JSON escapes."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from daemon.api.schemas import chat_chunk, completion_chunk
from daemon.front.openai import _Frames, _Job, sse_data


def _job(rid: str, model: str, with_ids: bool) -> _Job:
    async def serve(**_: Any) -> Any:
        raise AssertionError("not served here")

    return _Job(rid, model, 3, 1_700_000_000, serve, False, with_ids)


NAMES = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@given(
    rid=NAMES,
    model=NAMES,
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=16) | st.sampled_from(["a\u2028b", "\x85", '"\\']),
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    with_ids=st.booleans(),
)
def test_frames_are_the_builders_frames(rid: str, model: str, text: str, ids: list[int], with_ids: bool) -> None:
    job = _job(rid, model, with_ids)
    sent_ids = ids if with_ids else None
    completion = _Frames(job, chat=False).frame(ids, text)
    assert completion == sse_data(completion_chunk(rid, job.created, model, text, None, None, sent_ids))
    chat = _Frames(job, chat=True).frame(ids, text)
    delta = {"content": text} if text else {}
    assert chat == sse_data(chat_chunk(rid, job.created, model, delta, None, None, sent_ids))
