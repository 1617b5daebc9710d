"""How tetrictl prints: one JSON document on stdout under --json, rich tables otherwise, and one-line
errors on stderr. Progress bars go to stderr and are silent under --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, cast

import typer

from tetri.planner.errors import WorkloadError

from . import exitcodes

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """A rich Console made on first use, so that a command that prints only JSON never loads rich."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._console: Console | None = None

    def real(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._kwargs)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


def real(console: Console) -> Console:
    """The Console behind `out` or `err`, for the rich objects that take one (`Live(console=…)`)."""
    return console.real() if isinstance(console, _LazyConsole) else console


out = cast("Console", _LazyConsole(width=None if sys.stdout.isatty() else 150))
err = cast("Console", _LazyConsole(stderr=True))


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def fail(message: str, code: int = exitcodes.USAGE) -> NoReturn:
    """One line on stderr (`error:` in red on a terminal), then exit `code`."""
    typer.secho("error:", fg="red", bold=True, err=True, nl=False)
    typer.echo(f" {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn bad input into one line on stderr and exit 2 — never a traceback."""
    try:
        yield
    except WorkloadError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot read or write {e.filename or 'file'}: {e.strerror or e}")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    out.print(t)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "—" if v is None else str(v)


@contextmanager
def progress(label: str, quiet: bool) -> Iterator[Callable[[int, int], None]]:
    """A progress callback (done, total) drawing a bar on stderr; a no-op when ``quiet``."""
    if quiet or not err.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=real(err),  # rich enters the console as a context manager: the proxy would not do
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
