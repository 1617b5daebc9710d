"""Requests and workloads of the planner model, and the JSON Lines workload format.

A request i has a prompt length s_i ≥ 1, an output length o_i ≥ 1, an arrival step a_i ≥ 0 and an
optional predicted output range [lo_i, hi_i]. A `Workload` keeps them as numpy arrays indexed 0..n-1
in file order; the string ids travel alongside.

Parsing is pure (it takes lines of text, not a path) and reports the first problem as a
`WorkloadError` whose message names the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import WorkloadError

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt_tokens: int
    output_tokens: int
    arrival: int = 0
    predicted_output: tuple[int, int] | None = None

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        if self.arrival:
            d["arrival"] = self.arrival
        if self.predicted_output is not None:
            d["predicted_output"] = list(self.predicted_output)
        return d


@dataclass(frozen=True)
class Workload:
    """n requests as arrays. ``lo``/``hi`` are present only when every request has a prediction."""

    ids: tuple[str, ...]
    s: IntArray
    o: IntArray
    a: IntArray
    lo: IntArray | None = None
    hi: IntArray | None = None

    @property
    def n(self) -> int:
        return len(self.ids)

    @classmethod
    def from_requests(cls, reqs: Sequence[Request]) -> Workload:
        ids = tuple(r.id for r in reqs)
        s = np.fromiter((r.prompt_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        o = np.fromiter((r.output_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        a = np.fromiter((r.arrival for r in reqs), dtype=np.int64, count=len(reqs))
        lo = hi = None
        if reqs and all(r.predicted_output is not None for r in reqs):
            lo = np.array([r.predicted_output[0] for r in reqs], dtype=np.int64)  # type: ignore[index]
            hi = np.array([r.predicted_output[1] for r in reqs], dtype=np.int64)  # type: ignore[index]
        return cls(ids, s, o, a, lo, hi)

    @classmethod
    def from_arrays(
        cls,
        s: Sequence[int] | IntArray,
        o: Sequence[int] | IntArray,
        a: Sequence[int] | IntArray | None = None,
        ids: Sequence[str] | None = None,
    ) -> Workload:
        s_arr = np.asarray(s, dtype=np.int64)
        o_arr = np.asarray(o, dtype=np.int64)
        a_arr = np.zeros_like(s_arr) if a is None else np.asarray(a, dtype=np.int64)
        id_t = tuple(ids) if ids is not None else tuple(f"r{i}" for i in range(len(s_arr)))
        return cls(id_t, s_arr, o_arr, a_arr)

    def requests(self) -> list[Request]:
        out = []
        for i in range(self.n):
            pred = None if self.lo is None or self.hi is None else (int(self.lo[i]), int(self.hi[i]))
            out.append(Request(self.ids[i], int(self.s[i]), int(self.o[i]), int(self.a[i]), pred))
        return out

    def subset(self, keep: IntArray) -> Workload:
        lo = None if self.lo is None else self.lo[keep]
        hi = None if self.hi is None else self.hi[keep]
        return Workload(tuple(self.ids[i] for i in keep), self.s[keep], self.o[keep], self.a[keep], lo, hi)

    @property
    def peak(self) -> IntArray:
        """KV slots a request holds in its last step: s_i + o_i."""
        return self.s + self.o

    def oversized(self, memory: int) -> IntArray:
        """Indices of requests that can never run under budget ``memory`` (s_i + o_i > M)."""
        return np.flatnonzero(self.peak > memory)

    def check_memory(self, memory: int, drop_oversized: bool = False) -> tuple[Workload, int]:
        """Validate against budget M. Returns the (possibly reduced) workload and how many were dropped.

        Raises `WorkloadError` naming the first oversized request unless ``drop_oversized``.
        """
        if memory < 2:
            raise WorkloadError(f"memory must be at least 2 KV slots, got {memory}")
        bad = self.oversized(memory)
        if len(bad) == 0:
            return self, 0
        if not drop_oversized:
            i = int(bad[0])
            raise WorkloadError(
                f"request {self.ids[i]!r} needs {int(self.peak[i])} KV slots (prompt {int(self.s[i])} + "
                f"output {int(self.o[i])}) > memory {memory}; {len(bad)} such request(s) "
                "(use --drop-oversized to drop them)"
            )
        keep = np.flatnonzero(self.peak <= memory)
        return self.subset(keep), len(bad)


_FIELDS = {"id", "prompt_tokens", "output_tokens", "arrival", "predicted_output"}


def _positive_int(obj: dict[str, object], key: str, where: str, minimum: int = 1) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {json.dumps(v)}")
    if v < minimum:
        adj = "positive" if minimum == 1 else f"at least {minimum}"
        raise WorkloadError(f"{where}: field {key!r} must be {adj}, got {v}")
    return v


def parse_request(obj: object, where: str) -> Request:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    for key in ("id", "prompt_tokens", "output_tokens"):
        if key not in obj:
            raise WorkloadError(f"{where}: missing field {key!r}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise WorkloadError(f"{where}: unknown field {unknown[0]!r}")
    rid = obj["id"]
    if not isinstance(rid, str) or not rid:
        raise WorkloadError(f"{where}: field 'id' must be a non-empty string")
    s = _positive_int(obj, "prompt_tokens", where)
    o = _positive_int(obj, "output_tokens", where)
    a = _positive_int(obj, "arrival", where, minimum=0) if obj.get("arrival") is not None else 0
    pred = obj.get("predicted_output")
    rng: tuple[int, int] | None = None
    if pred is not None:
        if (
            not isinstance(pred, list)
            or len(pred) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pred)
        ):
            raise WorkloadError(f"{where}: field 'predicted_output' must be [lo, hi] integers")
        lo, hi = pred
        if lo < 1 or hi < lo:
            raise WorkloadError(f"{where}: field 'predicted_output' needs 1 ≤ lo ≤ hi, got [{lo}, {hi}]")
        rng = (lo, hi)
    return Request(rid, s, o, a, rng)


def parse_jsonl(lines: Iterable[str], source: str = "workload") -> Workload:
    """Parse a JSON Lines workload. Blank lines are skipped; the first problem raises `WorkloadError`."""
    reqs: list[Request] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: malformed JSON ({e.msg})") from None
        req = parse_request(obj, where)
        if req.id in seen:
            raise WorkloadError(f"{where}: duplicate id {req.id!r} (first on line {seen[req.id]})")
        seen[req.id] = lineno
        reqs.append(req)
    if not reqs:
        raise WorkloadError(f"{source}: no requests")
    return Workload.from_requests(reqs)


def dump_jsonl(w: Workload) -> str:
    return "".join(json.dumps(r.to_json()) + "\n" for r in w.requests())
