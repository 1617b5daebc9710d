"""tests/isolation.py: a test marked `isolated` that kills its process (as vLLM's AVX-512 kernels did on an
AVX2-only CPU, issue 38) is one failure naming the signal, with the process's stderr, and the run goes on:
the module's other isolated tests pass in a fresh process, the rest in pytest's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.isolation import CHILD

REPO = Path(__file__).resolve().parents[1]

MODULE = """
import os
import signal
import sys

import pytest

from tests.isolation import CHILD


@pytest.fixture(scope="module")
def pid():
    return os.getpid()


@pytest.mark.isolated
def test_first_runs_in_a_child(pid):
    assert os.environ.get(CHILD) and pid == os.getpid()


@pytest.mark.isolated
def test_shares_the_module_fixture_with_its_child(pid):
    assert pid == os.getpid()


@pytest.mark.isolated
def test_dies(pid):
    print("about to run an instruction this CPU lacks", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGILL)


@pytest.mark.isolated
def test_after_the_crash_runs_in_a_fresh_child(pid):
    assert pid == os.getpid()  # the module fixture again, in the new process


@pytest.mark.isolated
def test_fails_as_any_test_does():
    assert 1 + 1 == 3


@pytest.mark.isolated
@pytest.mark.skip(reason="skipped in the child")
def test_skipped():
    pass


def test_unmarked_runs_in_pytests_process():
    assert not os.environ.get(CHILD)
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the child imports tests.isolation from this repository
    monkeypatch.delenv(CHILD, raising=False)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_inner=MODULE)
    return pytester


def test_a_crash_in_an_isolated_test_is_one_failure_naming_the_signal(inner: pytest.Pytester):
    result = inner.runpytest_subprocess("-p", "tests.isolation", "-p", "no:cacheprovider", "-rfs", "--junitxml=j.xml")
    result.assert_outcomes(passed=4, failed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "the isolated test process died of SIGILL (signal 4) in test_inner.py::test_dies",
            "its stderr (last 60 lines):",
            "about to run an instruction this CPU lacks",  # the test's own output
            "Fatal Python error: Illegal instruction",  # pytest's faulthandler, in the child
            "FAILED test_inner.py::test_dies - the isolated test process died of SIGILL*",  # cut to the width
            "FAILED test_inner.py::test_fails_as_any_test_does - assert (1 + 1) == 3",
            "*SKIPPED*skipped in the child*",
        ],
        consecutive=False,
    )
    junit = (inner.path / "j.xml").read_text()
    assert junit.count("<testcase") == 7 and junit.count("<failure") == 2, junit
    assert '<failure message="the isolated test process died of SIGILL (signal 4) in test_inner.py::test_dies"' in junit


def test_a_child_that_cannot_collect_fails_its_test_with_its_exit(inner: pytest.Pytester):
    inner.makepyfile(
        test_broken="""
import os
import pytest

if os.environ.get("TETRI_ISOLATED_CHILD"):
    raise ImportError("a native library the child cannot load")

@pytest.mark.isolated
def test_one():
    pass

@pytest.mark.isolated
def test_two():
    pass
"""
    )
    result = inner.runpytest_subprocess("-p", "tests.isolation", "-p", "no:cacheprovider", "test_broken.py")
    result.assert_outcomes(errors=2)  # each test gets its own child, and each fails alike, in its set-up
    for name in ("test_one", "test_two"):  # exit 2 (a collection error), or 4 where no test is left to collect
        result.stdout.fnmatch_lines([f"*the isolated test process exited ? before test_broken.py::{name} finished*"])
    result.stdout.fnmatch_lines(["*a native library the child cannot load*"])
