"""The shared core of Tetri: what the daemon, the workers and the CLI all build on, importing none of them.

* `tetri.scheduling` — the pure TetriInfer policies and the per-instance iteration scheduler.
* `tetri.planner` — the pure Sorted-F planner.
* `tetri.costmodel`, `tetri.calibrate` — the roofline cost model and its fit to a real engine.
* `tetri.des` — the discrete-event simulator (a shell of events around the same objects).
* `tetri.proto` — the wire contract (tetri.proto, generated code, gRPC channels): the gRPC edge only.
* `tetri.config` — the one configuration loader (TOML + environment) for daemon, workers and CLI.

The import direction is enforced by import-linter (`[tool.importlinter]` in pyproject.toml).
"""
