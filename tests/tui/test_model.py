"""The dashboard's latency window: Prometheus' histogram_quantile() estimate over two snapshots' difference."""

from __future__ import annotations

import pytest

from tetrictl.tui.model import Window, quantile

BOUNDS = [0.1, 0.2, 0.5, 1.0]


@pytest.mark.parametrize(
    ("q", "counts", "want"),
    [
        (0.5, [0, 10, 0, 0, 0], 0.15),  # the middle of (0.1, 0.2]: linear within the bucket
        (0.5, [10, 0, 0, 0, 0], 0.05),  # the first bucket starts at 0
        (0.9, [5, 0, 0, 5, 0], 0.9),  # rank 9 of 10: 4 of 5 into (0.5, 1.0]
        (0.99, [0, 0, 0, 1, 1], 1.0),  # in the +Inf bucket: the highest bound
        (0.5, [0, 0, 0, 0, 0], None),
    ],
)
def test_quantile(q: float, counts: list[int], want: float | None) -> None:
    got = quantile(q, BOUNDS, counts)
    assert got == pytest.approx(want) if want is not None else got is None


def snap(counts: list[int], total: float) -> dict:
    return {"bounds": BOUNDS, "counts": counts, "count": sum(counts), "sum": total}


def test_window_is_the_difference_of_two_snapshots() -> None:
    w = Window.between(snap([1, 2, 0, 0, 0], 0.4), snap([1, 6, 0, 0, 0], 1.0))
    assert w is not None and w.count == 4 and w.mean == pytest.approx(0.15) and w.p50 == pytest.approx(0.15)


def test_no_window_without_requests_or_across_a_daemon_restart() -> None:
    assert Window.between(snap([1, 2, 0, 0, 0], 0.4), snap([1, 2, 0, 0, 0], 0.4)) is None
    assert Window.between(snap([1, 9, 0, 0, 0], 2.0), snap([0, 3, 0, 0, 0], 0.5)) is None  # counts fell
