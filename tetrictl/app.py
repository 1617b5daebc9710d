"""The `tetrictl` command tree: one Typer app, one module per command group (the console script is
`tetrictl.cli:main`)."""

if __name__ == "__main__":  # `python -m tetrictl.app` starts as light as the `tetrictl` script does
    from tetrictl.startup import mark_absent

    mark_absent()

import os
from pathlib import Path
from typing import Annotated

import typer

from . import (
    advise_cmd,
    bench_cmd,
    cluster_cmd,
    config_cmd,
    flip_cmd,
    plan_cmd,
    policy_cmd,
    profile_cmd,
    replay_cmd,
    status_cmd,
    top_cmd,
)

app = typer.Typer(
    name="tetrictl",
    help=(
        "Operate Tetri: run the cluster (up, daemon, worker), inspect and steer it (status, "
        "instances, requests, flip, policy, top), replay plans (plan replay), compare "
        "schedulers (bench), choose a setup for a workload (advise), calibrate the simulator on vLLM "
        "(profile) and plan backlogs offline (plan). Exit codes: 0 ok, 1 the daemon refused or failed, "
        "2 usage or bad input, 3 the daemon cannot be reached."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: `[ctl]` is text, not Rich markup (every sub-app says so too)
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"tetrictl {version('tetri')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("tetrictl (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            "--ca-file",
            help="An https daemon's CA bundle (PEM) for every command (env TETRI_CA_FILE, or ca_file in the config "
            "file's [ctl] table); given before the command: tetrictl --ca-file ca.pem status.",
        ),
    ] = None,
) -> None:
    """The root: only its options (the app's help is the Typer's)."""
    if ca_file is not None:  # every command's client reads it (tetrictl.client.resolve_target)
        os.environ["TETRI_CA_FILE"] = str(ca_file)


app.command("status")(status_cmd.status)
app.command("models")(status_cmd.models)
app.add_typer(status_cmd.instances_app, name="instances")
app.add_typer(status_cmd.requests_app, name="requests")
app.command("flip")(flip_cmd.flip)
app.add_typer(flip_cmd.flips_app, name="flips")
app.add_typer(flip_cmd.flip_policy_app, name="flip-policy")
app.add_typer(policy_cmd.app, name="policy")
app.command("top")(top_cmd.top)
plan_cmd.app.command("replay")(replay_cmd.replay)
app.add_typer(plan_cmd.app, name="plan")
app.add_typer(cluster_cmd.daemon_app, name="daemon")
app.add_typer(cluster_cmd.worker_app, name="worker")
app.add_typer(cluster_cmd.front_app, name="front")
app.command("up")(cluster_cmd.up)
app.command("down")(cluster_cmd.down)
app.command("bench")(bench_cmd.bench)
app.command("profile")(profile_cmd.profile)
app.command("advise")(advise_cmd.advise_cmd)
app.add_typer(config_cmd.app, name="config")


def main() -> None:
    app()


if __name__ == "__main__":  # as `spawn` runs it (tests, benches): `tetrictl up` dies with its parent
    from tetri.children import die_with_parent

    die_with_parent()
    main()
