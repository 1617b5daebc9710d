"""Pure scheduling policies shared by the daemon, the workers and the simulator (plain data in,
decisions out; no sockets, SQL, clocks or TUI)."""
