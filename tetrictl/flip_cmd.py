"""`tetrictl flip`, `tetrictl flips [ls]`, `tetrictl flip-policy show|set`: instance flips over the admin API."""

import asyncio
import time
from typing import Annotated, Any

import typer

from tetri.scheduling.flip import FLIP_POLICIES, ROLES

from .client import ClientError, TetriClient
from .console import Daemon, daemon_command
from .output import fail, out, table

flip_policy_app = typer.Typer(help="The transition watcher's flip policy.", no_args_is_help=True, rich_markup_mode=None)

FLIP_FIELDS = ("flip_policy", "flip_low", "flip_high", "flip_window_s")
FLIP_COLUMNS = ("id", "instance", "from", "to", "reason", "by", "started", "drained after", "done after", "outcome")


def _after(row: dict[str, Any], key: str) -> str:
    return "—" if row.get(key) is None else f"{row[key] - row['started_ts']:.2f}s"


def flip_row(f: dict[str, Any]) -> list[Any]:
    return [
        f["id"],
        f["instance_id"],
        f["from_role"],
        f["to_role"],
        f["reason"],
        f["requested_by"],
        time.strftime("%H:%M:%S", time.localtime(f["started_ts"])),
        _after(f, "drained_ts"),
        _after(f, "done_ts"),
        f.get("outcome") or "in progress",
    ]


async def wait_flip(c: TetriClient, flip_id: int, timeout: float) -> dict[str, Any]:
    """Poll the flips table until flip ``flip_id`` has ended; its row."""
    deadline = time.monotonic() + timeout
    while True:
        row = next((f for f in await c.flips() if f["id"] == flip_id), None)
        if row is not None and row.get("done_ts") is not None:
            return row
        if time.monotonic() > deadline:
            raise ClientError(f"flip {flip_id} has not finished after {timeout:g}s (it goes on; see `tetrictl flips`)")
        await asyncio.sleep(0.2)


@daemon_command
def flip(
    daemon: Daemon,
    instance_id: Annotated[str, typer.Argument(help="The instance to flip.")],
    to: Annotated[
        str | None,
        typer.Option("--to", help="colocated, prefill or decode (default: prefill ⇄ decode)."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until it has drained and changed role.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up waiting after this many seconds.")] = 600.0,
    reason: Annotated[str, typer.Option(help="Recorded in the flips table.")] = "manual",
) -> None:
    """Flip an instance to another role: it stops taking work, drains, changes role and announces it.
    Exit 1 when the daemon refuses (already flipping, nothing else could serve while it drains)."""
    if to is not None and to not in ROLES:
        fail(f"--to must be colocated, prefill or decode, not {to!r}")
    if timeout <= 0:
        fail("--timeout must be positive")

    async def body(c: TetriClient) -> dict[str, Any]:
        started = await c.flip(instance_id, to, reason)
        if not wait:
            return started
        row = await wait_flip(c, started["id"], timeout)
        if row.get("outcome") != "done":
            raise ClientError(f"flip {row['id']} of {instance_id} ended {row.get('outcome')}")
        return row

    def render(d: dict[str, Any]) -> None:
        if wait:
            out.print(f"{d['instance_id']} is now a {d['to_role']} instance (flip {d['id']}, {_after(d, 'done_ts')})")
        else:
            out.print(f"flipping {d['instance_id']}: {d['from_role']} → {d['to_role']} (flip {d['id']}, draining)")

    daemon.call(body, render)


flips_app = typer.Typer(
    help="The flips table: every flip, who asked, when it drained and finished (tetrictl flips ls; bare "
    "tetrictl flips lists too).",
    rich_markup_mode=None,
)


@flips_app.callback(invoke_without_command=True)
@daemon_command
def flips_root(
    daemon: Daemon,
    ctx: typer.Context,
) -> None:
    """The flips table (as flips ls)."""
    if ctx.invoked_subcommand is None:
        show_flips(daemon)


@flips_app.command("ls")
@daemon_command
def flips(daemon: Daemon) -> None:
    """The flips table: every flip, who asked, when it drained and finished."""
    show_flips(daemon)


def show_flips(daemon: Daemon) -> None:
    async def body(c: TetriClient) -> list[dict[str, Any]]:
        return await c.flips()

    daemon.call(
        body,
        lambda rows: table("flips", FLIP_COLUMNS, [flip_row(f) for f in rows]),
        lambda rows: {"flips": rows},
    )


def _flip_policy(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: doc["policies"][k] for k in FLIP_FIELDS} | {"version": doc["version"]}


@flip_policy_app.command("show")
@daemon_command
def flip_policy_show(daemon: Daemon) -> None:
    """The flip policy: idle flips an instance whose load stays below --low for --window seconds while
    the other role's average load is above --high; advise replays the last --window seconds of requests
    on the simulator at every P:D split and flips one instance at a time toward the best (the daemon needs
    its cost profile: tetrictl up passes it); off never flips by itself."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return _flip_policy(await c.policies())

    daemon.call(body, lambda d: table("flip policy", ("field", "value"), list(d.items())))


@flip_policy_app.command("set")
@daemon_command
def flip_policy_set(
    daemon: Daemon,
    policy: Annotated[str | None, typer.Option("--policy", help=f"One of {', '.join(FLIP_POLICIES)}.")] = None,
    low: Annotated[float | None, typer.Option("--low", help="Load below which an instance is idle (0–1).")] = None,
    high: Annotated[
        float | None, typer.Option("--high", help="Average load of the other role that asks (0–1).")
    ] = None,
    window: Annotated[
        float | None,
        typer.Option(
            "--window", help="idle: seconds the instance must stay idle; advise: seconds of requests replayed."
        ),
    ] = None,
) -> None:
    """Change the flip policy at runtime (validated by the daemon, audited). --policy advise flips toward
    the P:D split that serves the last window's requests best (docs/cluster.md)."""
    changes = {k: v for k, v in zip(FLIP_FIELDS, (policy, low, high, window), strict=True) if v is not None}
    if not changes:
        fail("nothing to set: give --policy, --low, --high or --window")

    async def body(c: TetriClient) -> dict[str, Any]:
        doc = await c.set_policies(changes)
        return _flip_policy(doc) | {"changed": doc["changed"]}

    def render(d: dict[str, Any]) -> None:
        table("flip policy", ("field", "value"), [(k, v) for k, v in d.items() if k != "changed"])
        out.print(f"changed: {', '.join(d['changed']) or 'nothing'}")

    daemon.call(body, render)
