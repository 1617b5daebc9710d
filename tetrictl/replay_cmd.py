"""`tetrictl plan replay PLAN.json`: replay an offline plan on the live cluster (tetrictl/replay.py)."""

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from . import exitcodes
from .client import ClientError, TetriClient
from .console import Daemon, daemon_command
from .output import err, fail, fmt, out, print_json, real, user_errors

if TYPE_CHECKING:
    from rich.table import Table

    from .replay import Progress


def progress_table(info: dict[str, Any], p: "Progress") -> "Table":
    from rich.table import Table

    t = Table(title=f"replay {info['tag']} on {info['instance_id']} ({info['order']} order)", title_justify="left")
    t.add_column("")
    t.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [
        (
            "requests sent / admitted / finished / failed",
            f"{p.sent} / {p.started} / {p.finished} / {p.failed} of {p.n}",
        ),
        ("plan M / instance KV capacity (tokens)", f"{info['plan_memory']:,} / {fmt(info['kv_capacity_tokens'])}"),
        ("planned TEL (steps)", fmt(p.planned_tel)),
        ("measured TEL (s)", fmt(p.measured_tel_s)),
        ("measured average latency (s)", fmt(p.measured_avg_latency_s)),
        ("completion order, planned vs measured (Kendall τ)", fmt(p.order_agreement)),
        ("planned first", " ".join(p.planned_order[:6])),
        ("measured first", " ".join(p.measured_order[:6])),
        ("elapsed (s)", fmt(p.elapsed_s)),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    return t


@daemon_command
def replay(
    daemon: Daemon,
    plan: Annotated[Path, typer.Argument(help="Plan file from tetrictl plan solve (tetri-plan/1).")],
    instance: Annotated[
        str | None, typer.Option("--instance", help="Decode instance to replay on (default: the least busy).")
    ] = None,
    speed: Annotated[
        float | None,
        typer.Option("--speed", help="Send arrivals at this many planner steps per second (default: all at once)."),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", help="Show live progress until the replay ends.")] = False,
    order: Annotated[
        str, typer.Option("--order", help="plan, or fcfs: the same backlog first come first served.")
    ] = "plan",
    workload: Annotated[
        Path | None, typer.Option("--workload", help="Workload file, for plans whose rows lack lengths.")
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replay a plan that does not fit the instance (context, KV memory) anyway."),
    ] = False,
) -> None:
    """Replay a plan's backlog on the live cluster: its requests (synthetic prompts of the planned lengths,
    exactly the planned output lengths) go to one decode instance switched to plan admission (M = its
    KV capacity); report planned vs measured completion order and TEL. A plan that does not fit the
    instance — a request past the model's context, or M above its KV capacity — is refused (exit 2) unless
    --force. Ctrl-C stops the replay and cancels what it sent; the instance's previous policy is restored
    however it ends."""
    from rich.live import Live

    from tetri.planner.planfile import parse_plan  # the planner and the replay's statistics: numpy, scipy
    from tetri.planner.workload import parse_jsonl

    from .replay import ORDERS, Progress, Replay, backlog

    if order not in ORDERS:
        fail(f"--order must be one of {', '.join(ORDERS)}, not {order!r}")
    if speed is not None and speed <= 0:
        fail("--speed must be positive (planner steps per second)")
    with user_errors():
        the_plan = parse_plan(plan.read_text(encoding="utf-8"), source=str(plan))
        w = None
        if workload is not None:
            w = parse_jsonl(workload.read_text(encoding="utf-8").splitlines(), source=str(workload))
        items = backlog(the_plan, w)
    tgt = daemon.target()

    async def go() -> "tuple[dict[str, Any], Progress]":
        async with TetriClient(tgt) as c:
            r = Replay(c, the_plan, items, instance, order, speed, force=force)
            info = await r.prepare()
            if follow and not daemon.json_out:
                with Live(progress_table(info, Progress(len(items))), console=real(out), refresh_per_second=4) as live:
                    final = await r.run(lambda p: live.update(progress_table(info, p)))
            else:
                final = await r.run()
            return info, final

    try:
        info, final = asyncio.run(go())
    except ClientError as e:
        fail(e.message, e.code)
    except KeyboardInterrupt:
        err.print("replay stopped: its requests still running are cancelled, the instance's policy restored")
        raise typer.Exit(exitcodes.REFUSED) from None
    doc = info | {"progress": final.to_dict()}
    if daemon.json_out:
        print_json(doc)
    elif not follow:
        out.print(progress_table(info, final))
    if final.failed:
        fail(
            f"{final.failed} of {final.n} requests failed (see `tetrictl requests ls --status failed`)",
            exitcodes.REFUSED,
        )
