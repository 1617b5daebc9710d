"""The `tetrictl` entry point: one Typer app, one module per command group."""

from __future__ import annotations

import typer

from . import bench_cmd, cluster_cmd, plan_cmd

app = typer.Typer(
    name="tetrictl",
    help=(
        "Operate Tetri: run the cluster (`up`, `daemon`, `worker`), compare schedulers (`bench`) "
        "and plan backlogs offline (`plan`)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(plan_cmd.app, name="plan")
app.add_typer(cluster_cmd.daemon_app, name="daemon")
app.add_typer(cluster_cmd.worker_app, name="worker")
app.command("up")(cluster_cmd.up)
app.command("bench")(bench_cmd.bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
