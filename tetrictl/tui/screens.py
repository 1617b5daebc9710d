"""The dashboard's modal screens: confirm a flip, change policies, help."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, Select

from tetri.scheduling.admission import ADMISSION_POLICIES, RESERVE_POINTS
from tetri.scheduling.dispatch import DISPATCH_POLICIES
from tetri.scheduling.flip import FLIP_POLICIES
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import PREDICTORS
from tetri.scheduling.prefill import PREFILL_POLICIES
from tetri.scheduling.routing import PD_ROUTES

SELECTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "prefill_policy": ("prefill order", PREFILL_POLICIES),
    "predictor": ("length predictor", PREDICTORS),
    "dispatch": ("dispatch", DISPATCH_POLICIES),
    "decode_admission": ("decode admission", ADMISSION_POLICIES),
    "reserve_point": ("reserve point", RESERVE_POINTS),
    "flip_policy": ("flip policy", FLIP_POLICIES),
    "pd_route": ("colocated or split", PD_ROUTES),
}
NUMBERS: dict[str, str] = {"prefill_sched_batch": "PrefillSchedBatch", "chunk_size": "ChunkSize (tokens)"}


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no. Dismisses with True on yes."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("y", "yes", "yes"), Binding("n,escape", "no", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Flip (y)", variant="warning", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class PolicyScreen(ModalScreen[dict[str, Any] | None]):
    """Every hot-swappable policy as a select or a number; dismisses with the changed fields (or None)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel"), Binding("ctrl+s", "apply", "apply")]

    def __init__(self, current: dict[str, Any]) -> None:
        super().__init__()
        self.current = PolicySet().to_dict() | current  # a daemon of an older version lacks newer fields

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("[b]Policies[/b] — applied without restart, audited", id="question")
            with Grid(id="policy-grid"):
                for key, (label, names) in SELECTS.items():
                    yield Label(label)
                    yield Select([(n, n) for n in names], value=self.current[key], allow_blank=False, id=key)
                for key, label in NUMBERS.items():
                    yield Label(label)
                    yield Input(str(self.current[key]), type="integer", id=key)
            with Horizontal(id="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply")
                yield Button("Cancel (esc)", id="cancel")

    def changes(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in SELECTS:
            v = self.query_one(f"#{key}", Select).value
            if v != self.current[key]:
                out[key] = v
        for key in NUMBERS:
            text = self.query_one(f"#{key}", Input).value.strip()
            number: Any = int(text) if text.lstrip("-").isdigit() else text  # the daemon names a bad value
            if number != self.current[key]:
                out[key] = number
        return out

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.dismiss(None)

    def action_apply(self) -> None:
        self.dismiss(self.changes())

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
# tetrictl top

The dashboard of a Tetri cluster; it refreshes twice a second and talks to the daemon only over its API.

| key | action |
|---|---|
| `tab` / `shift+tab` | move between the instances and requests tables |
| `f` | flip the highlighted prefill or decode instance to the other role (asks first; colocated: `tetrictl flip`) |
| `p` | change the scheduling policies |
| `r` | plan replay: start, stop, watch its progress |
| `s` | cycle the requests filter by status |
| `[` / `]` | previous / next page of requests |
| `?` | this help |
| `q` | quit |

Highlight a request to see its timeline (queued → prefill → first token → decode → done). When the
daemon goes away the title bar says so and the dashboard keeps retrying.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "close", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Markdown(HELP)
            yield Button("Close (esc)", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
