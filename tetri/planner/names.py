"""The planner's policy and solver names, light to import (the CLI's help lists them)."""

from __future__ import annotations

POLICIES = (
    "fcfs",
    "mcsf",
    "mcsf-skip",
    "size",
    "area",
    "sorted-f",
    "sorted-lp",
    "sorted-f-amin",
    "sorted-f-online",
)
SOLVERS = ("auto", "dp", "swap", "quantile", "lp")
