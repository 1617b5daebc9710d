"""`tetrictl advise` and `tetrictl requests export` as a user runs them: one JSON document, the advice
beside the best colocated setup, and bad input as one line with exit 2 (no daemon needed but for
--apply, which is refused before anything is simulated when the daemon cannot be reached)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tetrictl import exitcodes


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=300)


def test_advise_on_a_trace_prints_one_document_with_the_advice(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival_s": i * 0.05, "prompt_tokens": 20 + i, "output_tokens": 30} for i in range(40)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = tetrictl("advise", "--trace", str(trace), "--gpus", "2", "--chunks", "192", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["requests"] == 40 and doc["gpus"] == 2 and doc["offered_rps"] == pytest.approx(20.0)
    assert {c["mode"] for c in doc["candidates"]} == {"colocated", "disaggregated"}
    assert doc["advice"]["outcome"]["goodput_rps"] >= doc["best_colocated"]["outcome"]["goodput_rps"]
    table = tetrictl("advise", "--trace", str(trace), "--gpus", "2", "--chunks", "192")
    assert table.returncode == 0 and "best colocated" in table.stdout
    split = tetrictl("advise", "--trace", str(trace), "--gpus", "2", "--chunks", "192", "--mode", "disaggregated")
    assert split.returncode == 0 and "1P+1D" in split.stdout and "best colocated" not in split.stdout
    only = json.loads(tetrictl("advise", "--trace", str(trace), "--gpus", "2", "--mode", "colocated", "--json").stdout)
    assert {c["mode"] for c in only["candidates"]} == {"colocated"} and only["best_disaggregated"] is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workload", "Mixed"], "--workload needs --rate"),
        (["--workload", "Mixed", "--rate", "5", "--trace", "x.jsonl"], "one of them"),
        (["--workload", "Mixed", "--rate", "5", "--chunks", "abc"], "--chunks: expected comma-separated whole"),
        (["--workload", "Mixed", "--rate", "5", "--gpus", "0"], "--gpus must be at least 1"),
        (["--workload", "XPXD", "--rate", "5"], "unknown workload"),
        (["--trace", "NOTUTF8"], "not UTF-8 text"),
        (["--trace", "/nonexistent.jsonl"], "cannot read"),
        (["--workload", "Mixed", "--rate", "5", "--mode", "sideways"], "--mode must be any, colocated or"),
        (["--workload", "Mixed", "--rate", "5", "--gpus", "1", "--mode", "disaggregated"], "needs at least 2 GPUs"),
    ],
)
def test_bad_advise_input_exits_2_with_one_line(args: list[str], needle: str, tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe{}\n")
    r = tetrictl("advise", *[str(bad) if a == "NOTUTF8" else a for a in args], "--json")
    assert r.returncode == exitcodes.USAGE, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_apply_without_a_daemon_is_refused_before_the_simulation():
    r = tetrictl("advise", "--workload", "Mixed", "--rate", "5", "--apply", "--url", "http://127.0.0.1:9", "--json")
    assert r.returncode == exitcodes.UNREACHABLE and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


def test_export_refuses_out_with_json(tmp_path: Path):
    r = tetrictl("requests", "export", "--output", str(tmp_path / "t.jsonl"), "--json")
    assert r.returncode == exitcodes.USAGE and "give one of them" in r.stderr
