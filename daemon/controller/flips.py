"""Instance flips (TetriInfer §3.5), carried out by the daemon: manual (admin API) or decided by the
transition watcher (`tetri.scheduling.flip`, a pure policy).

Protocol: validate (known instance, to another of the three roles, not already flipping, never leaving
its model unserved: `flip_refusal`, its instances counted as for a cordon, `Registry.serving`) → record the
flip → mark the instance draining in the registry (no new requests are routed to it, and the decode-load
broadcast tells prefill instances to stop sending to it) → the worker's Flip RPC drains queued and
running work and changes role → the registry takes the new role and the instance is active again,
announced in the next broadcast. Each flip is a row in `flips` (reason, who asked, started, drained,
done, outcome), stamped on the cluster clock.

The transition watcher sees the cluster clock too: its window (`flip_window_s`) is model time when the
cluster runs scaled, as in the discrete-event simulator, and it looks every model second (the
simulator's watch interval) but no more often than load reports arrive.

Under the `advise` policy, when the watcher asks for advice the daemon reads the window's requests from
the status table (`Store.window_requests`; the batched writer's pending fields over them, so a request
finished a moment ago counts as finished) and runs the `SplitAdvisor` (simulations of that window: seconds
of CPU for thousands of requests) in a child process of its own, started on the first advice, so the
replay never holds the event loop's interpreter.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tetri.config import DaemonSettings, advisor_inputs
from tetri.des.flipadvisor import SplitAdvisor
from tetri.des.trace import Seen
from tetri.scheduling.flip import InstanceView, SplitAdvice, TransitionWatcher, flip_refusal

from ..cluster import Instance
from ..db.store import Store
from ..db.writer import describe, store_unavailable
from ..worker_client import WorkerCallError, WorkerClient
from .registry import Registry

log = logging.getLogger(__name__)


def _leave_signals_to_the_daemon() -> None:
    """In the advisor's process: Ctrl-C reaches the whole process group; the daemon stops this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class FlipError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def advisor_for(settings: DaemonSettings) -> SplitAdvisor | None:
    """The `advise` flip policy's model for this daemon: its cost profile and SLOs (None without a profile)."""
    inputs = advisor_inputs(settings)
    return None if inputs is None else SplitAdvisor(*inputs)


class Flipper:
    def __init__(
        self,
        cluster: Registry,
        workers: WorkerClient,
        store: Store,
        advisor: SplitAdvisor | None = None,
        pending: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.clock = cluster.clock
        self.workers = workers
        self.store = store
        self.advisor = advisor  # the `advise` policy's model; None: the daemon has no cost profile
        self.pending = pending  # the batched writer's fields not yet in the status table, by request id
        self.tasks: set[asyncio.Task[None]] = set()
        self.watcher = TransitionWatcher()
        self._pool: ProcessPoolExecutor | None = None  # where the advisor's replays run

    def validate(self, instance_id: str, to_role: str | None) -> tuple[Instance, str]:
        inst = self.cluster.instances.get(instance_id)
        if inst is None:
            raise FlipError(404, f"no instance {instance_id!r}")
        if to_role is None and inst.role == "colocated":
            raise FlipError(400, f"to: required for colocated instance {inst.id} (prefill or decode)")
        to = to_role or ("decode" if inst.role == "prefill" else "prefill")
        state = "flipping" if inst.flip_pending else inst.state
        active, draining = self.cluster.serving(inst.model)  # what a cordon counts too (`Registry.cordon_refusal`)
        if inst.cordoned and state == "active":  # counted as the rule counts it, "this one included"
            active[inst.role] += 1  # (cordoned, it serves nothing new: flipping it leaves the model as it is)
        refusal = flip_refusal(inst.id, inst.role, state, to, active, draining)
        if refusal is not None:
            raise FlipError(400 if refusal.param == "to" else 409, refusal.reason)
        return inst, to

    async def start(self, instance_id: str, to_role: str | None, reason: str, requested_by: str) -> dict[str, Any]:
        inst, to = self.validate(instance_id, to_role)
        self.cluster.begin_flip(inst)
        started = self.clock.now()
        try:
            flip_id = await asyncio.to_thread(
                self.store.record_flip, inst.id, inst.role, to, reason, requested_by, started
            )
        except Exception as e:  # not recorded, not flipped: the instance serves on in its role
            self.cluster.end_flip(inst, None)
            if not store_unavailable(e):
                raise
            raise FlipError(503, f"not flipped: the status table is unavailable ({describe(e)})") from None
        task = asyncio.create_task(self._run(flip_id, inst, to))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return {
            "id": flip_id,
            "instance_id": inst.id,
            "from_role": inst.role,
            "to_role": to,
            "reason": reason,
            "requested_by": requested_by,
            "started_ts": started,
            "state": "draining",
        }

    async def _run(self, flip_id: int, inst: Instance, to: str) -> None:
        outcome, drained = "failed", None
        try:
            reply = await self.workers.flip(inst.address, to, timeout=600)
            if reply.ok:
                drained = self.clock.now()
                outcome = "done"
            else:
                log.warning("flip of %s refused by the worker: %s", inst.id, reply.reason)
                outcome = f"refused: {reply.reason}"[:32]
        except WorkerCallError as e:
            log.warning("flip of %s failed: %s", inst.id, e.code)
            outcome = f"failed: {e.code}"[:32]
        finally:
            self.cluster.end_flip(inst, to if outcome == "done" else None)
            fields: dict[str, Any] = {"done_ts": self.clock.now(), "outcome": outcome}
            if drained is not None:
                fields["drained_ts"] = drained
            try:
                await asyncio.to_thread(self.store.update_flip, flip_id, **fields)
            except Exception as e:
                log.error("flip %d of %s (%s) not recorded: %s", flip_id, inst.id, outcome, describe(e))

    def configure(self) -> None:
        p = self.cluster.policies
        if (p.flip_policy, p.flip_low, p.flip_high, p.flip_window_s) != (
            self.watcher.policy,
            self.watcher.low,
            self.watcher.high,
            self.watcher.window_s,
        ):
            self.watcher = TransitionWatcher(p.flip_policy, p.flip_low, p.flip_high, p.flip_window_s)

    async def watch(self, every_s: float) -> None:
        """The transition watcher: look at instance load every `every_s` wall seconds; flip what the
        policy says (its window on the cluster clock)."""
        while True:
            await asyncio.sleep(every_s)
            self.configure()
            now = self.clock.now()
            advice = await self.advice(now) if self.watcher.advice_due(now) else None
            views = [
                InstanceView(
                    i.id,
                    i.role,
                    "flipping" if i.flip_pending else i.shown_state,
                    i.kv_usage,
                    i.load.queued + i.inflight,
                )
                for i in self.cluster.instances.values()
                if i.role in ("prefill", "decode")
            ]
            for d in self.watcher.observe(now, views, advice):
                try:
                    await self.start(d.instance_id, d.to_role, d.reason, "transition-watcher")
                except FlipError as e:
                    log.info("watcher's flip of %s not started: %s", d.instance_id, e)

    async def advice(self, now: float) -> SplitAdvice | None:
        """The split the advisor wants for the last window (None without an advisor or evidence)."""
        if self.advisor is None:
            return None
        try:
            rows = await asyncio.to_thread(self.store.window_requests, now - self.watcher.window_s, now)
        except Exception as e:  # the status table is unavailable (the writer says so): no advice this window
            if not store_unavailable(e):
                raise
            log.debug("flip advisor: no advice this window: %s", describe(e))
            return None
        seen = []
        for row in rows:
            r = row | ((self.pending(row["id"]) or {}) if self.pending is not None else {})
            done, hi = r["status"] == "finished", r["predicted_hi"]
            seen.append(
                Seen(r["id"], r["arrival_ts"], r["prompt_tokens"], r["max_tokens"], r["output_tokens"], done, hi)
            )
        active = [i.role for i in self.cluster.instances.values() if i.schedulable]
        p, d = active.count("prefill"), active.count("decode")
        if self._pool is None:  # spawn, not fork: the daemon runs gRPC threads
            spawn = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=spawn, initializer=_leave_signals_to_the_daemon)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self.advisor.advise, seen, self.cluster.policies, p, d)
        except Exception as e:  # the replay failed (or its process died): no advice this window, say why
            log.warning("flip advisor: no advice this window: %s: %s", type(e).__name__, e)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            return None

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
