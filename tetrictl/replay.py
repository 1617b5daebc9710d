"""`tetrictl plan replay`: run an offline Sorted-F plan's backlog on the live cluster and compare.

A replay (1) takes the plan's backlog — synthetic prompts of the planned lengths, exactly the planned
output lengths (`max_tokens`) —, (2) loads the plan's admission order into one decode instance
(`PUT /api/v1/instances/{id}/plan`: that instance admits in the plan's order while the plan's future fits
its own KV capacity, so M is the instance's), (3) sends the backlog through the OpenAI endpoint, every
request pinned to that instance (`tetri.decode_instance`) and named by the replay (`tetri.request_id`
= ``<tag>.<k>``), and (4) polls the status table for progress until every request has ended. However
it ends (done, Ctrl-C, an error), it clears the plan, which restores the instance's previous policy.

`order="fcfs"` replays the same backlog through the same mechanism in first-come-first-served order
(the planner's `fcfs` policy re-run offline at the plan's M), the baseline a plan is compared with.

The comparison (`progress`) is a pure function of the backlog and the status rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.stats import kendalltau

from tetri.planner.planfile import Plan, build_plan, parse_plan
from tetri.planner.policies import run_policy
from tetri.planner.workload import Workload, WorkloadError

from .client import ClientError, TetriClient

ORDERS = ("plan", "fcfs")
MAX_IN_FLIGHT = 1000
FAILED_POLLS = 10  # consecutive failed progress polls before a replay gives up


@dataclass(frozen=True)
class Item:
    """One request of the backlog, as the replay sends it."""

    key: str  # the plan's id
    prompt_tokens: int
    output_tokens: int
    arrival: int  # planner steps
    planned_finish: int | None


@dataclass
class Progress:
    n: int
    sent: int = 0
    started: int = 0  # admitted to decode
    finished: int = 0
    failed: int = 0
    planned_tel: int | None = None  # steps, from the plan
    measured_tel_s: float | None = None  # Σ (finish − replay start), seconds, over finished requests
    measured_avg_latency_s: float | None = None
    order_agreement: float | None = None  # Kendall's tau, planned vs measured completion order
    planned_order: list[str] = field(default_factory=list)
    measured_order: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.finished + self.failed >= self.n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"done": self.done}


def backlog(plan: Plan, workload: Workload | None = None) -> list[Item]:
    """The plan's requests with their lengths, from the plan's schedule rows or else the workload."""
    if workload is not None:
        index = {rid: i for i, rid in enumerate(workload.ids)}
        planned = set(plan.order)
        missing = [rid for rid in plan.order if rid not in index]
        if missing:
            raise WorkloadError(f"plan names request {missing[0]!r}, which the workload does not have")
        return [
            Item(
                rid,
                int(workload.s[index[rid]]),
                int(workload.o[index[rid]]),
                int(workload.a[index[rid]]),
                plan.backlog[rid].finish if rid in plan.backlog else None,
            )
            for rid in workload.ids
            if rid in planned
        ]
    rows = plan.backlog
    if not rows:
        raise WorkloadError("the plan has no schedule rows with lengths: give the workload with --workload")
    if any(r.prompt_tokens == 0 for r in rows.values()):
        raise WorkloadError("the plan's schedule rows lack prompt/output lengths: give the workload with --workload")
    missing = [rid for rid in rows if rid not in set(plan.order)]
    if missing:
        raise WorkloadError(f"the plan schedules request {missing[0]!r} but its batches never admit it")
    return [Item(rid, r.prompt_tokens, r.output_tokens, r.arrival, r.finish) for rid, r in rows.items()]


def workload_of(items: Sequence[Item]) -> Workload:
    return Workload(
        tuple(i.key for i in items),
        np.array([i.prompt_tokens for i in items], dtype=np.int64),
        np.array([i.output_tokens for i in items], dtype=np.int64),
        np.array([i.arrival for i in items], dtype=np.int64),
    )


def fcfs_plan(items: Sequence[Item], memory: int) -> Plan:
    """The planner's fcfs at M, as a plan: the baseline order and its planned finishes."""
    w = workload_of(items)
    doc = build_plan(w, memory, run_policy("fcfs", w, memory))
    return parse_plan(json.dumps(doc), source="fcfs plan")


def progress(items: Sequence[Item], rows: dict[str, dict[str, Any]], sent: int, planned_tel: int | None) -> Progress:
    """Where a replay stands. ``rows`` maps an item's key to its status-table row (absent: not recorded
    yet). Times are the daemon's; the replay starts at the earliest arrival among the rows."""
    p = Progress(len(items), sent=sent, planned_tel=planned_tel)
    arrivals = [r["arrival_ts"] for r in rows.values() if r.get("arrival_ts") is not None]
    t0 = min(arrivals) if arrivals else None
    finishes: dict[str, float] = {}
    for it in items:
        r = rows.get(it.key)
        if r is None:
            continue
        p.started += r.get("decode_start_ts") is not None
        if r.get("status") == "finished" and r.get("finished_ts") is not None:
            finishes[it.key] = r["finished_ts"]
        elif r.get("status") in ("failed", "cancelled", "rejected", "interrupted"):
            p.failed += 1
    p.finished = len(finishes)
    planned = sorted((it for it in items if it.planned_finish is not None), key=lambda it: (it.planned_finish, it.key))
    p.planned_order = [it.key for it in planned]
    p.measured_order = sorted(finishes, key=lambda k: (finishes[k], k))
    if t0 is not None and finishes:
        lat = [f - t0 for f in finishes.values()]
        p.measured_tel_s = float(sum(lat))
        p.measured_avg_latency_s = float(sum(lat) / len(lat))
        p.elapsed_s = max(finishes.values()) - t0
    both = [it for it in planned if it.key in finishes]
    if len(both) >= 2:
        tau = kendalltau([it.planned_finish for it in both], [finishes[it.key] for it in both]).statistic
        p.order_agreement = None if math.isnan(tau) else float(tau)
    return p


def misfits(items: Sequence[Item], plan_memory: int, inst: dict[str, Any]) -> str | None:
    """Why a plan cannot be replayed on this decode instance as planned (one line), or None: a request
    longer than the model's context, or a plan made for more KV memory than the instance holds."""
    context = int(inst.get("max_model_len") or 0)
    capacity = int(inst.get("kv_capacity_tokens") or 0)
    problems = []
    too_long = [it for it in items if context and it.prompt_tokens + it.output_tokens > context]
    if too_long:
        shown = ", ".join(f"{it.key} ({it.prompt_tokens} + {it.output_tokens})" for it in too_long[:3])
        more = f" and {len(too_long) - 3} more" if len(too_long) > 3 else ""
        problems.append(f"{len(too_long)} requests exceed the model's context of {context} tokens: {shown}{more}")
    if capacity and plan_memory > capacity:
        problems.append(
            f"the plan is for M = {plan_memory:,} KV slots and {inst['id']} holds {capacity:,} "
            f"(plan with --memory {capacity})"
        )
    if not problems:
        return None
    return f"the plan does not fit {inst['id']}: " + "; ".join(problems) + " — --force replays it anyway"


class Replay:
    """One replay on the live cluster. ``await replay.run(on_progress)``; ``replay.stop()`` ends it early."""

    def __init__(
        self,
        client: TetriClient,
        plan: Plan,
        items: Sequence[Item],
        instance_id: str | None = None,
        order: str = "plan",
        speed: float | None = None,
        poll_s: float = 0.5,
        force: bool = False,
    ) -> None:
        if order not in ORDERS:
            raise WorkloadError(f"--order must be one of {', '.join(ORDERS)}, not {order!r}")
        if speed is not None and speed <= 0:
            raise WorkloadError("--speed must be positive (planner steps per second)")
        self.client = client
        self.plan = plan if order == "plan" else fcfs_plan(items, plan.memory)
        # the planned finishes compared against are those of the order replayed
        self.items = [
            dataclasses.replace(it, planned_finish=row.finish if (row := self.plan.backlog.get(it.key)) else None)
            for it in items
        ]
        self.order = order
        self.instance_id = instance_id
        self.speed = speed
        self.poll_s = poll_s
        self.force = force
        self.tag = f"rp{secrets.token_hex(3)}"
        self.ids = {it.key: f"{self.tag}.{k}" for k, it in enumerate(self.items)}
        self.sent = 0
        self.info: dict[str, Any] = {}
        self._stopping = asyncio.Event()
        self._loaded = False
        # requests in flight at once: each holds a connection until it finishes, and the progress polls
        # and the dashboard share the client's pool (2,000), so senders must leave room for them
        self._senders = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def _pick_instance(self) -> dict[str, Any]:
        decodes = [i for i in await self.client.instances() if i["role"] == "decode"]
        if self.instance_id is not None:
            hit = next((i for i in decodes if i["id"] == self.instance_id), None)
            if hit is None:
                raise ClientError(f"--instance {self.instance_id}: not a decode instance of this cluster", 2)
        else:
            active = [i for i in decodes if i["state"] == "active"]
            if not active:
                raise ClientError("the cluster has no active decode instance to replay on")
            hit = min(active, key=lambda i: (i["inflight"], i["id"]))
        return hit

    async def prepare(self) -> dict[str, Any]:
        inst = await self._pick_instance()
        why = misfits(self.items, self.plan.memory, inst)
        if why is not None and not self.force:
            raise ClientError(why, 2)  # nothing sent, nothing loaded
        self.instance_id = inst["id"]
        model = inst["model"]  # the plan replays on that instance's model
        renamed = [self.ids[k] for k in self.plan.order]
        reply = await self.client.load_plan(inst["id"], {"memory": self.plan.memory, "batches": [renamed]})
        self._loaded = True
        self.info = {
            "tag": self.tag,
            "instance_id": inst["id"],
            "order": self.order,
            "model": model,
            "n": len(self.items),
            "plan_memory": self.plan.memory,
            "kv_capacity_tokens": reply.get("kv_capacity_tokens"),
            "planned_tel": self.plan.tel,
        }
        return self.info

    async def _send(self, it: Item, t0: float) -> None:
        if self.speed is not None and it.arrival:
            await asyncio.sleep(max(0.0, it.arrival / self.speed - (time.monotonic() - t0)))
        body = {
            "model": self.info["model"],
            "prompt": [1 + (j % 250) for j in range(it.prompt_tokens)],
            "max_tokens": it.output_tokens,
            "tetri": {"request_id": self.ids[it.key], "decode_instance": self.info["instance_id"]},
        }
        async with self._senders:
            self.sent += 1
            with contextlib.suppress(ClientError):  # the status table records a failure; progress counts it
                await self.client.complete(body)

    async def snapshot(self) -> Progress:
        rows = await self.client.all_requests(id_prefix=self.tag + ".")
        by_id = {r["id"]: r for r in rows}
        keyed = {it.key: by_id[self.ids[it.key]] for it in self.items if self.ids[it.key] in by_id}
        return progress(self.items, keyed, self.sent, self.plan.tel)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, on_progress: Callable[[Progress], None] | None = None) -> Progress:
        """Prepare, send the backlog in the plan's order, report progress until every request ended
        (or `stop()`), then restore the instance's policy. Returns the final progress."""
        if not self.info:
            await self.prepare()
        by_key = {it.key: it for it in self.items}
        t0 = time.monotonic()
        senders = [asyncio.create_task(self._send(by_key[k], t0)) for k in self.plan.order]
        failed = 0
        try:
            while True:
                stopper = asyncio.create_task(self._stopping.wait())
                await asyncio.wait([stopper], timeout=self.poll_s)
                stopper.cancel()
                try:
                    snap = await self.snapshot()
                    failed = 0
                except ClientError:
                    failed += 1  # a slow poll is not the end of the replay; many in a row are
                    if failed >= FAILED_POLLS:
                        raise
                    continue
                if on_progress is not None:
                    on_progress(snap)
                if self._stopping.is_set() or (snap.done and all(s.done() for s in senders)):
                    break
            await self._abandon(senders)
            await asyncio.sleep(0.3)  # one flush of the daemon's batched status writes
            return await self.snapshot()
        finally:
            await self._abandon(senders)
            if not all(s.done() and not s.cancelled() for s in senders) or self._stopping.is_set():
                with contextlib.suppress(ClientError):  # what the daemon still runs of this replay stops too
                    await self.client.cancel_many(self.tag + ".")
            await self.restore()

    @staticmethod
    async def _abandon(senders: list[asyncio.Task[None]]) -> None:
        """A stopped or failed replay abandons its requests (the daemon cancels what is in flight)."""
        for s in senders:
            s.cancel()
        await asyncio.gather(*senders, return_exceptions=True)

    async def restore(self) -> None:
        if self._loaded and self.instance_id is not None:
            self._loaded = False
            with contextlib.suppress(ClientError):  # the daemon is gone or the instance flipped
                await self.client.clear_plan(self.instance_id)
