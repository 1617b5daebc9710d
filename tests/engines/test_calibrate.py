"""Fitting the cost model: a profile's own predictions are fitted back exactly, the written profiles file
loads, and bad profile fields are refused."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tetri.calibrate import Measurement, base_profile, errors, errors_by_kind, fit, predict, split, to_toml
from tetri.costmodel import CostModel, load_profile


def synthetic_truth():
    tiny = load_profile("tiny")
    base = base_profile("fitme", tiny.model, 8192, max_batched_tokens=512, max_num_seqs=64, block_size=32, device="x")
    gpu = replace(base.gpu, peak_flops=2e11, hbm_bytes_per_s=5e9)
    return base, replace(base, gpu=gpu, iteration_overhead_s=0.003, prefill_overhead_s=0.002)


def test_fit_recovers_a_known_profile_and_writes_a_loadable_file(tmp_path: Path):
    base, truth = synthetic_truth()
    shapes = [Measurement("prefill", 1.0, tokens=n) for n in (16, 64, 128, 256, 512)]
    shapes += [Measurement("decode", 1.0, batch=b, context=b * c) for b in (1, 4, 16) for c in (32, 512)]
    shapes += [Measurement("mixed", 1.0, tokens=n, batch=b, context=b * 64) for n in (64, 384) for b in (1, 8)]
    points = [replace(m, seconds=predict(truth, m)) for m in shapes]
    train, held = split(points)
    assert {m.kind for m in held} == {"prefill", "decode", "mixed"} and len(train) + len(held) == len(points)
    fitted = fit(base, train)
    assert max(errors(fitted, points)) < 0.01  # held-out points included
    assert set(errors_by_kind(fitted, held)) == {"prefill", "decode", "mixed"}
    # a mixed iteration is priced as one: the weights read once, not a prefill plus a decode step
    m = Measurement("mixed", 1.0, tokens=384, batch=8, context=512)
    cm = CostModel(truth)
    assert predict(truth, m) < cm.prefill_time(384) + cm.decode_step_time(8, 512)
    path = tmp_path / "p.toml"
    path.write_text(to_toml(fitted))
    loaded = load_profile("fitme", path)
    assert loaded.prefill_overhead_s == pytest.approx(fitted.prefill_overhead_s)
    assert CostModel(loaded).kv_capacity_tokens() == 8192
    assert max(errors(loaded, points)) < 0.01


def test_fit_needs_enough_points_and_profiles_refuse_a_negative_prefill_overhead(tmp_path: Path):
    base, _ = synthetic_truth()
    with pytest.raises(ValueError, match="at least 4"):
        fit(base, [Measurement("prefill", 0.01, tokens=16)] * 3)
    path = tmp_path / "p.toml"
    path.write_text(to_toml(base).replace("prefill_overhead_s = 0.0", "prefill_overhead_s = -1.0"))
    with pytest.raises(ValueError, match="prefill_overhead_s must be a number ≥ 0"):
        load_profile("fitme", path)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent"], "not a Hugging Face model directory"),
        (["--model", ".", "--engine", "sim"], "--engine must be vllm"),
    ],
)
def test_profile_command_bad_input_is_exit_2(args: list[str], needle: str):
    r = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "profile", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_profile_command_bad_name_is_exit_2(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "profile", "--model", str(tmp_path), "--name", "no spaces"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--name 'no spaces'" in r.stderr, r.stderr
