"""Workload traces: requests with their arrival times and lengths, as JSON lines.

One request per line: ``{"arrival_s": 0.125, "prompt_tokens": 812, "output_tokens": 64}`` (an ``"id"`` is
kept when present; other keys are ignored). Arrivals are seconds from the trace's start (they need not be
sorted); the answer's true length is ``output_tokens`` and the client's limit is the same. What prompts
share, Mooncake's way (FAST'25; docs/references.md): ``"hash_ids"``, one id per ``"hash_block"`` tokens of
the prompt (512 when absent, as in Mooncake's traces), requests sharing leading ids sharing that prefix;
and ``"session_id"``, the conversation or agent run it belongs to. A Mooncake trace's own lines
(``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``) are read as they are. `tetrictl
requests export` writes a trace from a live cluster's status table (`rows_to_trace`: lengths only);
`trace_lines` writes generated requests (`tetri.des.sessions`) with their ids; `tetrictl advise` reads one
(`read_trace`). Pure: text and dicts in, `Request`s out; a bad line is a `WorkloadSpecError` naming the
line and the field. `window_workload` turns the requests of a recent window (`Seen`: finished or not) into
one, for the `advise` flip policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .workloads import HASH_BLOCK, Request, WorkloadSpecError

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")
MOONCAKE = ("timestamp", "input_length", "output_length")  # Mooncake's names (timestamp in milliseconds)


def read_trace(lines: Iterable[str], max_model_len: int | None = None) -> list[Request]:
    """The trace's requests in arrival order (blank lines skipped)."""
    out: list[Request] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise WorkloadSpecError(f"trace line {number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise WorkloadSpecError(f"trace line {number}: not a JSON object")
        if "arrival_s" not in row and all(k in row for k in MOONCAKE):  # a Mooncake trace's line
            ms = row["timestamp"]
            if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
                raise WorkloadSpecError(f"trace line {number}: timestamp must be a number of milliseconds, got {ms!r}")
            row = dict(row, arrival_s=ms / 1000, prompt_tokens=row["input_length"], output_tokens=row["output_length"])
        for key in FIELDS:
            if key not in row:
                raise WorkloadSpecError(f"trace line {number}: {key} is missing")
        arrival = row["arrival_s"]
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not math.isfinite(arrival):
            raise WorkloadSpecError(f"trace line {number}: arrival_s must be a number of seconds, got {arrival!r}")
        if arrival < 0:
            raise WorkloadSpecError(f"trace line {number}: arrival_s must be ≥ 0, got {arrival!r}")
        lengths = []
        for key in ("prompt_tokens", "output_tokens"):
            v = row[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise WorkloadSpecError(f"trace line {number}: {key} must be a whole number ≥ 1, got {v!r}")
            lengths.append(v)
        prompt, output = lengths
        if max_model_len is not None and prompt + output > max_model_len:
            raise WorkloadSpecError(
                f"trace line {number}: prompt_tokens + output_tokens = {prompt + output} exceeds the model's "
                f"context of {max_model_len}"
            )
        block, ids = _hash_ids(row, number, prompt)
        session = row.get("session_id", "")
        if isinstance(session, bool) or not isinstance(session, str | int):
            raise WorkloadSpecError(f"trace line {number}: session_id must be a string, got {session!r}")
        rid = str(row.get("id") or f"t{number}")
        out.append(Request(rid, float(arrival), prompt, output, output, ids, block, str(session)))
    if not out:
        raise WorkloadSpecError("the trace has no requests")
    if len({r.request_id for r in out}) != len(out):
        raise WorkloadSpecError("trace: two requests have the same id")
    return sorted(out, key=lambda r: (r.arrival, r.request_id))


def _hash_ids(row: Mapping[str, Any], number: int, prompt: int) -> tuple[int, tuple[int, ...]]:
    """A line's hash block and hash ids (none: 512, ()), checked."""
    block = row.get("hash_block", HASH_BLOCK)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise WorkloadSpecError(f"trace line {number}: hash_block must be a whole number of tokens ≥ 1, got {block!r}")
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**64 for i in ids
    ):
        raise WorkloadSpecError(f"trace line {number}: hash_ids must be a list of whole numbers in [0, 2^64)")
    most = -(-prompt // block)
    if len(ids) > most:
        raise WorkloadSpecError(
            f"trace line {number}: hash_ids has {len(ids)} ids, more than the {most} blocks of {block} tokens "
            f"its {prompt} prompt tokens fill"
        )
    return block, tuple(ids)


def trace_lines(requests: Iterable[Request]) -> list[dict[str, Any]]:
    """Requests as trace lines (their ids, sessions and hash ids kept), oldest first."""
    out = []
    for r in sorted(requests, key=lambda x: (x.arrival, x.request_id)):
        line: dict[str, Any] = {
            "id": r.request_id,
            "arrival_s": round(r.arrival, 6),
            "prompt_tokens": r.prompt_len,
            "output_tokens": r.output_len,
        }
        if r.session:
            line["session_id"] = r.session
        if r.hash_ids:
            line["hash_block"] = r.hash_block
            line["hash_ids"] = list(r.hash_ids)
        out.append(line)
    return out


def rows_to_trace(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Finished status-table rows as trace lines (arrivals relative to the first), oldest first."""
    done = [r for r in rows if r.get("status") == "finished" and r.get("output_tokens")]
    done.sort(key=lambda r: (r["arrival_ts"], r["id"]))
    if not done:
        return []
    t0 = done[0]["arrival_ts"]
    return [
        {
            "id": r["id"],
            "arrival_s": round(r["arrival_ts"] - t0, 6),
            "prompt_tokens": r["prompt_tokens"],
            "output_tokens": r["output_tokens"],
        }
        for r in done
    ]


@dataclass(frozen=True)
class Seen:
    """One request of the window, as the status table (or the simulator) shows it."""

    request_id: str
    arrival: float
    prompt_len: int
    max_tokens: int
    produced: int  # tokens generated so far (all of them once finished)
    finished: bool
    predicted_hi: int | None = None  # the length predictor's upper bound at admission


def window_workload(seen: Sequence[Seen]) -> list[Request]:
    """The window as a workload to replay for the `advise` flip policy: a finished request with its own answer
    length; one still running with the larger of what it has produced and the length predictor's upper
    bound, capped by its max_tokens (a backlog of long answers must count, not only the quick ones that
    finished)."""
    out = []
    for s in seen:
        if s.finished:
            length = s.produced
        else:
            bound = s.max_tokens if s.predicted_hi is None else min(s.predicted_hi, s.max_tokens)
            length = max(s.produced, bound)
        if s.prompt_len >= 1 and length >= 1:
            out.append(Request(s.request_id, s.arrival, s.prompt_len, length, max(length, s.max_tokens)))
    return out
