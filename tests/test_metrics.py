"""daemon/metrics.py: the tallies fed on the per-token path read back as Prometheus histograms and counters."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_tally_buckets_are_cumulative_with_le_bounds() -> None:
    m = Metrics(lambda: ([], {}))
    for v in (0.001, 0.005, 0.0051, 0.3, 200.0):  # 0.005 sits on a bound: counted in le="0.005"
        m.itl.observe(v)
    m.tokens.inc(3)
    m.tokens.inc(4)
    got = _samples(m)
    le = {k[1][0][1]: v for k, v in got.items() if k[0] == "tetri_itl_seconds_bucket"}
    assert le["0.005"] == 2 and le["0.01"] == 3 and le["0.25"] == 3 and le["0.5"] == 4
    assert le["120.0"] == 4 and le["+Inf"] == 5
    assert got[("tetri_itl_seconds_count", ())] == 5
    assert abs(got[("tetri_itl_seconds_sum", ())] - 200.3111) < 1e-9
    assert got[("tetri_generated_tokens_total", ())] == 7
    assert got[("tetri_ttft_seconds_count", ())] == 0 and got[("tetri_jct_seconds_count", ())] == 0
