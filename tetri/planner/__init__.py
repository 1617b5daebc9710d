"""Offline KV-budget planner: the Sorted-F paper's model, policies, solvers and lower bounds.

Pure functional core. Nothing in this package opens files or sockets, reads a clock or prints:
callers (``tetrictl plan``, the daemon's plan replay, the benchmarks) hand it plain data and get plain
data back. The model is written down in ``docs/planner.md``.
"""
