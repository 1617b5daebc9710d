"""`tetrictl status`, `instances ls|show|cordon|uncordon|drain`, `requests ls|show|cancel|export`: read the
cluster over the admin API (and cordon instances)."""

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .client import ClientError, TetriClient
from .console import Daemon, ago, daemon_command, when
from .output import err, fail, out, table

instances_app = typer.Typer(help="Prefill/decode/colocated instances.", no_args_is_help=True, rich_markup_mode=None)
requests_app = typer.Typer(help="Requests in the status table.", no_args_is_help=True, rich_markup_mode=None)

PHASES = ("queued", "prefill", "transfer", "decode", "done")
STATUSES = ("running", "finished", "failed", "cancelled", "rejected", "interrupted")
INSTANCE_COLUMNS = (
    "id", "role", "state", "queued", "running", "KV %", "cache hit", "tokens/s", "preempt", "report age"
)  # fmt: skip


def hit_text(i: dict[str, Any]) -> str:
    """The instance's prefix-cache hit ratio (prompt tokens found cached over those looked up, over its
    engine's life); — before it looked any up."""
    ratio = i.get("prefix_hit_ratio")
    return "—" if ratio is None else f"{100 * ratio:.0f}%"


def state_word(i: dict[str, Any]) -> str:
    """The state column: the instance's state, and cordoned when it is (as kubectl's Ready,SchedulingDisabled)."""
    return f"{i['state']},cordoned" if i.get("cordoned") else str(i["state"])


def instance_row(i: dict[str, Any]) -> list[Any]:
    return [
        i["id"],
        i["role"],
        state_word(i),
        i["queued"],
        i["running"],
        f"{100 * i['kv_usage']:.0f}%",
        hit_text(i),
        round(i["tokens_per_s"], 1),
        i["preemptions"],
        f"{i['last_report_age_s']:.1f}s",
    ]


@daemon_command
def models(daemon: Daemon) -> None:
    """The models the cluster serves: each one's context (the least its instances announce) and its
    instances by role (active of registered). Reads the admin API, so the admin token is enough."""

    async def body(c: TetriClient) -> dict[str, Any]:
        by_model: dict[str, dict[str, Any]] = {}
        for i in await c.instances():
            m = by_model.setdefault(i["model"], {"id": i["model"], "max_model_len": None, "instances": {}})
            if i["max_model_len"]:
                m["max_model_len"] = min(m["max_model_len"] or i["max_model_len"], i["max_model_len"])
            r = m["instances"].setdefault(i["role"], {"active": 0, "total": 0})
            r["total"] += 1
            r["active"] += i["state"] == "active"
        return {"models": [by_model[k] for k in sorted(by_model)]}

    def render(d: dict[str, Any]) -> None:
        rows = [
            (
                m["id"],
                m["max_model_len"] or "?",
                ", ".join(f"{r} {v['active']}/{v['total']}" for r, v in sorted(m["instances"].items())),
            )
            for m in d["models"]
        ]
        table("models", ("model", "context", "instances (active/registered)"), rows)

    daemon.call(body, render)


@daemon_command
def status(daemon: Daemon) -> None:
    """Cluster summary: model, mode, instances by role, requests by status, policies."""

    async def body(c: TetriClient) -> dict[str, Any]:
        doc: dict[str, Any] = await c.cluster()
        doc["instance_list"] = await c.instances()
        doc["policies"] = (await c.policies())["policies"]
        return doc

    def render(d: dict[str, Any]) -> None:
        roles = ", ".join(f"{r} {v['active']}/{v['total']} active" for r, v in sorted(d["instances"].items()))
        model = d["model"] or "no model yet"
        out.print(f"[bold]{model}[/] · {d['mode']} · up {d['uptime_s']:.0f}s · {roles or 'no instances'}")
        byst = ", ".join(f"{k} {v:,}" for k, v in sorted(d["requests_by_status"].items())) or "none yet"
        out.print(f"in flight {d['inflight']:,}  ·  requests: {byst}")
        p = d["policies"]
        out.print(
            f"policies: prefill {p['prefill_policy']} (batch {p['prefill_sched_batch']}, chunk {p['chunk_size']}), "
            f"predictor {p['predictor']}, dispatch {p['dispatch']}, decode {p['decode_admission']}, "
            f"flips {p['flip_policy']}, route {p.get('pd_route', 'role')}, routing {p.get('routing', 'least-load')}"
        )
        table("instances", INSTANCE_COLUMNS, [instance_row(i) for i in d["instance_list"]])

    daemon.call(body, render)


@instances_app.command("ls")
@daemon_command
def instances_ls(daemon: Daemon) -> None:
    """List instances with their load; a cordoned instance's state says so (active,cordoned)."""

    async def body(c: TetriClient) -> list[dict[str, Any]]:
        return await c.instances()

    daemon.call(
        body,
        lambda rows: table("instances", INSTANCE_COLUMNS, [instance_row(i) for i in rows]),
        lambda rows: {"instances": rows},
    )


@instances_app.command("show")
@daemon_command
def instances_show(
    daemon: Daemon,
    instance_id: Annotated[str, typer.Argument(help="Instance id (see instances ls).")],
) -> None:
    """One instance: load, KV, address, policy version."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.instance(instance_id)

    daemon.call(body, lambda d: table(d["id"], ("field", "value"), list(d.items())))


@instances_app.command("cordon")
@daemon_command
def instances_cordon(
    daemon: Daemon,
    instance_id: Annotated[str, typer.Argument(help="Instance id (see instances ls).")],
) -> None:
    """Mark an instance unschedulable: the daemon sends it no new work (no new prompts; a decode
    instance, no new hand-overs) while what runs there runs to completion. It stays registered and
    reporting. Held in the daemon's memory: a daemon restart forgets it. Exit 1 when the daemon refuses
    (the last instance that keeps its model served), 2 for an unknown instance."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.cordon(instance_id)

    def render(d: dict[str, Any]) -> None:
        out.print(f"instance {d['id']} {'cordoned' if d['changed'] else 'already cordoned'}")

    daemon.call(body, render)


@instances_app.command("uncordon")
@daemon_command
def instances_uncordon(
    daemon: Daemon,
    instance_id: Annotated[str, typer.Argument(help="Instance id (see instances ls).")],
) -> None:
    """Mark an instance schedulable again: the daemon routes new work to it. Exit 2 for an unknown
    instance."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.uncordon(instance_id)

    def render(d: dict[str, Any]) -> None:
        out.print(f"instance {d['id']} {'uncordoned' if d['changed'] else 'was not cordoned'}")

    daemon.call(body, render)


async def wait_drained(c: TetriClient, instance_id: str, timeout: float) -> dict[str, Any]:
    """Poll the instance until the daemon says it is drained (cordoned, nothing in flight there); it."""
    deadline = time.monotonic() + timeout
    while True:
        inst = await c.instance(instance_id)
        if not inst.get("cordoned"):
            raise ClientError(f"instance {instance_id} was uncordoned while it drained")
        if inst.get("drained"):
            return inst
        if time.monotonic() > deadline:
            raise ClientError(
                f"instance {instance_id} still has requests in flight after {timeout:g}s "
                f"(it stays cordoned; see tetrictl instances show {instance_id})"
            )
        await asyncio.sleep(0.2)


@instances_app.command("drain")
@daemon_command
def instances_drain(
    daemon: Daemon,
    instance_id: Annotated[str, typer.Argument(help="Instance id (see instances ls).")],
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds.")] = 300.0,
) -> None:
    """Cordon an instance, then wait until nothing is in flight there (its requests ran to completion).
    It does not stop the worker process (as kubectl drain does not delete the node): stop it yourself,
    and uncordon the instance when it is back. Exit 1 when the daemon refuses the cordon or requests are
    still in flight after --timeout seconds (it stays cordoned), 2 for an unknown instance."""
    if not timeout > 0:
        fail("--timeout must be positive")

    async def body(c: TetriClient) -> dict[str, Any]:
        started = time.monotonic()
        await c.cordon(instance_id)
        inst = await wait_drained(c, instance_id, timeout)
        return {"instance": inst, "drained": True, "waited_s": round(time.monotonic() - started, 3)}

    def render(d: dict[str, Any]) -> None:
        iid = d["instance"]["id"]
        out.print(f"instance {iid} drained in {d['waited_s']:.1f}s: cordoned, nothing in flight")
        out.print(f"its worker still runs; tetrictl instances uncordon {iid} puts it back in service")

    daemon.call(body, render)


REQUEST_COLUMNS = ("id", "phase", "status", "prompt", "output", "TTFT ms", "JCT ms", "prefill", "decode", "arrived")


@requests_app.command("ls")
@daemon_command
def requests_ls(
    daemon: Daemon,
    phase: Annotated[str | None, typer.Option(help=f"Only this phase: {', '.join(PHASES)}.")] = None,
    status_: Annotated[str | None, typer.Option("--status", help=f"Only this status: {', '.join(STATUSES)}.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many (1–1000), newest first.")] = 20,
    offset: Annotated[int, typer.Option(help="Skip this many (pagination).")] = 0,
    id_prefix: Annotated[
        str | None, typer.Option("--id-prefix", help="Only the requests whose id starts with this (≤ 64 characters).")
    ] = None,
) -> None:
    """List requests from the status table, newest first."""
    if phase is not None and phase not in PHASES:
        fail(f"--phase must be one of {', '.join(PHASES)}, not {phase!r}")
    if status_ is not None and status_ not in STATUSES:
        fail(f"--status must be one of {', '.join(STATUSES)}, not {status_!r}")
    if not 1 <= limit <= 1000:
        fail(f"--limit must be within 1–1000, not {limit}")
    if offset < 0:
        fail(f"--offset must be ≥ 0, not {offset}")
    if id_prefix is not None and not 1 <= len(id_prefix) <= 64:
        fail(f"--id-prefix must be 1–64 characters, not {len(id_prefix)}")

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.requests(phase, status_, limit, offset, id_prefix)

    def render(d: dict[str, Any]) -> None:
        now = d.get("now") or time.time()  # the daemon's cluster clock (model time on a scaled cluster)
        rows = [
            [
                r["id"],
                r["phase"],
                r["status"],
                r["prompt_tokens"],
                r["output_tokens"],
                r["ttft_ms"],
                r["jct_ms"],
                r["prefill_instance"],
                r["decode_instance"],
                ago(r["arrival_ts"], now),
            ]
            for r in d["requests"]
        ]
        total = d["total"]
        if rows:
            title = f"requests {offset + 1:,}–{offset + len(rows):,} of {total:,}"
        else:
            title = "requests: none" if not total else f"requests: none past the first {offset:,} of {total:,}"
        table(title, REQUEST_COLUMNS, rows)

    daemon.call(body, render)


@requests_app.command("show")
@daemon_command
def requests_show(
    daemon: Daemon,
    request_id: Annotated[str, typer.Argument(help="Request id.")],
) -> None:
    """One request: its row and its timeline (queued → prefill → first token → decode → done)."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.request(request_id)

    def render(d: dict[str, Any]) -> None:
        fields = [(k, when(v) if k.endswith("_ts") else v) for k, v in d.items() if k != "timeline" and v is not None]
        table(f"request {d['id']}", ("field", "value"), fields)
        t0 = d["timeline"][0]["ts"] if d["timeline"] else 0.0
        table(
            "timeline", ("phase", "at (ms after arrival)"), [(p["phase"], 1000 * (p["ts"] - t0)) for p in d["timeline"]]
        )

    daemon.call(body, render)


@requests_app.command("cancel")
@daemon_command
def requests_cancel(
    daemon: Daemon,
    request_id: Annotated[str | None, typer.Argument(help="Request id (must be in flight).")] = None,
    status_: Annotated[
        str | None,
        typer.Option("--status", help="running: cancel every in-flight request at once (with --id-prefix, those ids)."),
    ] = None,
    id_prefix: Annotated[
        str | None, typer.Option("--id-prefix", help="With --status running: ids starting with this (≤ 64 characters).")
    ] = None,
) -> None:
    """Cancel an in-flight request (exit 1 if it is no longer in flight), or with --status running every
    in-flight request at once (--id-prefix P: those whose id starts with P, as in requests ls)."""
    if request_id is not None and (status_ is not None or id_prefix is not None):
        fail("give a request id, or --status running [--id-prefix P] to cancel in bulk, not both")
    if request_id is None:
        if status_ is None:
            fail("give a request id, or --status running [--id-prefix P] to cancel every in-flight request")
        if status_ != "running":
            fail(f"--status: only running requests can be cancelled, not {status_!r}")
        if id_prefix is not None and not 1 <= len(id_prefix) <= 64:
            fail(f"--id-prefix must be 1–64 characters, not {len(id_prefix)}")

        async def many(c: TetriClient) -> dict[str, Any]:
            return await c.cancel_many(id_prefix or "")

        def said(d: dict[str, Any]) -> None:
            out.print(f"cancelled {d['count']:,} request{'' if d['count'] == 1 else 's'}")

        daemon.call(many, said)
        return

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.cancel(request_id)

    daemon.call(body, lambda d: out.print(f"cancelled {d['id']}"))


@requests_app.command("export")
@daemon_command
def requests_export(
    daemon: Daemon,
    out_file: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the trace here (default: standard output).")
    ] = None,
) -> None:
    """The finished requests as a workload trace, one JSON line each (arrival_s from the first arrival,
    prompt_tokens, output_tokens): what tetrictl advise --trace reads."""
    from tetri.des.trace import rows_to_trace  # the simulator's numpy: only this command needs it

    if out_file is not None and daemon.json_out:
        fail("--output writes the trace as JSON lines; --json prints it as one document: give one of them")
    if out_file is not None and out_file.parent and not out_file.parent.is_dir():
        fail(f"--output {out_file}: {out_file.parent} is not a directory")

    async def body(c: TetriClient) -> list[dict[str, Any]]:
        return rows_to_trace(await c.all_requests(status="finished"))

    def render(trace: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in trace)
        if out_file is None:
            sys.stdout.write(text)
            return
        try:
            out_file.write_text(text, encoding="utf-8")
        except OSError as e:
            fail(f"cannot write {out_file}: {e.strerror or e}")
        err.print(f"{len(trace)} requests written to {out_file}")

    daemon.call(body, render, lambda trace: {"requests": trace})
