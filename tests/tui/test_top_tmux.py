"""`tetrictl top` in a real terminal: tmux runs it at 160 × 48 against a fresh `tetrictl up --prefill 2
--decode 2`, keys go in with `send-keys`, and after each key the screen (`capture-pane`) is read and
checked against the daemon's API: the instance rows, `r` (a plan replay started from the keyboard),
`f` (a flip), `p` (the policies), `?` (help) and `q` (the process exits 0).

tmux is a system package: without it this test skips, unless TETRI_REQUIRE_TMUX=1 (CI sets it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.harness import stop_up, tetrictl_up

pytestmark = pytest.mark.slow
COLS, ROWS = 160, 48


class Tmux:
    """One tmux server on its own socket (no user config) with one session running `command`."""

    def __init__(self, command: str, env: dict[str, str]) -> None:
        self.base = ["tmux", "-L", f"tetri-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
        exports = [f"-e{k}={v}" for k, v in env.items()]
        # the pane outlives the program: its exit status stays on screen for `q` to be checked
        shell = f"{command}; echo TOP-EXITED=$?; sleep 600"
        # The tmux server takes its environment from this process: without COLUMNS and LINES (pytest's
        # plugins set 80 × 24), which Textual, through shutil.get_terminal_size, prefers to the pane's size.
        own = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        subprocess.run([*self.base, "new-session", "-d", "-s", "top", "-x", str(COLS), "-y", str(ROWS),
                        *exports, shell], check=True, env=own)  # fmt: skip

    def screen(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "top", *keys], check=True)

    def wait(self, pred: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if pred(text):
                return text
            assert time.monotonic() < deadline, f"timed out waiting for {what}; the screen:\n{text}"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[dict]:
    if shutil.which("tmux") is None:
        if os.environ.get("TETRI_REQUIRE_TMUX") == "1":
            raise RuntimeError("TETRI_REQUIRE_TMUX=1 but tmux is not installed (apt-get install tmux)")
        pytest.skip("tmux is not installed")
    p, doc = tetrictl_up(
        ["--prefill", "2", "--decode", "2", "--port", "0", "--grpc-port", "0", "--time-scale", "50",
         "--state-dir", str(tmp_path / "state")]
    )  # fmt: skip
    try:
        yield doc
    finally:
        stop_up(p)


def ctl(url: str, cwd: Path, *args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, cwd=cwd,
                       env=dict(os.environ, TETRI_URL=url), timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr


def row_of(screen: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell` (cells are 2+ spaces apart)."""
    for line in screen.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == first_cell:
            return cells
    return []


def test_top_in_tmux_each_key_against_the_api(up: dict, tmp_path: Path):
    url = up["url"]
    api = httpx.Client(base_url=url, timeout=30)
    ctl(url, tmp_path, "plan", "gen", "--mix", "short", "-n", "24", "--seed", "3", "-o", "chat.jsonl")
    ctl(url, tmp_path, "plan", "solve", "chat.jsonl", "--from-cluster", "--drop-oversized", "-o", "plan.json")
    plan = tmp_path / "plan.json"
    top = f"{shlex.quote(sys.executable)} -m tetrictl.app top --refresh 0.25 --plan {shlex.quote(str(plan))}"
    tmux = Tmux(top, {"TETRI_URL": url})
    try:
        # the instance table: every instance the API lists, with its role and state
        instances = api.get("/api/v1/instances").json()["instances"]
        screen = tmux.wait(lambda s: all(row_of(s, i["id"]) for i in instances), "the instance rows")
        for inst in instances:
            assert row_of(screen, inst["id"])[1:3] == [inst["role"], inst["state"]], screen
        assert "· tetri-sim · disaggregated" in screen.splitlines()[0]  # the whole title: 160 columns wide

        # r: the replay view, started from the keyboard (Tab to Start, Enter); it ends as the API says
        tmux.keys("r")
        tmux.wait(lambda s: "Plan replay" in s and str(plan) in s, "the replay view")
        tmux.keys("Tab", "Tab", "Enter")
        n = len(json.loads(plan.read_text())["schedule"])
        screen = tmux.wait(lambda s: f"finished {n} · failed 0 · of {n}" in s, "the replay to finish", 120)
        tag, instance = re.search(r"replay (\S+) on (\S+) \(plan order\)", screen).groups()  # type: ignore[union-attr]
        rows = api.get("/api/v1/requests", params={"id_prefix": tag + ".", "limit": 1000}).json()["requests"]
        assert len(rows) == n and {(r["status"], r["decode_instance"]) for r in rows} == {("finished", instance)}
        tmux.keys("Escape")

        # the requests table shows what the API lists, newest first
        newest = api.get("/api/v1/requests", params={"limit": 3}).json()["requests"]
        screen = tmux.wait(lambda s: all(row_of(s, r["id"]) for r in newest), "the newest requests")
        for r in newest:
            assert row_of(screen, r["id"])[1:4] == ["finished", str(r["prompt_tokens"]), str(r["output_tokens"])]

        # f: flip the highlighted (first) instance after the confirmation; the API and the row agree
        first = instances[0]
        to = "decode" if first["role"] == "prefill" else "prefill"
        tmux.keys("f")
        tmux.wait(lambda s: f"Flip {first['id']} from {first['role']} to {to}?" in s, "the flip question")
        tmux.keys("y")
        deadline = time.monotonic() + 30
        while api.get(f"/api/v1/instances/{first['id']}").json()["role"] != to:
            assert time.monotonic() < deadline, "the flip never happened"
            time.sleep(0.2)
        tmux.wait(lambda s: row_of(s, first["id"])[1:2] == [to], "the flipped row")

        # p: the policy dialog shows the daemon's policies
        pol = api.get("/api/v1/policies").json()["policies"]
        tmux.keys("p")
        screen = tmux.wait(lambda s: "Policies — applied without restart" in s, "the policy dialog")
        for label, key in [("prefill order", "prefill_policy"), ("dispatch", "dispatch"),
                           ("decode admission", "decode_admission"), ("ChunkSize (tokens)", "chunk_size")]:  # fmt: skip
            line = next(line for line in screen.splitlines() if f"  {label}  " in line)
            assert re.search(rf"\b{re.escape(str(pol[key]))}\b", line), (label, pol[key], line)
        tmux.keys("Escape")
        tmux.wait(lambda s: "Policies — applied" not in s, "the dialog to close")

        # ?: help; it closes with escape
        tmux.keys("?")
        tmux.wait(lambda s: "flip the highlighted prefill or decode instance" in s, "the help screen")
        tmux.keys("Escape")
        tmux.wait(lambda s: "flip the highlighted prefill or decode instance" not in s, "the help to close")

        # q: the dashboard exits 0
        tmux.keys("q")
        tmux.wait(lambda s: "TOP-EXITED=" in s, "the dashboard to exit")
        assert "TOP-EXITED=0" in tmux.screen()
    finally:
        tmux.close()
        api.close()
