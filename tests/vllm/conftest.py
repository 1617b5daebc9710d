"""A failing test here gets the tail of every process's log in its report (CI keeps nothing else: a
dead engine core's traceback is in its worker's log)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

TAIL = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.failed:
        for name, path in getattr(item.module, "LOGS", {}).items():
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-TAIL:]
                report.sections.append((f"{name} log (last {TAIL} lines of {path})", "\n".join(lines)))
    return report
