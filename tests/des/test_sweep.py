"""The sweep (tetri.des.sweep): every TetriInfer setup and every baseline on the same requests at each
load, perf/$ at the offered rate, and a region map that agrees with the points it summarises."""

from __future__ import annotations

import json

import pytest

from tetri.des.sweep import SweepSpec, run_sweep
from tetri.des.workloads import WorkloadSpecError

SPEC = SweepSpec(workloads=("LPLD",), gpus=(2, 3), loads=(1.0, 8.0), chunks=(128, 512), n=32)


def test_every_setup_runs_once_and_the_progress_counts_every_run():
    calls: list[tuple[int, int]] = []
    doc = run_sweep(SPEC, progress=lambda done, total: calls.append((done, total)))
    json.dumps(doc, allow_nan=False)
    assert SPEC.points == 2 * 2 * (1 + 2) == len(doc["points"])
    assert calls == [(k, SPEC.runs) for k in range(1, SPEC.runs + 1)]
    setups = {(p["gpus"], p["load"], p["prefill"], p["chunk_size"]) for p in doc["points"]}
    assert len(setups) == len(doc["points"])
    assert {(p["gpus"], p["prefill"] + p["decode"]) for p in doc["points"]} == {(2, 2), (3, 3)}
    assert len(doc["baselines"]) == 2 * 2 * 2  # budgets × loads × baselines


def test_perf_per_dollar_is_goodput_at_the_offered_rate_per_gpu_dollar():
    doc = run_sweep(SPEC)
    for p in doc["points"]:
        m = p["metrics"]
        assert m["goodput_rps"] == pytest.approx(p["rate_rps"] * m["slo_attainment"])
        assert m["perf_per_dollar"] == pytest.approx(m["goodput_rps"] * 3600 / (p["gpus"] * SPEC.price))
        assert p["rate_rps"] == pytest.approx(p["load"] * doc["capacity_rps"]["LPLD"][p["gpus"]])


def test_the_region_map_names_the_best_setup_of_each_cell():
    doc = run_sweep(SPEC)
    base = {(b["gpus"], b["load"], b["baseline"]): b["metrics"]["perf_per_dollar"] for b in doc["baselines"]}
    assert len(doc["regions"]) == 2 * 2 * 2  # baselines × budgets × loads
    for r in doc["regions"]:
        cell = [p for p in doc["points"] if (p["gpus"], p["load"]) == (r["gpus"], r["load"])]
        best = max(p["metrics"]["perf_per_dollar"] for p in cell)
        chosen = next(
            p for p in cell if (p["prefill"], p["chunk_size"]) == (r["best"]["prefill"], r["best"]["chunk_size"])
        )
        assert chosen["metrics"]["perf_per_dollar"] == best
        b = base[(r["gpus"], r["load"], r["baseline"])]
        assert r["wins"] == (best > 0 and best >= b)
        assert r["ratio"] == (best / b if b else None)
        assert set(r["by_split"]) == {str(k) for k in range(1, r["gpus"])}
        for split, cell in r["by_split"].items():
            mine = max(p["metrics"]["perf_per_dollar"] for p in cell_points(cell_of(r, doc), int(split)))
            assert cell["wins"] == (mine > 0 and mine >= b)


def cell_of(region: dict, doc: dict) -> list[dict]:
    return [p for p in doc["points"] if (p["gpus"], p["load"]) == (region["gpus"], region["load"])]


def cell_points(points: list[dict], prefill: int) -> list[dict]:
    return [p for p in points if p["prefill"] == prefill]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"gpus": (1,)}, "--gpus"),
        ({"loads": (0.0,)}, "--loads"),
        ({"chunks": (0,)}, "--chunks"),
        ({"workloads": ("XPXD",)}, "unknown workload"),
        ({"baselines": ("vllm-v9",)}, "unknown baseline"),
    ],
)
def test_a_bad_spec_names_its_field(changes: dict, needle: str):
    with pytest.raises(WorkloadSpecError, match=needle):
        SweepSpec(**changes)
