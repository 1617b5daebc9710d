"""The `advise` flip policy's model (`SplitAdvisor`, `trace.window_workload`) and the simulator running it."""

from __future__ import annotations

import pytest

from tetri.costmodel import load_profile
from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.experiments import TETRI_POLICY
from tetri.des.flipadvisor import SplitAdvisor, advising
from tetri.des.trace import Seen, window_workload
from tetri.des.workloads import Request, make_workload

H100 = load_profile("llama3-8b-h100")


def seen(workload: str, n: int, rate: float, seed: int = 3) -> list[Seen]:
    return [
        Seen(r.request_id, r.arrival, r.prompt_len, r.max_tokens, r.output_len, True)
        for r in make_workload(workload, n, seed=seed, rate=rate)
    ]


def test_window_workload_lengths_finished_running_and_skipped() -> None:
    got = window_workload(
        [
            Seen("done", 0.0, 100, 500, 42, True, predicted_hi=300),  # its own length
            Seen("bounded", 1.0, 100, 500, 0, False, predicted_hi=300),  # the predictor's upper bound
            Seen("capped", 2.0, 100, 500, 0, False, predicted_hi=10_000),  # … capped by max_tokens
            Seen("nopred", 3.0, 100, 500, 0, False),  # no prediction: max_tokens
            Seen("past", 4.0, 100, 500, 350, False, predicted_hi=300),  # produced beyond the bound so far
            Seen("empty", 5.0, 0, 500, 0, False),  # rejected before it had a prompt: not work
        ]
    )
    assert {r.request_id: r.output_len for r in got} == {
        "done": 42,
        "bounded": 300,
        "capped": 500,
        "nopred": 500,
        "past": 350,
    }
    assert all(r.max_tokens >= r.output_len for r in got)


@pytest.mark.parametrize(
    ("workload", "rate", "now", "want"),
    [
        ("LPHD", 30.0, 3, 1),  # decode-heavy on 3P:1D → the most decode instances
        ("HPLD", 60.0, 1, 3),  # prefill-heavy on 1P:3D → the most prefill instances
        ("LPHD", 2.0, 2, 2),  # light: every split serves it within 5% → stay
    ],
)
def test_advisor_picks_the_split_the_window_wants(workload: str, rate: float, now: int, want: int) -> None:
    a = SplitAdvisor(H100).advise(seen(workload, 200, rate), TETRI_POLICY, now, 4 - now)
    assert a is not None and (a.prefill, a.decode) == (want, 4 - want)
    assert f"at {want}P:{4 - want}D vs" in a.reason and f"at {now}P:{4 - now}D" in a.reason


def test_advisor_stays_within_the_margin_and_needs_evidence() -> None:
    window = seen("HPLD", 200, 60.0)
    strict = SplitAdvisor(H100, margin=0.0).advise(window, TETRI_POLICY, 2, 2)
    loose = SplitAdvisor(H100, margin=0.05).advise(window, TETRI_POLICY, 2, 2)
    assert strict is not None and strict.prefill == 3  # 3P:1D is better, by less than 5%
    assert loose is not None and loose.prefill == 2
    assert SplitAdvisor(H100).advise(window[:7], TETRI_POLICY, 2, 2) is None  # fewer than min_requests
    assert SplitAdvisor(H100).advise(window, TETRI_POLICY, 1, 0) is None  # nothing to split


def shifting() -> list[Request]:
    """Prefill-heavy then decode-heavy, 400 + 400 requests at 30 req/s."""
    a = make_workload("HPLD", 400, seed=1, rate=30.0)
    b = make_workload("LPHD", 400, seed=2, rate=30.0)
    t = max(r.arrival for r in a)
    return a + [Request("b" + r.request_id, r.arrival + t, r.prompt_len, r.output_len, r.max_tokens) for r in b]


def test_simulated_advise_follows_the_shift_and_conserves_kv() -> None:
    reqs = shifting()
    pol = TETRI_POLICY.changed(flip_policy="advise", flip_window_s=10.0)
    cfg = advising(ClusterConfig(profile="llama3-8b-h100", instances=4, prefill_instances=3, policy=pol))
    res = simulate(reqs, cfg, check_kv=True)
    fixed = simulate(
        reqs, ClusterConfig(profile="llama3-8b-h100", instances=4, prefill_instances=3, policy=TETRI_POLICY)
    )
    assert len(res.requests) == len(reqs)
    assert res.flips and all(f.reason.startswith("advise: ") for f in res.flips)
    assert [f.to_role for f in res.flips] == ["decode"] * len(res.flips)  # 3P:1D gives way to decode
    assert sum(r.jct for r in res.requests) < sum(r.jct for r in fixed.requests)
    again = simulate(reqs, cfg)
    assert [(f.instance_id, f.started) for f in again.flips] == [(f.instance_id, f.started) for f in res.flips]


def test_the_simulator_takes_the_advisor_as_data() -> None:
    pol = TETRI_POLICY.changed(flip_policy="advise", flip_window_s=10.0)
    bare = ClusterConfig(profile="llama3-8b-h100", instances=4, prefill_instances=3, policy=pol)
    with pytest.raises(ValueError, match="advisor"):
        simulate(shifting()[:20], bare)
    assert advising(bare).advisor is not None and advising(advising(bare)) == advising(bare)
    fixed = ClusterConfig(profile="llama3-8b-h100", instances=4, prefill_instances=3, policy=TETRI_POLICY)
    assert advising(fixed) is fixed  # no advise policy, no advisor
