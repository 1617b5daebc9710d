"""The dashboard driven with Textual's Pilot against a real daemon and sim workers: a flip from the
dashboard reaches the daemon and the table shows the new role; a policy change takes effect; the replay
view advances; a daemon that goes away and comes back is reported and reconnected to."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input, ProgressBar, Select

from tests.cluster.harness import LiveCluster, start_cluster
from tetrictl.client import Target, TetriClient
from tetrictl.procs import spawn, stop_all, wait_ready
from tetrictl.tui.app import TopApp
from tetrictl.tui.screens import ConfirmScreen, PolicyScreen

pytestmark = pytest.mark.slow
SIZE = (160, 48)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = start_cluster(tmp_path_factory.mktemp("top"), ["prefill", "decode", "decode"])
    yield c
    c.stop()


async def until(pred: Callable[[], bool | Awaitable[bool]], pilot: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.1)  # type: ignore[attr-defined]


def highlight(table: DataTable, key: str) -> None:
    table.focus()
    table.move_cursor(row=[str(k.value) for k in table.rows].index(key))


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=180))  # a hang fails the test instead of stalling CI


def test_flip_from_the_dashboard(cluster: LiveCluster):
    async def go() -> None:
        async with TetriClient(Target(cluster.url, None)) as c:
            app = TopApp(c, refresh_s=0.25)
            async with app.run_test(size=SIZE) as pilot:
                table = app.query_one("#instances", DataTable)
                await until(lambda: table.row_count == 3, pilot)
                target = sorted(i["id"] for i in app.instances if i["role"] == "decode")[0]
                highlight(table, target)
                await pilot.press("f")
                assert isinstance(app.screen, ConfirmScreen) and target in app.screen.question
                await pilot.press("y")

                async def flipped() -> bool:
                    return (await c.instance(target))["role"] == "prefill"

                await until(flipped, pilot)
                await until(lambda: table.get_row(target)[1] == "prefill", pilot)
                assert any(f["requested_by"] == "local" and f["reason"] == "tetrictl top" for f in await c.flips())
                # the last decode instance cannot flip: the daemon refuses, the dashboard says so and goes on
                last = next(i["id"] for i in app.instances if i["role"] == "decode")
                highlight(table, last)
                await pilot.press("f", "y")
                await pilot.pause(0.5)
                assert (await c.instance(last))["role"] == "decode"
                assert app.is_running
                await c.flip(target, "decode")  # restore two decode instances for the other tests

    run(go())


def test_policy_change_from_the_dashboard(cluster: LiveCluster):
    async def go() -> None:
        async with TetriClient(Target(cluster.url, None)) as c:
            app = TopApp(c, refresh_s=0.25)
            async with app.run_test(size=SIZE) as pilot:
                await until(lambda: bool(app.policies), pilot)
                version = (await c.policies())["version"]
                await pilot.press("p")
                assert isinstance(app.screen, PolicyScreen)
                app.screen.query_one("#prefill_policy", Select).value = "ljf"
                app.screen.query_one("#decode_admission", Select).value = "reserve-dynamic"
                app.screen.query_one("#chunk_size", Input).value = "128"
                await pilot.press("ctrl+s")

                async def applied() -> bool:
                    return (await c.policies())["version"] == version + 1

                await until(applied, pilot)
                p = (await c.policies())["policies"]
                assert (p["prefill_policy"], p["decode_admission"], p["chunk_size"]) == ("ljf", "reserve-dynamic", 128)
                await until(lambda: app.policies.get("chunk_size") == 128, pilot)
                # the workers run it: they acknowledge the new version
                await until(
                    lambda: all(i["policy_version"] == version + 1 for i in app.instances),
                    pilot,
                )
                # a bad value is refused by the daemon and changes nothing
                await pilot.press("p")
                app.screen.query_one("#chunk_size", Input).value = "0"
                await pilot.press("ctrl+s")
                await pilot.pause(0.5)
                assert (await c.policies())["version"] == version + 1 and app.is_running

    run(go())


def test_output_counts_while_running_and_latency_from_the_daemon(tmp_path: Path):
    """A running request's output cell counts up as it streams (it showed 0 until the end); the TTFT and
    JCT labels are the daemon's histograms over the window: exactly the three requests sent."""
    cluster = start_cluster(tmp_path, ["prefill", "decode"], time_scale=1.0)  # 600 tokens: about 3 s

    async def go() -> None:
        async with TetriClient(Target(cluster.url, None)) as c:
            app = TopApp(c, refresh_s=0.25)
            async with app.run_test(size=SIZE) as pilot:
                await until(lambda: len(app.history.snapshots) >= 2, pilot)  # the window starts before the sends
                body = {"model": "tetri-sim", "prompt": [2] * 20, "max_tokens": 600, "ignore_eos": True}
                sends = [asyncio.create_task(c.complete(body, timeout=120)) for _ in range(3)]
                table = app.query_one("#requests", DataTable)
                counts: dict[str, set[int]] = {}

                def counting() -> bool:
                    for key in table.rows:
                        row = [str(v) for v in table.get_row(key)]
                        if row[1] in ("prefill", "transfer", "decode"):  # running: its phase
                            counts.setdefault(str(key.value), set()).add(int(row[3].replace(",", "")))
                    return any(len(v) >= 3 for v in counts.values())

                await until(counting, pilot, timeout=60)
                assert all(0 <= n < 600 for v in counts.values() for n in v)
                await asyncio.gather(*sends)

                def windowed() -> bool:
                    t, j = app.history.ttft, app.history.jct
                    return t is not None and j is not None and t.count == j.count == 3

                await until(windowed, pilot)
                label = str(app.query_one("#jct-label").render())
                assert label.startswith("JCT ms (10 s, 3 req): mean "), label

    try:
        run(go())
    finally:
        cluster.stop()


def test_replay_view_advances(cluster: LiveCluster, tmp_path: Path):
    # ≈ 1,300-token requests on a 4,192-token decode instance: three at a time, seven waves of seconds each
    rows = [{"id": f"r{k}", "prompt_tokens": 30, "output_tokens": 1100 + 100 * (k % 5)} for k in range(20)]
    plan = {
        "format": "tetri-plan/1",
        "memory": 4192,
        "policy": "sorted-f",
        "batches": [[r["id"] for r in sorted(rows, key=lambda r: r["output_tokens"])]],
        "schedule": [dict(r, start=0, finish=r["output_tokens"]) for r in rows],
        "tel": sum(r["output_tokens"] for r in rows),
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))

    async def go() -> None:
        async with TetriClient(Target(cluster.url, None)) as c:
            app = TopApp(c, refresh_s=0.25, plan_path=str(path))
            async with app.run_test(size=SIZE) as pilot:
                await until(lambda: app.connected is True, pilot)
                await pilot.press("r")
                assert app.screen.query_one("#plan-path", Input).value == str(path)
                await pilot.click("#start")
                seen: list[int] = []

                def progressed() -> bool:
                    p = app.replay_progress
                    if p is not None:
                        seen.append(p.finished)
                    return p is not None and p.done and not app.replay_running

                await until(progressed, pilot, timeout=60)
                assert app.replay_progress is not None and app.replay_progress.finished == 20
                assert len(set(seen)) >= 3  # it advanced in steps, not all at once
                await pilot.pause(0.6)
                assert app.screen.query_one("#replay-progress", ProgressBar).progress == 20
                text = str(app.screen.query_one("#replay-status").render())
                assert "finished 20" in text and "Kendall" in text
                # a second replay, stopped halfway: the instance's policy is restored (a fresh request runs)
                await pilot.click("#start")
                await until(lambda: app.replay_running and app.replay.sent > 0, pilot)  # type: ignore[union-attr]
                await pilot.click("#stop")
                await until(lambda: not app.replay_running, pilot)
                inst = app.replay_info["instance_id"]
                body = {"model": "tetri-sim", "prompt": [1] * 5, "max_tokens": 3, "tetri": {"decode_instance": inst}}
                assert (await c.complete(body, timeout=30))["choices"][0]["finish_reason"] == "length"

    run(go())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_daemon_down_then_back(tmp_path: Path):
    port = free_port()

    async def go() -> None:
        async with TetriClient(Target(f"http://127.0.0.1:{port}", None), timeout=2) as c:
            app = TopApp(c, refresh_s=0.25)
            async with app.run_test(size=SIZE) as pilot:
                await until(lambda: app.connected is False and "cannot reach" in app.sub_title, pilot)
                daemon = spawn("daemon.main", ["--port", str(port), "--grpc-port", "0", "--state-dir", str(tmp_path)])
                try:
                    await asyncio.to_thread(wait_ready, daemon, "daemon")
                    await until(lambda: app.connected is True and "no model yet" in app.sub_title, pilot)
                finally:
                    stop_all([daemon])
                await until(lambda: app.connected is False, pilot)
                await pilot.press("p")  # the keys still work while the daemon is away
                assert app.is_running

    run(go())
