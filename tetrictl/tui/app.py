"""`tetrictl top`: instances, cluster TTFT/JCT, requests and one request's timeline; flips, policy changes
and plan replays. Every daemon call goes through `TetriClient` in a worker, so input never waits on the
network; a failed refresh shows in the title bar and the next tick tries again."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, TypeVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

from tetri.planner.planfile import parse_plan
from tetri.planner.workload import WorkloadError

from ..client import ClientError, TetriClient, Unreachable
from ..replay import Progress, Replay, backlog
from .model import (
    INSTANCE_COLUMNS,
    REQUEST_COLUMNS,
    WINDOW_S,
    History,
    instance_cells,
    request_cells,
    timeline_text,
    window_text,
)
from .replay_screen import ReplayScreen
from .screens import ConfirmScreen, HelpScreen, PolicyScreen

W = TypeVar("W", bound=Widget)
PAGE = 100  # requests per page
STATUS_FILTERS: tuple[str | None, ...] = (None, "running", "finished", "failed", "cancelled", "rejected", "interrupted")


class TopApp(App[None]):
    TITLE = "tetrictl top"
    CSS_PATH = "top.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f", "flip", "flip"),
        Binding("p", "policies", "policies"),
        Binding("r", "replay", "replay"),
        Binding("s", "status_filter", "filter"),
        Binding("left_square_bracket", "page(-1)", "prev page", show=False),
        Binding("right_square_bracket", "page(1)", "next page", show=False),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit_top", "quit"),
    ]

    def __init__(self, client: TetriClient, refresh_s: float = 0.5, plan_path: str | None = None) -> None:
        super().__init__()
        self.client = client
        self.refresh_s = refresh_s
        self.plan_path = plan_path
        self.history = History(samples=max(1, round(WINDOW_S / refresh_s)))
        self.instances: list[dict[str, Any]] = []
        self.policies: dict[str, Any] = {}
        self.status_filter: str | None = None
        self.page = 0
        self.total_requests = 0
        self.selected_request: str | None = None
        self.connected: bool | None = None
        self._fetching = False
        self._main: Screen[Any] | None = None
        self.replay: Replay | None = None
        self.replay_info: dict[str, Any] = {}
        self.replay_progress: Progress | None = None
        self.replay_error = ""
        self.replay_running = False

    # --- layout ---------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="top"):
            with Vertical(id="left"):
                yield Label("instances", classes="section")
                yield DataTable(id="instances", cursor_type="row", zebra_stripes=True)
            with Vertical(id="right"):
                yield Label("cluster TTFT", id="ttft-label", classes="section")
                yield Sparkline([], id="ttft")
                yield Label("cluster JCT", id="jct-label", classes="section")
                yield Sparkline([], id="jct")
                yield Static("", id="summary")
        with Horizontal(id="bottom"):
            with Vertical(id="requests-pane"):
                yield Label("requests", id="requests-label", classes="section")
                yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
            yield Static("highlight a request to see its timeline", id="detail")
        yield Footer()

    def _w(self, selector: str, kind: type[W]) -> W:
        """A widget of the main screen, whichever screen is on top (the replay view, a dialog)."""
        if self._main is None:
            raise NoMatches(selector)
        return self._main.query_one(selector, kind)

    def on_mount(self) -> None:
        self._main = self.screen
        self._w("#instances", DataTable).add_columns(*INSTANCE_COLUMNS)
        self._w("#requests", DataTable).add_columns(*REQUEST_COLUMNS)
        self.sub_title = f"connecting to {self.client.target.url}"
        self.refresh_data()
        self.set_interval(self.refresh_s, self.refresh_data)

    # --- refresh ----------------------------------------------------------------------------------------
    def refresh_data(self) -> None:
        if not self._fetching:  # one refresh at a time; a slow daemon skips ticks rather than piling them up
            self._fetching = True
            self.fetch()

    @work(exclusive=False, group="fetch", exit_on_error=False)
    async def fetch(self) -> None:
        try:
            cluster = await self.client.cluster()
            instances = await self.client.instances()
            policies = await self.client.policies()
            page = await self.client.requests(status=self.status_filter, limit=PAGE, offset=self.page * PAGE)
        except ClientError as e:
            self.connected = False
            self.sub_title = f"⚠ {e.message} — retrying every {self.refresh_s:g}s"
            return
        finally:
            self._fetching = False
        self.connected = True
        self.sub_title = f"{self.client.target.url} · {cluster['model'] or 'no model yet'} · {cluster['mode']}"
        self.instances = instances
        self.policies = policies["policies"]
        self.history.add_instances(instances)
        self.history.add_latency(cluster["latency"])
        self.show_instances()
        self.show_cluster(cluster, policies)
        self.show_requests(page)
        if self.selected_request:
            self.load_detail(self.selected_request)  # its own worker: a request gone missing is no outage

    def show_instances(self) -> None:
        table = self._w("#instances", DataTable)
        keys = [i["id"] for i in self.instances]
        if [str(k.value) for k in table.rows] != keys:
            cursor = table.cursor_row
            table.clear()
            for inst in self.instances:
                table.add_row(*instance_cells(inst, self.history), key=inst["id"])
            table.move_cursor(row=min(cursor, max(0, len(keys) - 1)))
            return
        for inst in self.instances:  # same rows: update cells in place (keeps the cursor and scroll)
            for col, value in zip(table.columns, instance_cells(inst, self.history), strict=True):
                table.update_cell(inst["id"], col, value, update_width=True)  # 100%, a longer sparkline

    def show_cluster(self, cluster: dict[str, Any], policies: dict[str, Any]) -> None:
        self._w("#ttft", Sparkline).data = list(self.history.ttft_ms)
        self._w("#jct", Sparkline).data = list(self.history.jct_ms)
        self._w("#ttft-label", Label).update(window_text("TTFT", self.history.ttft))
        self._w("#jct-label", Label).update(window_text("JCT", self.history.jct))
        p = policies["policies"]
        byst = " · ".join(f"{k} {v:,}" for k, v in sorted(cluster["requests_by_status"].items())) or "no requests yet"
        roles = " · ".join(f"{r} {v['active']}/{v['total']}" for r, v in sorted(cluster["instances"].items()))
        self._w("#summary", Static).update(
            f"[b]instances[/b] {roles}\n[b]in flight[/b] {cluster['inflight']:,}\n[b]requests[/b] {byst}\n"
            f"[b]policies[/b] v{policies['version']}: prefill {p['prefill_policy']} "
            f"(batch {p['prefill_sched_batch']}, chunk {p['chunk_size']}), predictor {p['predictor']}, "
            f"dispatch {p['dispatch']}, decode {p['decode_admission']}, flips {p['flip_policy']}, "
            f"route {p.get('pd_route', 'role')}, routing {p.get('routing', 'least-load')}"
        )

    def show_requests(self, page: dict[str, Any]) -> None:
        self.total_requests = page["total"]
        table = self._w("#requests", DataTable)
        rows = page["requests"]
        keys = [r["id"] for r in rows]
        if [str(k.value) for k in table.rows] != keys:
            cursor = table.cursor_row
            table.clear()
            for r in rows:
                table.add_row(*request_cells(r), key=r["id"])
            if rows:
                table.move_cursor(row=min(cursor, len(rows) - 1))
        else:
            for r in rows:
                for col, value in zip(table.columns, request_cells(r), strict=True):
                    table.update_cell(r["id"], col, value, update_width=True)
        pages = max(1, -(-self.total_requests // PAGE))
        filt = self.status_filter or "all"
        self._w("#requests-label", Label).update(
            f"requests ({filt}) · page {self.page + 1} of {pages} · {self.total_requests:,} in all · [ ] to page"
        )

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "requests" and event.row_key.value is not None:
            self.selected_request = str(event.row_key.value)
            self.load_detail(self.selected_request)

    @work(exclusive=True, group="detail", exit_on_error=False)
    async def load_detail(self, request_id: str) -> None:
        try:
            doc = await self.client.request(request_id)
        except ClientError as e:
            self._w("#detail", Static).update(f"{request_id}: {e.message}")
            return
        self._w("#detail", Static).update(timeline_text(doc))

    # --- actions ------------------------------------------------------------------------------------------
    def highlighted_instance(self) -> dict[str, Any] | None:
        table = self._w("#instances", DataTable)
        if not self.instances or table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((i for i in self.instances if i["id"] == key), None)

    def action_flip(self) -> None:
        inst = self.highlighted_instance()
        if inst is None:
            self.notify("no instance to flip", severity="warning")
            return
        if inst["role"] == "colocated":  # which of the two split roles is the operator's call
            self.notify(f"tetrictl flip {inst['id']} --to prefill|decode", title="a colocated instance", timeout=8)
            return
        to = "decode" if inst["role"] == "prefill" else "prefill"

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.do_flip(inst["id"], to)

        self.push_screen(ConfirmScreen(f"Flip {inst['id']} from {inst['role']} to {to}?"), confirmed)

    @work(group="actions", exit_on_error=False)
    async def do_flip(self, instance_id: str, to: str) -> None:
        try:
            doc = await self.client.flip(instance_id, to, reason="tetrictl top")
        except ClientError as e:
            self.notify(e.message, title="flip refused", severity="error")
            return
        self.notify(f"flipping {instance_id} → {to} (flip {doc['id']})", title="flip")
        self.refresh_data()

    def action_policies(self) -> None:
        if not self.policies:
            self.notify("no policies yet: the daemon has not answered", severity="warning")
            return

        def chosen(changes: dict[str, Any] | None) -> None:
            if changes:
                self.set_policies(changes)

        self.push_screen(PolicyScreen(self.policies), chosen)

    @work(group="actions", exit_on_error=False)
    async def set_policies(self, changes: dict[str, Any]) -> None:
        try:
            doc = await self.client.set_policies(changes)
        except ClientError as e:
            self.notify(e.message, title="policy refused", severity="error")
            return
        self.policies = doc["policies"]
        self.notify(f"version {doc['version']}: changed {', '.join(doc['changed']) or 'nothing'}", title="policies")
        self.refresh_data()

    def action_status_filter(self) -> None:
        i = STATUS_FILTERS.index(self.status_filter)
        self.status_filter = STATUS_FILTERS[(i + 1) % len(STATUS_FILTERS)]
        self.page = 0
        self.refresh_data()

    def action_page(self, delta: int) -> None:
        pages = max(1, -(-self.total_requests // PAGE))
        self.page = max(0, min(pages - 1, self.page + delta))
        self.refresh_data()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_replay(self) -> None:
        self.push_screen(ReplayScreen(self.plan_path))

    # --- plan replay ----------------------------------------------------------------------------------
    def start_replay(self, path: Path, order: str) -> None:
        if self.replay_running:
            self.notify("a replay is already running", severity="warning")
            return
        try:
            plan = parse_plan(path.read_text(encoding="utf-8"), source=str(path))
            self.replay = Replay(self.client, plan, backlog(plan), order=order)
        except (OSError, WorkloadError) as e:
            self.replay_error = str(e) if isinstance(e, WorkloadError) else f"cannot read {path}: {e.strerror}"
            return
        self.plan_path = str(path)
        self.replay_error = ""
        self.replay_running = True
        self.run_replay(self.replay)

    @work(group="replay", exit_on_error=False)
    async def run_replay(self, replay: Replay) -> None:
        def on_progress(p: Progress) -> None:
            self.replay_progress = p

        try:
            self.replay_info = await replay.prepare()
            self.replay_progress = Progress(len(replay.items))
            self.replay_progress = await replay.run(on_progress)
            self.notify(f"replay {replay.tag} ended", title="replay")
        except Unreachable as e:
            self.replay_error = f"{e.message}; the replay stopped"
        except ClientError as e:
            self.replay_error = e.message
        finally:
            self.replay_running = False

    async def action_quit_top(self) -> None:
        """Quit; a running replay is stopped first and its instance's policy restored before the client closes."""
        if self.replay is not None and self.replay_running:
            self.replay.stop()
            await self.replay.restore()
        self.exit()

    def stop_replay(self) -> None:
        if self.replay is not None and self.replay_running:
            self.replay.stop()
            self.notify("stopping the replay; the instance's policy is restored", title="replay")
