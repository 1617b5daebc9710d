"""The plan file: the public JSON format `tetrictl plan solve` writes and the live replay reads.

    {
      "format": "tetri-plan/1",
      "memory": M, "policy": "sorted-f", "solver": "swap", "backfill": false,
      "batches": [["id", ...], ...],          # Sorted-F's ordered list, batch by batch
      "schedule": [{"id", "prompt_tokens", "output_tokens", "start", "finish"}, ...],
      "tel", "avg_latency", "p50_latency", "p99_latency", "makespan", "peak_memory", "evictions",
      "solver_stats": {"iterations", "batches", "improvement"?},
      "lower_bound": {"value", "method", …}, "gap": tel / lower bound,   # written by `tetrictl plan solve`
      "n": requests planned, "dropped": oversized requests left out
    }

Nothing in it depends on the machine or the time it was made (no wall time, no date): the same workload,
memory and options give the same file, byte for byte.

Executing a plan means admitting in the order of its batches, flattened (or, for a plan without
batches, in order of planned start) with the stop rule. The schedule rows carry each request's lengths,
so a plan is also its own backlog (`Plan.backlog`, what `tetrictl plan replay` sends); rows of plans
written before the lengths were added lack them, and a replay then needs the workload file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from .executor import Schedule
from .metrics import summarize
from .policies import PolicyResult
from .workload import IntArray, Workload, WorkloadError

FORMAT = "tetri-plan/1"


def schedule_rows(w: Workload, sched: Schedule) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(w.n):
        row: dict[str, Any] = {
            "id": w.ids[i],
            "prompt_tokens": int(w.s[i]),
            "output_tokens": int(w.o[i]),
            "start": int(sched.start[i]),
            "finish": int(sched.finish[i]),
        }
        if w.a[i]:
            row["arrival"] = int(w.a[i])
        rows.append(row)
    for i, p, e in sched.evictions:
        rows[i].setdefault("evicted", []).append([p, e])
    return rows


def build_plan(w: Workload, memory: int, result: PolicyResult, dropped: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": FORMAT,
        "memory": memory,
        "policy": result.policy,
        "solver": result.solver,
        "backfill": result.backfill,
        "batches": [[w.ids[i] for i in b.tolist()] for b in result.batches],
        "schedule": schedule_rows(w, result.schedule),
    }
    doc.update(summarize(w, result.schedule))
    doc["solver_stats"] = {
        "iterations": result.iterations,
        "batches": len(result.batches),
    }
    if result.improved is not None:  # sorted-f --solver auto: the improvement phase's account
        imp = result.improved
        doc["solver_stats"]["improvement"] = {
            "seed": imp.seed,
            "seed_tel": imp.seed_tel,
            "moves_tried": imp.evaluations,
            "moves_kept": imp.accepted,
        }
    doc["n"] = w.n
    doc["dropped"] = dropped
    return doc


@dataclass(frozen=True)
class PlannedRequest:
    prompt_tokens: int  # 0 in plans written before the rows carried lengths
    output_tokens: int
    arrival: int
    finish: int | None  # the planned finish step


@dataclass
class Plan:
    memory: int
    policy: str
    order: list[str]  # ids in admission order
    backfill: bool
    tel: int | None
    doc: dict[str, Any]
    backlog: dict[str, PlannedRequest]  # the schedule rows, in file order


def parse_plan(text: str, source: str = "plan") -> Plan:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{source}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict):
        raise WorkloadError(f"{source}: expected a JSON object")
    memory = doc.get("memory")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 2:
        raise WorkloadError(f"{source}: field 'memory' must be an integer ≥ 2")
    batches = doc.get("batches", [])
    if not isinstance(batches, list) or not all(
        isinstance(b, list) and all(isinstance(x, str) for x in b) for b in batches
    ):
        raise WorkloadError(f"{source}: field 'batches' must be a list of lists of ids")
    order = [x for b in batches for x in b]
    sched = doc.get("schedule")
    if sched is not None and (not isinstance(sched, list) or not all(isinstance(r, dict) for r in sched)):
        raise WorkloadError(f"{source}: field 'schedule' must be a list of objects")
    rows: list[dict[str, Any]] = sched or []
    if not order:
        if not rows:
            raise WorkloadError(f"{source}: needs 'batches' or 'schedule'")
        try:
            rows = sorted(rows, key=lambda r: (int(r["start"]), str(r["id"])))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: an infinite start
            raise WorkloadError(f"{source}: every schedule entry needs 'id' and integer 'start'") from None
        order = [str(r["id"]) for r in rows]
    backlog = _backlog(rows, source)
    seen: set[str] = set()
    for rid in order:
        if rid in seen:
            raise WorkloadError(f"{source}: request {rid!r} planned twice")
        seen.add(rid)
        if rows and rid not in backlog:
            raise WorkloadError(f"{source}: names unknown request {rid!r} (not in its schedule)")
    tel = doc.get("tel")
    return Plan(
        memory,
        str(doc.get("policy", "plan")),
        order,
        bool(doc.get("backfill", False)),
        tel if isinstance(tel, int) else None,
        doc,
        backlog,
    )


def _int_or_none(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _backlog(rows: list[dict[str, Any]], source: str) -> dict[str, PlannedRequest]:
    out: dict[str, PlannedRequest] = {}
    for k, r in enumerate(rows):
        rid = r.get("id")
        if not isinstance(rid, str) or not rid:
            raise WorkloadError(f"{source}: schedule entry {k}: field 'id' must be a non-empty string")
        if rid in out:
            raise WorkloadError(f"{source}: schedule entry {k}: duplicate id {rid!r}")
        lengths = [r.get("prompt_tokens"), r.get("output_tokens")]
        arrival, finish = _int_or_none(r.get("arrival", 0)), _int_or_none(r.get("finish"))
        if arrival is None or arrival < 0:
            raise WorkloadError(f"{source}: schedule entry {k} ({rid}): field 'arrival' must be an integer ≥ 0")
        if all(x is None for x in lengths):
            out[rid] = PlannedRequest(0, 0, arrival, finish)  # an older plan: lengths come from the workload
            continue
        for name, x in zip(("prompt_tokens", "output_tokens"), lengths, strict=True):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise WorkloadError(f"{source}: schedule entry {k} ({rid}): field {name!r} must be a positive integer")
        out[rid] = PlannedRequest(int(lengths[0]), int(lengths[1]), arrival, finish)  # type: ignore[arg-type]
    return out


def plan_order(plan: Plan, w: Workload, source: str = "plan") -> IntArray:
    """Map the plan's ids onto the workload; every id must be known and every request planned once."""
    index = {rid: i for i, rid in enumerate(w.ids)}
    seen: set[str] = set()
    out = []
    for rid in plan.order:
        if rid not in index:
            raise WorkloadError(f"{source}: names unknown request {rid!r}")
        if rid in seen:
            raise WorkloadError(f"{source}: request {rid!r} planned twice")
        seen.add(rid)
        out.append(index[rid])
    if len(out) != w.n:
        missing = next(r for r in w.ids if r not in seen)
        raise WorkloadError(f"{source}: does not plan request {missing!r} ({w.n - len(out)} missing)")
    return np.array(out, dtype=np.int64)
