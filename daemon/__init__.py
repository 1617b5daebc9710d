"""Tetri control plane.

`tetri.planner` is pure: plain data in, plain decisions out. It imports no web, RPC, SQL or TUI
framework and reads no clock, so the CLI, the live daemon and the simulators share it unchanged.
"""
