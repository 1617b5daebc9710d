"""tetrictl's output helpers on a terminal: the lazy consoles work where rich wants a real Console."""

from __future__ import annotations

import io

import pytest

from tetrictl import output


def test_a_progress_bar_draws_on_a_terminal(monkeypatch: pytest.MonkeyPatch):
    screen = io.StringIO()
    monkeypatch.setattr(output, "err", output._LazyConsole(file=screen, force_terminal=True, width=80))
    with output.progress("planning", quiet=False) as bar:  # rich enters its console as a context manager
        bar(1, 2)
        bar(2, 2)
    assert "planning" in screen.getvalue()


def test_fail_is_one_line_without_rich(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(output.typer.Exit) as e:
        output.fail("bad [field] value")
    assert e.value.exit_code == 2
    assert capsys.readouterr().err == "error: bad [field] value\n"  # brackets kept: no markup
