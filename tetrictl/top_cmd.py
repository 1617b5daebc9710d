"""`tetrictl top`: the Textual dashboard (tetrictl/tui/)."""

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from .client import ClientError, TetriClient
from .console import CtlConfigOpt, TokenOpt, UrlOpt, target
from .output import fail


def top(
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between refreshes (≤ 0.5 keeps ≥ 2 Hz).")] = 0.5,
    plan: Annotated[Path | None, typer.Option("--plan", help="Plan file to offer in the replay view (r).")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: CtlConfigOpt = None,
) -> None:
    """The live dashboard: instances (role, state, queue, KV, tokens/s, load), cluster TTFT/JCT, requests and
    their timelines; flip an instance (f), change policies (p), replay a plan (r), help (?). It starts even
    when the daemon is down and reconnects when it comes back."""
    if refresh <= 0:
        fail("--refresh must be positive")
    tgt = target(url, token, config)
    from .tui.app import TopApp  # Textual loads only for this command

    async def go() -> None:
        async with TetriClient(tgt, timeout=5.0) as c:
            await TopApp(c, refresh_s=refresh, plan_path=str(plan) if plan else None).run_async()

    try:
        asyncio.run(go())
    except ClientError as e:
        fail(e.message, e.code)
