"""The live runner for `tetrictl bench --mode live`: the same experiments, run on real processes.

For each run it starts a daemon and sim workers on loopback (as `tetrictl up` does) in the run's
layout (TetriInfer: prefill + decode instances; a baseline: colocated instances; the run's policies —
TetriInfer's, or the baseline's colocated schedule — set through the admin API), replays the workload
at its arrival times through the OpenAI endpoint (model time runs `time_scale` × faster than the wall,
for the daemon's clock as for the workers'), and reads back per-request records from the status table,
whose times are already model time (one clock per cluster, docs/cluster.md). It produces the
simulator's `RunResult`, so every table works unchanged. What the status table does not know is left
out: busy time is taken as each instance's span, and chunk padding and recomputed tokens are reported
as 0.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tetri.des.cluster import ClusterConfig
from tetri.des.experiments import Runner
from tetri.des.records import InstanceRecord, RejectedRecord, RequestRecord, RunResult
from tetri.des.workloads import Request, replay_tokens

from .client import Refused, Target, TetriClient
from .procs import start_local_cluster


def _roles(config: ClusterConfig) -> list[str]:
    if config.mode == "vanilla":
        return ["colocated"] * config.instances
    p, c = config.prefill_instances, config.colocated_instances
    return ["prefill"] * p + ["decode"] * (config.instances - p - c) + ["colocated"] * c


async def _replay(
    c: TetriClient, requests: Sequence[Request], scale: float, keep_ids: bool = False
) -> tuple[dict[str, str], dict[str, float]]:
    """Send every request at its (scaled) arrival time (with `keep_ids`, under its own id:
    `tetri.request_id`); returns workload id → daemon request id, and for those answered 429 (`ttft_miss`
    reject) workload id → model seconds from the start to the answer."""
    ids: dict[str, str] = {}
    rejected: dict[str, float] = {}
    t0 = time.monotonic()

    async def one(r: Request) -> None:
        await asyncio.sleep(max(0.0, r.arrival / scale - (time.monotonic() - t0)))
        body = {
            "model": "tetri-sim",
            "prompt": replay_tokens(r),  # as shared with others as its hash ids say, else its own
            "max_tokens": r.output_len,
        }
        if keep_ids:
            body["tetri"] = {"request_id": r.request_id}
        try:
            ids[r.request_id] = (await c.complete(body))["id"]
        except Refused as e:
            if e.status != 429:
                raise
            rejected[r.request_id] = (time.monotonic() - t0) * scale

    await asyncio.gather(*(one(r) for r in requests))
    return ids, rejected


async def _run(
    url: str,
    config: ClusterConfig | None,
    requests: Sequence[Request],
    scale: float,
    token: str | None = None,
    keep_ids: bool = False,
) -> tuple[dict[str, str], dict[str, dict], float, int, dict[str, float]]:
    async with TetriClient(Target(url, token), timeout=30) as c:
        if config is not None:  # TetriInfer's policies, or the baseline's colocated schedule
            await c.set_policies(config.policy.to_dict())
        deadline = time.monotonic() + 10  # every worker runs the policies before the first request
        while {i["policy_version"] for i in await c.instances()} != {(await c.policies())["version"]}:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not take the policies")
            await asyncio.sleep(0.05)
        t_start = float((await c.cluster())["now"])  # the cluster clock: model time
        ids, rejected = await _replay(c, requests, scale, keep_ids)
        await asyncio.sleep(0.3)  # one flush of the batched status-table writes
        rows = {r["id"]: r for r in await c.all_requests()}
        preempt = sum(i["preemptions"] for i in await c.instances())
    return ids, rows, t_start, preempt, rejected


def live_runner(time_scale: float = 1.0) -> Runner:
    """A bench runner that runs each experiment on a live sim cluster."""

    def run(requests: Sequence[Request], config: ClusterConfig) -> RunResult:
        profile = config.profile if isinstance(config.profile, str) else config.profile.name
        state = Path(tempfile.mkdtemp(prefix="tetri-live-bench-"))
        cluster = start_local_cluster(
            _roles(config),
            state_dir=state,
            profile=profile,
            time_scale=time_scale,
            mode="colocated"
            if config.mode == "vanilla"
            else "hybrid"
            if config.colocated_instances
            else "disaggregated",
        )
        try:
            ids, rows, t_start, preempt, rejected = asyncio.run(_run(cluster.url, config, requests, time_scale))
        finally:
            cluster.stop()
        return _result(requests, ids, rows, t_start, preempt, config.instances, rejected)

    return run


def replay_on(
    url: str,
    requests: Sequence[Request],
    time_scale: float,
    gpus: int,
    token: str | None = None,
    keep_ids: bool = False,
) -> RunResult:
    """Replay `requests` at their arrival times on a running cluster as it is (its policies, its split)
    and read back their records (`tetrictl advise`'s round trip: the advice applied, the same trace).
    With `keep_ids` each is sent under its own id, which must be free on the cluster: the oracle length
    predictor draws its mistakes per request id, so the run draws the ones the simulator draws for
    `requests`."""
    ids, rows, t_start, preempt, rejected = asyncio.run(_run(url, None, requests, time_scale, token, keep_ids))
    return _result(requests, ids, rows, t_start, preempt, gpus, rejected)


def _result(
    requests: Sequence[Request],
    ids: dict[str, str],
    rows: dict[str, dict],
    t0: float,
    preemptions: int,
    gpus: int,
    rejected: dict[str, float],
) -> RunResult:
    def m(ts: float | None) -> float | None:  # the cluster clock → model seconds since the replay began
        return None if ts is None else ts - t0

    recs: list[RequestRecord] = []
    spans: dict[str, list[float]] = {}
    roles: dict[str, list[str]] = {}
    for r in requests:
        if r.request_id in rejected:
            continue
        row = rows[ids[r.request_id]]
        if row["status"] != "finished":
            raise RuntimeError(f"request {r.request_id} ended {row['status']}: {row.get('error')}")
        first, finish = m(row["first_token_ts"]), m(row["finished_ts"])
        assert first is not None and finish is not None
        pred = None if row.get("predicted_lo") is None else (row["predicted_lo"], row["predicted_hi"])
        recs.append(
            RequestRecord(
                r.request_id,
                r.arrival,
                r.prompt_len,
                r.output_len,
                m(row["prefill_start_ts"]) or r.arrival,
                first,
                m(row["decode_start_ts"]),
                finish,
                row["prefill_instance"],
                row["decode_instance"],
                0,
                pred,
            )
        )
        if row["decode_instance"]:
            held = [
                (row["prefill_instance"], "prefill", row["prefill_start_ts"], row["first_token_ts"]),
                (row["decode_instance"], "decode", row["first_token_ts"], row["finished_ts"]),
            ]
        else:  # colocated: one instance from prefill to the last token
            held = [(row["prefill_instance"], "colocated", row["prefill_start_ts"], row["finished_ts"])]
        for inst, role, a, b in held:
            if inst and a is not None and b is not None:
                ma, mb = a - t0, b - t0
                span = spans.setdefault(inst, [ma, mb])
                span[0], span[1] = min(span[0], ma), max(span[1], mb)
                held_as = roles.setdefault(inst, [])
                if role not in held_as:  # ids name no role: the rows say what each instance served as
                    held_as.append(role)
    instances = [InstanceRecord(i, tuple(roles[i]), s[1] - s[0], s[0], s[1], 0, 0) for i, s in spans.items()]
    gone = [
        RejectedRecord(r.request_id, r.arrival, rejected[r.request_id], "")
        for r in requests
        if r.request_id in rejected
    ]
    ends = [r.finish for r in recs] + [x.rejected for x in gone]
    makespan = max(ends) - min(r.arrival for r in requests)
    return RunResult(recs, instances, [], preemptions, 0, 0, makespan, 0, gpus, rejected=gone)
