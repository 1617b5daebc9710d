"""Hypothesis strategies for small random workloads."""

from __future__ import annotations

from hypothesis import strategies as st

from tetri.planner.workload import Workload


@st.composite
def workloads(
    draw: st.DrawFn, max_n: int = 12, max_s: int = 12, max_o: int = 10, arrivals: bool = False, predicted: bool = False
) -> tuple[Workload, int]:
    n = draw(st.integers(1, max_n))
    s = draw(st.lists(st.integers(1, max_s), min_size=n, max_size=n))
    o = draw(st.lists(st.integers(1, max_o), min_size=n, max_size=n))
    a = draw(st.lists(st.integers(0, 15), min_size=n, max_size=n)) if arrivals else [0] * n
    peak = max(si + oi for si, oi in zip(s, o, strict=True))
    memory = draw(st.integers(peak, peak * 3))
    w = Workload.from_arrays(s, o, a)
    if predicted:
        import numpy as np

        lo = [draw(st.integers(1, oi + 3)) for oi in o]
        hi = [li + draw(st.integers(0, 5)) for li in lo]
        w = Workload(w.ids, w.s, w.o, w.a, np.array(lo), np.array(hi))
    return w, memory
