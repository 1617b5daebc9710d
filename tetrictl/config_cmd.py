"""`tetrictl config example`: a commented TOML file of every setting (`[daemon]`, `[worker]`, `[ctl]`),
generated from the settings models (`tetri.config.example_toml`), so it cannot drift from them."""

from pathlib import Path
from typing import Annotated

import typer

from .client import DEFAULT_URL
from .output import fail

app = typer.Typer(help="The configuration file.", no_args_is_help=True, rich_markup_mode=None)

CTL_FIELDS = [
    ("url", DEFAULT_URL, "tetrictl: the daemon's URL (flag --url, env TETRI_URL)."),
    ("token", None, "tetrictl: the admin bearer token (flag --token, env TETRI_TOKEN)."),
    ("ca_file", None, "tetrictl: an https daemon's CA bundle, PEM (flag tetrictl --ca-file, env TETRI_CA_FILE)."),
]


@app.command("example")
def example(
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write it here (default: stdout).")] = None,
) -> None:
    """Print a commented config file with every setting and its default (all commented out: as written it
    changes nothing). Use it with --config or TETRI_CONFIG."""
    from tetri.config import example_toml  # pydantic: only this command needs it

    text = example_toml({"ctl": CTL_FIELDS})
    if output is None:
        typer.echo(text, nl=False)
        return
    if output.exists():
        fail(f"{output} exists: not overwritten")
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror}")
    typer.echo(f"wrote {output}")
