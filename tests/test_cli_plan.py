"""`tetrictl plan …` as a user runs it: a real subprocess, real files, exit codes and one JSON document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tetrictl import exitcodes


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "W.jsonl"
    r = tetrictl("plan", "gen", "--mix", "short:0.8,long:0.2", "-n", "120", "--seed", "1", "-o", str(path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n"] == 120
    assert len(path.read_text().splitlines()) == 120
    return path


def test_solve_writes_a_plan_and_simulate_replays_it(workload: Path, tmp_path: Path):
    plan = tmp_path / "plan.json"
    r = tetrictl("plan", "solve", str(workload), "--memory", "16384", "--solver", "swap", "-o", str(plan), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc.pop("wall_time_s") >= 0  # how long it took here: printed, not in the file
    assert doc == json.loads(plan.read_text())
    assert doc["solver"] == "swap" and doc["policy"] == "sorted-f"
    assert sum(len(b) for b in doc["batches"]) == 120
    assert doc["solver_stats"]["iterations"] >= len(doc["batches"])
    assert doc["peak_memory"] <= 16384
    sim = tetrictl("plan", "simulate", str(workload), "--plan", str(plan), "--json")
    assert sim.returncode == 0, sim.stderr
    replay = json.loads(sim.stdout)
    assert replay["tel"] == doc["tel"]
    assert replay["schedule"] == doc["schedule"]


def test_auto_plan_reports_its_seeds_moves_and_gap(workload: Path, tmp_path: Path):
    plan = tmp_path / "auto.json"
    r = tetrictl("plan", "solve", str(workload), "--memory", "16384", "--evals", "40", "-o", str(plan), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    imp = doc["solver_stats"]["improvement"]
    assert doc["solver"].endswith("+improve") and imp["seed"] in imp["seed_tel"] and imp["moves_tried"] == 40
    assert set(imp["seed_tel"]) >= {"area", "size", "mcsf-skip"}
    assert doc["tel"] <= min(imp["seed_tel"].values())
    assert doc["lower_bound"]["method"] in ("lp", "cheap") and doc["gap"] == pytest.approx(
        doc["tel"] / doc["lower_bound"]["value"]
    )
    assert doc["gap"] >= 1.0
    sim = tetrictl("plan", "simulate", str(workload), "--plan", str(plan), "--json")
    assert sim.returncode == 0 and json.loads(sim.stdout)["tel"] == doc["tel"]  # the plan replays exactly
    human = tetrictl("plan", "solve", str(workload), "--memory", "16384", "--evals", "0")
    assert human.returncode == 0 and "gap" in human.stdout and "improvement" in human.stdout
    zero = json.loads(tetrictl("plan", "solve", str(workload), "-M", "16384", "--evals", "0", "--json").stdout)
    seeds = zero["solver_stats"]["improvement"]["seed_tel"]  # no moves: still the best seed
    assert set(seeds) >= {"area", "size", "mcsf-skip"} and zero["tel"] == min(seeds.values())
    for flag, value in (("--evals", "-1"), ("--time-limit", "0"), ("--time-limit", "nan")):
        bad = tetrictl("plan", "solve", str(workload), "--memory", "16384", flag, value, "--json")
        assert bad.returncode == exitcodes.USAGE and flag in bad.stderr and bad.stdout == "", (flag, value)


def test_the_same_input_gives_the_same_plan_file_under_cpu_load(workload: Path, tmp_path: Path):
    # the improvement phase stops on a move count by default, not on the clock: a loaded or slower machine
    # gives the same plan, byte for byte
    quiet, loaded = tmp_path / "quiet.json", tmp_path / "loaded.json"
    r = tetrictl("plan", "solve", str(workload), "--memory", "16384", "-o", str(quiet))
    assert r.returncode == 0, r.stderr
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        r = tetrictl("plan", "solve", str(workload), "--memory", "16384", "-o", str(loaded))
    finally:
        for p in burn:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    assert loaded.read_bytes() == quiet.read_bytes()
    doc = json.loads(quiet.read_text())
    assert doc["solver_stats"]["improvement"]["moves_tried"] == 50_000 // 120  # the default count, all tried
    timed = tetrictl("plan", "solve", str(workload), "--memory", "16384", "--time-limit", "30", "--json")
    assert timed.returncode == 0 and json.loads(timed.stdout)["tel"] == doc["tel"]  # a limit it did not reach


@pytest.mark.parametrize("policy", ["fcfs", "mcsf", "mcsf-skip", "size", "area", "sorted-f"])
def test_simulate_each_policy(workload: Path, policy: str):
    r = tetrictl("plan", "simulate", str(workload), "--memory", "16384", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["policy"] == policy and len(doc["schedule"]) == 120
    assert doc["avg_latency"] == pytest.approx(doc["tel"] / 120)


def test_compare_and_bound(workload: Path):
    r = tetrictl("plan", "compare", str(workload), "--memory", "16384", "--policies", "fcfs,sorted-f", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows = {row["policy"]: row for row in doc["policies"]}
    assert rows["sorted-f"]["ratio_to_best"] == pytest.approx(1.0)
    assert rows["fcfs"]["ratio_to_bound"] >= rows["sorted-f"]["ratio_to_bound"] >= 1.0
    b = tetrictl("plan", "bound", str(workload), "--memory", "16384", "--no-lp", "--json")
    assert b.returncode == 0, b.stderr
    bound = json.loads(b.stdout)
    assert bound["method"] == "cheap" and bound["lower_bound"] == doc["lower_bound"]["cheap"]
    human = tetrictl("plan", "compare", str(workload), "--memory", "16384", "--policies", "fcfs,sorted-f")
    assert human.returncode == 0 and "sorted-f" in human.stdout and "× bound" in human.stdout


def _bad(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ('{"id": "a", "prompt_tokens": 1, "output_tokens": 1}\n{oops\n', [], "line 2: malformed JSON"),
        ('{"id": "a", "prompt_tokens": 1}\n', [], "missing field 'output_tokens'"),
        ('{"id": "a", "prompt_tokens": 0, "output_tokens": 1}\n', [], "must be positive"),
        ('{"id": "a", "prompt_tokens": 1, "output_tokens": 1}\n' * 2, [], "duplicate id 'a'"),
        ('{"id": "a", "prompt_tokens": 9000, "output_tokens": 1}\n', [], "request 'a' needs 9001"),
        ('{"id": "a", "prompt_tokens": 1, "output_tokens": 1}\n', ["--policy", "nope"], "unknown policy 'nope'"),
        ('{"id": "a", "prompt_tokens": 1, "output_tokens": 1}\n', ["--solver", "nope"], "unknown solver 'nope'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, content: str, args: list[str], message: str):
    path = _bad(tmp_path, "W.jsonl", content)
    r = tetrictl("plan", "simulate", str(path), "--memory", "8192", *args, "--json")
    assert r.returncode == exitcodes.USAGE
    assert message in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


def test_unreadable_file_and_bad_plan(tmp_path: Path, workload: Path):
    r = tetrictl("plan", "bound", str(tmp_path / "missing.jsonl"), "--memory", "100", "--json")
    assert r.returncode == exitcodes.USAGE and "cannot read" in r.stderr
    plan = _bad(tmp_path, "plan.json", json.dumps({"memory": 16384, "batches": [["ghost"]]}))
    r = tetrictl("plan", "simulate", str(workload), "--plan", str(plan), "--json")
    assert r.returncode == exitcodes.USAGE and "unknown request 'ghost'" in r.stderr
    r = tetrictl("plan", "simulate", str(workload), "--memory", "10", "--json")
    assert r.returncode == exitcodes.USAGE and "--drop-oversized" in r.stderr


def test_drop_oversized_reports_the_count(tmp_path: Path):
    path = _bad(
        tmp_path,
        "W.jsonl",
        '{"id": "a", "prompt_tokens": 50, "output_tokens": 1}\n{"id": "b", "prompt_tokens": 1, "output_tokens": 1}\n',
    )
    r = tetrictl("plan", "solve", str(path), "--memory", "20", "--drop-oversized", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dropped"] == 1 and doc["n"] == 1
    only_big = _bad(tmp_path, "big.jsonl", '{"id": "a", "prompt_tokens": 50, "output_tokens": 1}\n')
    for cmd in ("solve", "simulate", "compare"):  # nothing left once every request is dropped: exit 2
        r = tetrictl("plan", cmd, str(only_big), "--memory", "20", "--drop-oversized", "--json")
        assert r.returncode == exitcodes.USAGE and "no request left" in r.stderr, (cmd, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_usage_errors_exit_2():
    r = tetrictl("plan", "solve")
    assert r.returncode == exitcodes.USAGE
