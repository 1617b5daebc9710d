"""The `tetrictl` entry point: one Typer app, one module per command group."""

from __future__ import annotations

import typer

from . import plan_cmd

app = typer.Typer(
    name="tetrictl",
    help="Operate Tetri: plan backlogs offline (`plan`), and later run and inspect the live cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(plan_cmd.app, name="plan")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
