"""Session workloads (`tetri.des.sessions`) and traces that say what prompts share (`tetri.des.trace`): a
conversation's next turn holds its last turn's prompt, agent steps grow, documents repeat; the hash ids
say exactly that, survive a trace's round trip, and Mooncake's own trace lines read as they are."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tetri.des.sessions import BLOCK, make_sessions
from tetri.des.trace import read_trace, trace_lines
from tetri.des.workloads import WorkloadSpecError


def shared_ids(a, b) -> int:
    n = 0
    while n < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[n] == b.hash_ids[n]:
        n += 1
    return n


def test_a_conversation_turn_holds_the_turn_before_and_every_conversation_the_system_prompt():
    reqs = make_sessions("chat-sessions", 300, 2.0, seed=1)
    by_id = {r.request_id: r for r in reqs}
    turns = [r for r in reqs if r.parent]
    assert turns and all(r.session == by_id[r.parent].session for r in turns)
    for r in turns:
        parent = by_id[r.parent]
        # all of the turn before's full blocks are this one's leading blocks
        assert shared_ids(r, parent) >= parent.prompt_len // BLOCK
        assert r.prompt_len > parent.prompt_len + parent.output_len  # its answer and a new user turn
        assert r.arrival >= parent.arrival
    firsts = [r for r in reqs if not r.parent]
    assert all(shared_ids(firsts[0], r) == 1024 // BLOCK for r in firsts[1:10])  # the shared system prompt
    turns_per = np.bincount(np.unique([r.session for r in reqs], return_inverse=True)[1])
    assert 1.7 < turns_per.mean() < 2.3  # LMSYS-Chat-1M: 2.0 turns a conversation
    assert all(len(r.hash_ids) == -(-r.prompt_len // BLOCK) for r in reqs)


def test_agent_steps_grow_and_documents_repeat():
    steps = [r for r in make_sessions("agent", 200, 2.0, seed=2) if r.parent]
    assert steps and all(r.prompt_len > 0 for r in steps)
    rag = make_sessions("rag-docs", 300, 5.0, seed=3)
    firsts = {r.hash_ids[:20] for r in rag}
    assert len(firsts) <= 32 and len(firsts) < len(rag) / 4  # 32 documents, the popular ones often


def test_session_mixes_are_deterministic_and_arrive_at_about_the_rate():
    a = make_sessions("rag-docs", 400, 4.0, seed=5)
    assert a == make_sessions("rag-docs", 400, 4.0, seed=5)
    assert 3.0 < len(a) / a[-1].arrival < 5.0
    with pytest.raises(WorkloadSpecError, match="unknown session mix"):
        make_sessions("chats", 10, 1.0)


def test_a_session_trace_round_trips_and_a_mooncake_line_reads():
    reqs = make_sessions("chat-sessions", 40, 2.0, seed=4)
    lines = [json.dumps(x) for x in trace_lines(reqs)]

    def kept(r):  # what a trace keeps (the client's limit is the answer's length; parents are not kept)
        return (r.request_id, round(r.arrival, 6), r.prompt_len, r.output_len, r.hash_ids, r.hash_block, r.session)

    assert [kept(r) for r in read_trace(lines)] == [kept(r) for r in reqs]
    mooncake = (
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
        '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}'
    )
    (r,) = read_trace([mooncake])
    assert (r.arrival, r.prompt_len, r.output_len, r.hash_block, len(r.hash_ids)) == (27.482, 6955, 52, 512, 14)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5, "hash_ids": "abc"}', "hash_ids must be a list"),
        ('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5, "hash_ids": [-1]}', "hash_ids must be a list"),
        ('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5, "hash_ids": [1, 2]}', "more than the 1 blocks"),
        ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "hash_block": 0}', "hash_block must be"),
        ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "session_id": [1]}', "session_id must be"),
        ('{"timestamp": "x", "input_length": 10, "output_length": 5}', "timestamp must be"),
    ],
)
def test_a_bad_trace_line_is_named(line: str, message: str):
    with pytest.raises(WorkloadSpecError, match=f"trace line 2: .*{message}"):
        read_trace(['{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}', line])
