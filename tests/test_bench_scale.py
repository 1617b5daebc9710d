"""The scale benchmark runs end to end at small sizes: every instance registers and turns active, the
requests it drives are served, and it reads each of the daemon's control-plane histograms."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[1] / "bench" / "scale_bench.py"


def test_scale_bench_at_small_sizes() -> None:
    # time scale 10: a request lasts long enough for the decode instances' reports to show it (a broadcast)
    args = [
        "--sizes",
        "4,10",
        "--per-process",
        "4",
        "--idle-s",
        "1",
        "--load-s",
        "2",
        "--rate",
        "10",
        "--time-scale",
        "10",
        "--json",
    ]
    out = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, check=True)
    rows = json.loads(out.stdout)
    assert [(r["instances"], r["processes"]) for r in rows] == [(4, 2), (10, 3)]  # 1+3 and 2+4+4
    for r in rows:
        assert r["served"] == 20  # 10 requests/s for 2 s, each answered 200
        assert r["idle_cores"] > 0 and r["reports_per_s"] > 0
        keys = ("report_mean_us", "route_mean_us", "route_p99_us", "broadcast_delay_p99_ms", "lag_load_p99_ms")
        for key in keys:
            assert math.isfinite(r[key]) and r[key] > 0, key
