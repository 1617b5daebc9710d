"""The clocks (tetri/clock.py): the cluster clock is unix-like, monotonic and runs `scale` × the wall."""

from __future__ import annotations

import asyncio
import time

import pytest

from tetri.clock import ClusterClock, ScaledClock


def test_cluster_clock_reads_unix_time_at_scale_one() -> None:
    c = ClusterClock()
    assert c.scale == 1.0 and c.now() == pytest.approx(time.time(), abs=0.05)
    assert c.model_seconds(2.5) == 2.5


def test_cluster_clock_starts_at_its_origin_and_runs_scale_times_faster() -> None:
    c = ClusterClock(100.0, origin=1_000.0)
    t0, w0 = c.now(), time.monotonic()
    assert 1_000.0 <= t0 < 1_010.0
    time.sleep(0.05)
    t1, w1 = c.now(), time.monotonic()
    assert t1 - t0 == pytest.approx((w1 - w0) * 100, rel=0.05)
    assert c.model_seconds(0.5) == 50.0
    readings = [c.now() for _ in range(1000)]
    assert readings == sorted(readings)


def test_sleep_waits_model_time() -> None:
    c = ClusterClock(50.0)
    w0 = time.monotonic()
    asyncio.run(c.sleep(2.5))  # 2.5 model seconds = 50 ms of wall time
    assert 0.045 <= time.monotonic() - w0 < 1.0


@pytest.mark.parametrize("make", [ClusterClock, ScaledClock])
def test_scale_must_be_positive(make) -> None:
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            make(bad)
