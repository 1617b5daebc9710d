"""SVG snapshots of the dashboard's screens at a fixed size (pytest-textual-snapshot), and paging through
10,000 requests on 64 instances. Data: the fixed documents of daemon_docs.py through the real client."""

from __future__ import annotations

import asyncio

from textual.pilot import Pilot
from textual.widgets import DataTable, Label

from tetrictl.client import Target, TetriClient
from tetrictl.tui.app import TopApp
from tetrictl.tui.screens import PolicyScreen

from .daemon_docs import N_INSTANCES, N_REQUESTS, transport

SIZE = (160, 48)


def make_app() -> TopApp:
    client = TetriClient(Target("http://daemon.test", None), transport=transport())
    return TopApp(client, refresh_s=3600)  # no timer refresh: `loaded` refreshes twice, so the same screen


async def loaded(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, TopApp)
    while not (app.connected and app.query_one("#requests", DataTable).row_count):
        await pilot.pause(0.05)
    app.refresh_data()  # a second refresh: a latency window (the histograms grew between the two)
    while len(app.history.snapshots) < 2:
        await pilot.pause(0.05)
    await pilot.pause(0.3)  # the highlighted request's timeline
    await pilot.wait_for_scheduled_animations()


def test_main_screen(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=loaded)


def test_help_screen(snap_compare):
    async def run_before(pilot: Pilot) -> None:
        await loaded(pilot)
        await pilot.press("question_mark")
        await pilot.pause(0.2)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_policy_screen(snap_compare):
    async def run_before(pilot: Pilot) -> None:
        await loaded(pilot)
        await pilot.press("p")
        await pilot.pause(0.2)
        assert isinstance(pilot.app.screen, PolicyScreen)  # open, every field shown (not a crash's last frame)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_replay_screen(snap_compare):
    async def run_before(pilot: Pilot) -> None:
        await loaded(pilot)
        await pilot.press("r")
        await pilot.pause(0.2)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_64_instances_and_10000_requests_page_and_filter():
    async def go() -> None:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            assert app.query_one("#instances", DataTable).row_count == N_INSTANCES
            requests = app.query_one("#requests", DataTable)
            assert requests.row_count == 100 and app.total_requests == N_REQUESTS
            await pilot.press("right_square_bracket", "right_square_bracket")
            await pilot.pause(0.3)
            label = str(app.query_one("#requests-label", Label).render())
            assert "page 3 of 100" in label
            assert str(requests.coordinate_to_cell_key((0, 0)).row_key.value) == f"req-{N_REQUESTS - 201:05d}"
            await pilot.press("s")  # status filter: running
            await pilot.pause(0.3)
            assert app.status_filter == "running" and app.page == 0 and app.total_requests == N_REQUESTS // 10
            assert "page 1 of 10" in str(app.query_one("#requests-label", Label).render())
            for _ in range(20):
                await pilot.press("right_square_bracket")
            await pilot.pause(0.3)
            assert app.page == 9  # the last page, not past it

    asyncio.run(go())


def test_cells_that_grow_widen_their_column():
    """KV from 0% to 100%, a load sparkline from one sample to twelve, a longer id: updated in place, every
    cell shows whole (a column keeps the width of its first contents otherwise: `100` for `100%`)."""

    async def go() -> None:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            table = app.query_one("#instances", DataTable)
            for _ in range(12):
                for inst in app.instances:
                    inst |= {"kv_usage": 1.0, "queued": 123_456, "state": "unhealthy"}
                app.history.add_instances(app.instances)
                app.show_instances()
            await pilot.pause(0.1)
            row = [str(c) for c in table.get_row("worker-00")]
            assert row[5] == "100%" and len(row[8]) == 12 and row[3] == "123,456"
            for col, cell in zip(table.columns.values(), row, strict=True):
                assert col.content_width >= len(cell), (col.label, cell)

    asyncio.run(go())


def test_latency_window_is_the_daemon_histograms_between_refreshes():
    """Between two refreshes each histogram grew by `per_call` of daemon_docs: 40 TTFTs, mostly in
    (0.1, 0.25] s; the label shows their mean and Prometheus-style quantiles."""

    async def go() -> None:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            ttft = app.history.ttft
            assert ttft is not None and ttft.count == 40 and abs(ttft.mean - 0.21) < 1e-9
            assert 0.1 < ttft.p50 <= 0.25 and 0.5 < ttft.p99 <= 1.0
            label = str(app.query_one("#ttft-label", Label).render())
            assert label == "TTFT ms (10 s, 40 req): mean 210 · p50 185 · p99 800"

    asyncio.run(go())
