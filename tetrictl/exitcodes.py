"""tetrictl's exit codes. Stable: scripts depend on them (documented in docs/console.md)."""

OK = 0  # success
REFUSED = 1  # the daemon refused the action or it failed
USAGE = 2  # usage error or bad input (a malformed file, an unknown policy, ...)
UNREACHABLE = 3  # the daemon cannot be reached
