"""The `tetrictl` console script: the CLI's own process, started light (`tetrictl.startup`: modules its
libraries would import and it never uses are marked absent first). Only in the CLI's own process:
importing `tetrictl.app` (the tests, the TUI's) changes nothing.
"""

from tetrictl.startup import mark_absent


def main() -> None:
    mark_absent()
    from tetrictl.app import app

    app()
