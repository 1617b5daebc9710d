"""The prefix-cache index's lookup alone: `CacheIndex.match` for a prompt the instance holds whole, and one
nobody holds, at several prompt lengths (two instances indexed, engine blocks of 16 tokens). Prints a table.

    python bench/cacheindex_bench.py [--repeat 500]

What it costs inside the daemon (cold caches, other threads) is larger: `bench/control_plane_cost.py`'s
`route µs` column (docs/bench.md, "Prefix caching").
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from tetri.scheduling.cacheindex import CacheEvents, CacheIndex
from tetri.scheduling.prefix import block_keys

B = 16


def per_call(index: CacheIndex, tokens: list[int], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        index.match(tokens, ["a", "b"])
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=500)
    a = ap.parse_args()
    t = Table(title="CacheIndex.match, µs a call", title_justify="left")
    for c in ("prompt tokens", "held whole", "held by none"):
        t.add_column(c, justify="right")
    for n in (64, 512, 2048, 8192):
        held = list(range(1000, 1000 + n))
        index = CacheIndex()
        index.apply("a", CacheEvents(1, 1, True, tuple(block_keys(held, B)), (), B))
        index.apply("b", CacheEvents(1, 1, True, (), (), B))
        miss = list(range(5, 5 + n))
        hit, none = per_call(index, held, a.repeat), per_call(index, miss, a.repeat)
        t.add_row(f"{n:,}", f"{hit * 1e6:.1f}", f"{none * 1e6:.1f}")
    Console().print(t)


if __name__ == "__main__":
    main()
