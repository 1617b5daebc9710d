"""What every console command shares: the daemon options, and running one client call as a command.

A command body builds a coroutine over `TetriClient` and a renderer; `call()` runs it, prints one JSON
document under --json (else the renderer's rich output), and turns a `ClientError` into its one-line
message and exit code (docs/console.md): 0 ok, 1 refused or failed, 2 usage or bad input, 3 unreachable.
"""

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tetri.costmodel import DEFAULT_PROFILE
from tetri.planner.errors import WorkloadError

from . import exitcodes
from .client import ClientError, Target, TetriClient, resolve_target
from .output import fail, print_json

T = TypeVar("T")
R = TypeVar("R")

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", help="Daemon URL (env TETRI_URL; default http://127.0.0.1:8000).", show_default=False),
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", help="Admin bearer token (env TETRI_TOKEN).", show_default=False)
]
CtlConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML file with a [ctl] table: url, token (env TETRI_CONFIG).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def profile_help(lead: str = "Cost-model profile") -> str:
    """A --profile option's help: every command that takes one defaults to the same profile, and says which."""
    return f"{lead} (tetri/profiles.toml; default {DEFAULT_PROFILE})."


ProfileOpt = Annotated[str, typer.Option("--profile", help=profile_help(), show_default=False)]


@dataclass(frozen=True)
class Daemon:
    """The options every command that talks to the daemon shares (--url, --token, --config, --json; the CA
    file is tetrictl's own --ca-file), as one object: `daemon_command` gives it to the command."""

    url: str | None = None
    token: str | None = None
    config: Path | None = None
    json_out: bool = False

    def target(self) -> Target:
        return target(self.url, self.token, self.config)

    def call(
        self,
        body: Callable[[TetriClient], Awaitable[T]],
        render: Callable[[T], None],
        to_json: Callable[[T], Any] | None = None,
    ) -> T:
        """`call` against this daemon, printing as --json says."""
        return call(self.target(), body, render, self.json_out, to_json)


def option(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
    """A keyword option for `with_options`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def with_options(
    fn: Callable[..., Any],
    shared: tuple[inspect.Parameter, ...],
    run: Callable[[dict[str, Any], dict[str, Any]], R],
    given: str | None = None,
) -> Callable[..., R]:
    """A Typer command made of `fn`'s own options (less the parameter `given`, which `run` supplies) and
    `shared` ones, declared once for every command that shares them; `run(own values, shared values)` is
    its body."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for name, p in sig.parameters.items() if name != given]
    names = {p.name for p in shared}

    @functools.wraps(fn)
    def command(**kw: Any) -> R:
        return run({k: v for k, v in kw.items() if k not in names}, {k: v for k, v in kw.items() if k in names})

    command.__signature__ = sig.replace(parameters=[*own, *shared])  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in (*own, *shared)} | {"return": sig.return_annotation}
    del command.__wrapped__  # Typer reads the signature above, not fn's
    return command


_DAEMON_OPTIONS = (
    option("url", UrlOpt),
    option("token", TokenOpt),
    option("config", CtlConfigOpt),
    option("json_out", JsonOpt, False),
)


def daemon_command(fn: Callable[..., R]) -> Callable[..., R]:
    """A command that talks to the daemon: `fn(daemon: Daemon, …its own options)` becomes a Typer command
    with the shared options (--url, --token, --config, --json) after its own."""
    return with_options(fn, _DAEMON_OPTIONS, lambda own, shared: fn(daemon=Daemon(**shared), **own), given="daemon")


def target(url: str | None, token: str | None, config: Path | None) -> Target:
    try:
        return resolve_target(url, token, config)
    except ClientError as e:
        fail(e.message, e.code)


def call(
    tgt: Target,
    body: Callable[[TetriClient], Awaitable[T]],
    render: Callable[[T], None],
    json_out: bool,
    to_json: Callable[[T], Any] | None = None,
) -> T:
    """Run ``body`` against the daemon; print its result; exit with the documented code on failure."""

    async def go() -> T:
        async with TetriClient(tgt) as c:
            return await body(c)

    try:
        result = asyncio.run(go())
    except ClientError as e:
        fail(e.message, e.code)
    except WorkloadError as e:
        fail(str(e), exitcodes.USAGE)
    if json_out:
        print_json(to_json(result) if to_json else result)
    else:
        render(result)
    return result


def when(ts: float | None) -> str:
    """A timestamp for people: ISO 8601 in UTC, to the millisecond (the JSON keeps epoch seconds). On a
    scaled cluster it is the cluster clock's reading (docs/cluster.md)."""
    if ts is None:
        return "—"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "—"
    s = max(0.0, now - ts)
    return f"{s:.1f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"
