"""`tetrictl --version` and help text as a user reads it: plain text, nothing eaten as markup."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = tetrictl("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tetrictl {version('tetri')}"


def test_help_keeps_bracketed_text():
    status = tetrictl("status", "--help")
    assert status.returncode == 0 and "[ctl] table" in " ".join(status.stdout.split())
    up = tetrictl("up", "--help")
    assert up.returncode == 0 and "([daemon], [worker])" in up.stdout
    top = tetrictl("--help")
    assert top.returncode == 0 and "--version" in top.stdout and "plan" in top.stdout


def test_every_file_output_is_spelled_o_output():
    """One spelling for "write it to this file" across the CLI: `-o/--output` (kubectl's and curl's)."""
    import click
    import typer

    from tetrictl.app import app

    def walk(cmd: click.Command, path: str) -> list[tuple[str, click.Parameter]]:
        found = [(path, p) for p in cmd.params]
        for name, sub in getattr(cmd, "commands", {}).items():
            found += walk(sub, f"{path} {name}")
        return found

    outputs = []
    for where, p in walk(typer.main.get_command(app), "tetrictl"):
        opts = {*p.opts, *p.secondary_opts}
        assert "--out" not in opts, where
        if "--output" in opts or "-o" in opts:
            assert sorted(opts) == ["--output", "-o"], (where, opts)
            outputs.append(where)
    assert {"tetrictl bench", "tetrictl profile", "tetrictl requests export", "tetrictl plan solve"} <= set(outputs)


def test_no_help_shows_raw_markup():
    """Help is plain text (rich_markup_mode None): no Markdown code spans or emphasis leak into it."""
    import re

    import click
    import typer
    from typer.testing import CliRunner

    from tetrictl.app import app

    def walk(cmd: click.Command, path: list[str]) -> list[list[str]]:
        found = [path]
        for name, sub in getattr(cmd, "commands", {}).items():
            found += walk(sub, [*path, name])
        return found

    runner = CliRunner()
    for path in walk(typer.main.get_command(app), []):
        text = runner.invoke(app, [*path, "--help"], terminal_width=200).output
        assert not re.search(r"`|\*\*", text), (path, re.findall(r".{0,30}(?:`|\*\*).{0,30}", text)[:3])


def test_every_profile_option_states_the_one_default():
    """One default cost-model profile for every command that takes --profile, named in each one's help;
    `worker start` leaves it to the worker's settings, whose default is the same profile."""
    import click
    import typer
    from typer.testing import CliRunner

    from tetri.config import WorkerSettings
    from tetri.costmodel import DEFAULT_PROFILE, list_profiles
    from tetrictl.app import app

    def walk(cmd: click.Command, path: list[str]) -> list[tuple[list[str], click.Parameter]]:
        found = [(path, p) for p in cmd.params if "--profile" in p.opts]
        for name, sub in getattr(cmd, "commands", {}).items():
            found += walk(sub, [*path, name])
        return found

    assert DEFAULT_PROFILE in list_profiles()
    assert WorkerSettings.model_fields["profile"].default == DEFAULT_PROFILE
    options = walk(typer.main.get_command(app), [])
    assert {" ".join(path) for path, _ in options} == {"up", "bench", "advise", "worker start"}
    runner = CliRunner()
    for path, p in options:
        assert p.default in (DEFAULT_PROFILE, None), (path, p.default)
        shown = " ".join(runner.invoke(app, [*path, "--help"], terminal_width=200).output.split())
        assert f"(tetri/profiles.toml; default {DEFAULT_PROFILE})" in shown, path
        # no help names another hardware profile as a default (`tiny` is also a word)
        others = [name for name in list_profiles() if name != DEFAULT_PROFILE and "-" in name and name in shown]
        assert not others, (path, others)
