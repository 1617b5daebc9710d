"""The plan-replay view of the dashboard: pick a plan file, start or stop the replay, watch it advance."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, Select, Static

from ..output import fmt
from ..replay import ORDERS, Progress


class ReplayHost(Protocol):
    """What the screen needs of its app (the dashboard's `TopApp`): the replay's state and its controls."""

    replay_info: dict[str, object]
    replay_progress: Progress | None
    replay_error: str
    replay_running: bool

    def start_replay(self, path: Path, order: str) -> None: ...

    def stop_replay(self) -> None: ...


def progress_text(info: dict[str, object], p: Progress | None) -> str:
    if p is None:
        return "no replay yet: give a plan file and press Start"
    head = f"replay [b]{info.get('tag', '?')}[/b] on {info.get('instance_id', '?')} ({info.get('order', '?')} order)"
    lines = [
        head,
        f"sent {p.sent} · admitted {p.started} · finished {p.finished} · failed {p.failed} · of {p.n}",
        f"plan M {fmt(info.get('plan_memory'))} tokens · instance KV capacity {fmt(info.get('kv_capacity_tokens'))}",
        f"planned TEL {fmt(p.planned_tel)} steps · measured TEL {fmt(p.measured_tel_s)} s · "
        f"average latency {fmt(p.measured_avg_latency_s)} s",
        f"completion order planned vs measured: Kendall τ {fmt(p.order_agreement)}",
        f"planned first:  {escape(' '.join(p.planned_order[:8]))}",
        f"measured first: {escape(' '.join(p.measured_order[:8]))}",
    ]
    return "\n".join(lines)


class ReplayScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("x", "stop", "stop replay"),
    ]

    def __init__(self, plan_path: str | None) -> None:
        super().__init__()
        self.plan_path = plan_path

    @property
    def top(self) -> ReplayHost:
        return self.app  # type: ignore[return-value]  # the app that pushed it: a ReplayHost

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="replay"):
            yield Label("[b]Plan replay[/b] — a Sorted-F plan's backlog on one decode instance", id="replay-title")
            with Horizontal(id="replay-form"):
                yield Input(self.plan_path or "", placeholder="plan.json", id="plan-path")
                yield Select([(o, o) for o in ORDERS], value="plan", allow_blank=False, id="order")
                yield Button("Start", variant="primary", id="start")
                yield Button("Stop (x)", variant="error", id="stop")
            yield ProgressBar(total=1, show_eta=False, id="replay-progress")
            yield Static(progress_text({}, None), id="replay-status")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(0.5, self.show)
        self.show()

    def show(self) -> None:
        app = self.top
        p = app.replay_progress
        bar = self.query_one("#replay-progress", ProgressBar)
        if p is not None:
            bar.update(total=max(1, p.n), progress=p.finished + p.failed)
        text = progress_text(app.replay_info, p)
        if app.replay_error:
            text += f"\n[red]{escape(app.replay_error)}[/red]"
        self.query_one("#replay-status", Static).update(text)
        self.query_one("#start", Button).disabled = app.replay_running
        self.query_one("#stop", Button).disabled = not app.replay_running

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "start":
            path = self.query_one("#plan-path", Input).value.strip()
            order = str(self.query_one("#order", Select).value)
            self.top.start_replay(Path(path), order)
        elif event.button.id == "stop":
            self.action_stop()
        self.show()

    def action_stop(self) -> None:
        self.top.stop_replay()
