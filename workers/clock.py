"""Moved to `tetri.clock` (one clock abstraction for the daemon and the workers); this re-export keeps
`workers.clock` importable until its last users (the sim engine and its tests) import `tetri.clock`."""

from tetri.clock import Clock, RealClock, ScaledClock

__all__ = ["Clock", "RealClock", "ScaledClock"]
