"""The `tetrictl` console script: the CLI's own process, started light.

Modules the CLI never uses but its libraries import when they are installed: httpcore imports trio, httpx
its own command-line client (click, rich, pygments). Marked absent before anything is imported, their
`import` raises ImportError and each library takes its documented fallback: about 0.1 s of a 0.3 s start
(`bench/cli_startup.py`). Only in the CLI's own process: importing `tetrictl.app` (the tests, the TUI's)
changes nothing.
"""

import sys

UNUSED_MODULES = ("trio", "httpx._main")


def mark_absent(names: tuple[str, ...]) -> None:
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` now raises ImportError


def main() -> None:
    mark_absent(UNUSED_MODULES)
    from tetrictl.app import app

    app()
