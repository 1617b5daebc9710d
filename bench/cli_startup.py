"""How long `tetrictl` takes to start, per command: the wall time of the whole process (Python's own start
included) and the time its imports take, medians of several runs.

    python bench/cli_startup.py                 # the default commands, 7 runs each
    python bench/cli_startup.py --runs 15

Commands that talk to a daemon are pointed at a closed port (`--url http://127.0.0.1:9`): they go through
their whole path and exit 3, which is what an ops script's `tetrictl status --json` costs when the daemon
answers, less the request itself. Target (issue 15): ≤ 0.3 s for `--help` and `status --json`. Prints a
table; asserts nothing (tests/test_lazy_imports.py checks what the light commands import).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

CLOSED = ["--url", "http://127.0.0.1:9"]
COMMANDS = [
    ["--help"],
    ["status", "--json", *CLOSED],
    ["instances", "ls", "--json", *CLOSED],
    ["requests", "ls", "--json", *CLOSED],
    ["policy", "show", "--json", *CLOSED],
    ["plan", "--help"],
    ["bench", "--help"],
    ["plan", "gen", "-n", "10", "-o", "-"],  # a computing command: loads numpy
]


def wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tetrictl.app", *argv], capture_output=True, timeout=120)
    return time.perf_counter() - t0


def imports(argv: list[str]) -> float:
    """Seconds of `-X importtime` over every module the command loaded (the top-level entries' sums)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "tetrictl.app", *argv], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    total = 0
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):  # a top-level import: its cumulative time
            total += int(m.group(1))
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    bare = statistics.median(
        _timed([sys.executable, "-c", "pass"]) for _ in range(a.runs)
    )  # Python's own start, for reference
    t = Table(title=f"tetrictl start-up, median of {a.runs} runs (python -c pass: {bare:.3f} s)", title_justify="left")
    for c in ("command", "wall s", "imports s", "target"):
        t.add_column(c, justify="left" if c == "command" else "right")
    for argv in COMMANDS:
        w = statistics.median(wall(argv) for _ in range(a.runs))
        i = statistics.median(imports(argv) for _ in range(a.runs))
        light = argv[0] == "--help" or argv[:2] == ["status", "--json"]
        t.add_row("tetrictl " + " ".join(x for x in argv if x not in CLOSED), f"{w:.3f}", f"{i:.3f}",
                  "≤ 0.3" if light else "")  # fmt: skip
    Console(width=120).print(t)


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, timeout=60)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
