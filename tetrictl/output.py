"""How tetrictl prints: one JSON document on stdout under --json, rich tables otherwise, and one-line
errors on stderr. Progress bars go to stderr and are silent under --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tetri.planner.errors import WorkloadError

from . import exitcodes

out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def fail(message: str, code: int = exitcodes.USAGE) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
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
    bar = Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
