"""tetrictl: the operator's command line for Tetri."""
