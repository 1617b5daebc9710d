"""Workload traces: requests with their arrival times and lengths, as JSON lines.

One request per line: ``{"arrival_s": 0.125, "prompt_tokens": 812, "output_tokens": 64}`` (an ``"id"`` is
kept when present; other keys are ignored). Arrivals are seconds from the trace's start (they need not be
sorted); the answer's true length is ``output_tokens`` and the client's limit is the same. `tetrictl
requests export` writes one from a live cluster's status table (`rows_to_trace`); `tetrictl advise`
reads one (`read_trace`). Pure: text and dicts in, `Request`s out; a bad line is a `WorkloadSpecError`
naming the line and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .workloads import Request, WorkloadSpecError

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")


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
        rid = str(row.get("id") or f"t{number}")
        out.append(Request(rid, float(arrival), prompt, output, output))
    if not out:
        raise WorkloadSpecError("the trace has no requests")
    if len({r.request_id for r in out}) != len(out):
        raise WorkloadSpecError("trace: two requests have the same id")
    return sorted(out, key=lambda r: (r.arrival, r.request_id))


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
