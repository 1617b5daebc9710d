"""What the CLI's process marks absent before anything is imported (`tetrictl.cli` and `python -m
tetrictl.app` both start so).

Modules the CLI never uses but its libraries import when they are installed: httpcore imports trio, httpx
its own command-line client (click, rich, pygments). Marked absent, their `import` raises ImportError and
each library takes its documented fallback: about 0.1 s of a 0.3 s start (`bench/cli_startup.py`).
"""

import sys

UNUSED_MODULES = ("trio", "httpx._main")


def mark_absent(names: tuple[str, ...] = UNUSED_MODULES) -> None:
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` now raises ImportError
