"""`tetrictl bench` as a user runs it: a real subprocess, one JSON document, a PNG, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tetri.costmodel import DEFAULT_PROFILE
from tetri.des.metrics import HEADLINE
from tetrictl import exitcodes


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=300)


def test_json_has_both_systems_and_every_metric():
    r = tetrictl("bench", "--workloads", "LPLD", "-n", "32", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one document
    assert r.stderr == ""  # no progress bar under --json
    assert doc["mode"] == "des" and doc["setup"]["n"] == 32 and doc["setup"]["profile"] == "opt-13b-v100"
    (row,) = doc["workloads"]
    assert row["workload"] == "LPLD" and row["rate_rps"] > 0
    keys = {k for k, _, _ in HEADLINE}
    assert {m["key"] for m in doc["metrics"]} == keys
    assert doc["setup"]["baselines"] == ["vllm-v0", "vllm-v1"]
    for system in ("TetriInfer", "vllm-v0", "vllm-v1"):
        m = row["systems"][system]
        assert keys <= set(m) and m["n"] == 32
        assert 0 < m["avg_ttft_s"] <= m["avg_jct_s"]
    assert set(row["change"]) == {"vllm-v0", "vllm-v1"}
    assert all(set(c) == keys for c in row["change"].values())
    assert "ablations" not in doc


def test_plot_and_table(tmp_path: Path):
    png = tmp_path / "bench.png"
    r = tetrictl("bench", "--workloads", "lpld,HPLD", "-n", "16", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TetriInfer vs vllm-v0" in r.stdout and "TetriInfer vs vllm-v1" in r.stdout and "HPLD" in r.stdout


def test_json_with_plot_and_burst(tmp_path: Path):
    png = tmp_path / "b.png"
    r = tetrictl("bench", "--workloads", "Mixed", "-n", "16", "--burst", "--plot", str(png), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["plot"] == str(png) and png.exists()
    assert doc["workloads"][0]["rate_rps"] is None and doc["setup"]["arrivals"] == "burst at t = 0"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workloads", "LPLD,XPXD"], "unknown workload"),
        (["-n", "0"], "-n"),
        (["-n", "-3"], "-n"),
        (["--instances", "1"], "instances"),
        (["--profile", "no-such-gpu"], "unknown profile"),
        (["--price", "0"], "price"),
        (["--prefill-instances", "2"], "prefill instances"),
        (["--baseline", "vllm-v9"], "unknown baseline 'vllm-v9'"),
        (["--baseline", "vllm-v1,vllm-v1"], "each baseline once"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needle: str):
    r = tetrictl("bench", "--workloads", "LPLD", "-n", "8", *args, "--json")
    assert r.returncode == exitcodes.USAGE, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_sweep_writes_its_json_and_region_map(tmp_path: Path):
    png, out = tmp_path / "map.png", tmp_path / "sweep.json"
    args = ["--sweep", "--workloads", "LPLD", "--gpus", "2", "--loads", "1,4", "--chunks", "256", "-n", "16"]
    r = tetrictl("bench", *args, "--plot", str(png), "--output", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["spec"]["profile"] == DEFAULT_PROFILE and doc["spec"]["n"] == 16  # the one default, as bench's
    assert len(doc["points"]) == 2 and json.loads(out.read_text())["points"] == doc["points"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = tetrictl("bench", *args)
    assert table.returncode == 0 and "TetriInfer's best setup vs vllm-v0" in table.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "1"], "--gpus"),
        (["--loads", "fast"], "--loads"),
        (["--chunks", "0"], "--chunks"),
        (["--mode", "live"], "simulator only"),
        (["--plot", "/nonexistent/dir/map.png"], "not a directory"),
    ],
)
def test_bad_sweep_input_exits_2_with_one_line(args: list[str], needle: str):
    r = tetrictl("bench", "--sweep", "--workloads", "LPLD", "-n", "8", *args, "--json")
    assert r.returncode == exitcodes.USAGE, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_tables_name_the_mode_they_ran_in(capsys: pytest.CaptureFixture[str]):
    """A live run's tables (and plot) say LIVE, not DES: the mode comes from the document."""
    from tetri.des.experiments import BenchSetup, run_bench
    from tetrictl.bench_cmd import print_tables

    doc = run_bench(["LPLD"], BenchSetup(n=8), mode="live")  # the simulator's figures, labelled as a live run's
    print_tables(doc)
    shown = capsys.readouterr().out
    assert "(LIVE)" in shown and "(DES)" not in shown
