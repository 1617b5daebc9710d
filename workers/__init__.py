"""Tetri prefill/decode workers (engine-facing side of the cluster)."""
