"""The planner's user-facing error, in a module of its own so that callers catching it (the CLI's error
handling) need not load numpy."""

from __future__ import annotations


class WorkloadError(ValueError):
    """A workload (or a plan that refers to it) is malformed; the message is one line for the user."""
