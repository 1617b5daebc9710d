"""Tests marked `isolated` run in a fresh Python process, so that native code which kills its process
(SIGILL from a kernel built for another CPU, SIGSEGV) fails that one test, naming the signal and showing
the process's stderr, instead of ending the whole run with every test after it.

The child is `python -m pytest` on the node ids, with `CHILD` naming a file it writes each test's start
and reports to (pytest's own report serialization, as pytest-xdist uses); the parent replays those reports
through its own hooks, so the terminal, `-ra` and JUnit see them as any other test's. A module's isolated
tests share one child (a module fixture is set up once); when a child dies, the test it was running fails
with the signal and the module's tests it had not started get a fresh child. The parent still collects the
module: keep native code out of its top level (import it inside the tests or their fixtures).

Not for a test that hangs: the child has no timeout beyond the test's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MARK = "isolated"
CHILD = "TETRI_ISOLATED_CHILD"  # in a child: the file its tests' starts and reports are written to
# tee-sys: a test's output is in its report as usual and also on the child's stderr and stdout, which a
# death's report shows (fd-level capture would keep it in a buffer that dies with the process)
CHILD_ARGS = ("-q", "--capture=tee-sys")
TAIL = 60  # lines of the child's stderr (and stdout) in a report of its death


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARK}: runs in a fresh Python process (tests/isolation.py); a crash there fails this test alone",
    )
    path = os.environ.get(CHILD)
    if path and not config.pluginmanager.has_plugin(_Writer.NAME):
        config.pluginmanager.register(_Writer(config, path), _Writer.NAME)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if os.environ.get(CHILD) or item.get_closest_marker(MARK) is None:
        return None  # the usual protocol: not isolated, or this is the child
    runner = item.config.stash.setdefault(_RUNNER, _Runner(item.config))
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in runner.reports(item):
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


class _Writer:
    """In the child: one JSON line per test started and per report, written as it happens (line-buffered),
    so a test that kills the process leaves what came before it."""

    NAME = "tetri-isolated-writer"

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config = config
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the session)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.file.write(json.dumps({"start": nodeid}) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.file.write(json.dumps({"report": data}) + "\n")

    def pytest_unconfigure(self) -> None:
        self.file.close()


class _Runner:
    """In the parent: runs the isolated tests of one module in a child and hands out their reports."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.done: dict[str, list[pytest.TestReport]] = {}

    def reports(self, item: pytest.Item) -> list[pytest.TestReport]:
        if item.nodeid not in self.done:
            self._run_child(item)
        return self.done.pop(item.nodeid)

    def _run_child(self, item: pytest.Item) -> None:
        """Run `item` and the isolated tests of its module after it in one child. Every test the child
        finished gets its reports; if the child died, the first test it did not finish (the one it died
        in) gets a failure naming how, and the rest are left to another child. `item` always gets its
        reports, so each child moves the run on by at least one test."""
        items = item.session.items
        batch = {
            i.nodeid: i
            for i in items[items.index(item) :]
            if i.path == item.path and i.get_closest_marker(MARK) is not None and i.nodeid not in self.done
        }
        with tempfile.TemporaryDirectory(prefix="tetri-isolated-") as tmp:
            log = Path(tmp) / "reports.jsonl"
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-p", __name__, "-p", "no:cacheprovider", *CHILD_ARGS, *batch],
                cwd=self.config.rootpath,
                env={**os.environ, CHILD: str(log)},
                capture_output=True,
                text=True,
                errors="replace",
                check=False,
            )
            lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        got: dict[str, list[pytest.TestReport]] = {}
        for line in lines:
            if "start" in line:
                got[line["start"]] = []
            else:
                report = self.config.hook.pytest_report_from_serializable(config=self.config, data=line["report"])
                if isinstance(report.longrepr, list):  # a skip's (path, line, reason), a list once in JSON
                    report.longrepr = tuple(report.longrepr)
                got.setdefault(report.nodeid, []).append(report)
        finished = [n for n in batch if got.get(n) and got[n][-1].when == "teardown"]
        self.done.update({n: got[n] for n in finished})
        if run.returncode in (0, 1) and len(finished) == len(batch):
            return  # the child ran every test to its end (a failing test is its exit 1)
        # it died (a signal) or stopped early (an error before or between tests): the test it was in fails;
        # dead after its last test (at exit), the last test does
        unfinished = [n for n in batch if n not in finished]
        victim = unfinished[0] if unfinished else list(batch)[-1]
        self.done[victim] = _died(batch[victim], got.get(victim, []), run)


def _died(item: pytest.Item, got: list[pytest.TestReport], run: Any) -> list[pytest.TestReport]:
    """The reports of a test whose child process died in it: what it had reported, a failure in the phase
    it was in, and a teardown (JUnit writes a test case at its teardown)."""
    rc = run.returncode
    if rc < 0:
        why = f"the isolated test process died of {signal.Signals(-rc).name} (signal {-rc}) in {item.nodeid}"
    else:
        why = f"the isolated test process exited {rc} before {item.nodeid} finished"
    if not got:
        when = "setup"
    elif got[-1].when == "setup" and got[-1].passed:
        when = "call"
    else:
        when = "teardown"
    kept = [r for r in got if r.when != "teardown"]
    longrepr = _Death(why, _tail(run.stderr))
    sections = [(f"isolated process stdout (last {TAIL} lines)", _tail(run.stdout))]
    failed = pytest.TestReport(item.nodeid, item.location, {}, "failed", longrepr, when, sections)
    if when == "teardown":
        return [*kept, failed]
    return [*kept, failed, pytest.TestReport(item.nodeid, item.location, {}, "passed", None, "teardown")]


@dataclass
class _Crash:
    message: str  # the line -ra and JUnit show


class _Death:
    """A dead child's failure: how it died (the summary line's message) and the last lines of its stderr
    (a native crash's own report: faulthandler's "Fatal Python error", the library's messages)."""

    def __init__(self, why: str, stderr: str) -> None:
        self.reprcrash = _Crash(why)
        self.text = f"{why}\n\nits stderr (last {TAIL} lines):\n{stderr}"

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-TAIL:])


_RUNNER = pytest.StashKey[_Runner]()
