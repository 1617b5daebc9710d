"""`tetrictl profile` on vLLM's CPU build with the tiny model: every kind of iteration — prefill, decode
and mixed (a prompt in the decoders' step) — is measured, fitted and held out, the error is reported per
kind, and the profile written loads into the simulator. The error's size is a measurement (docs/vllm.md),
not asserted here: this machine's timings are noisy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm import need_vllm
from tetri.costmodel import CostModel, load_profile

need_vllm()

pytestmark = pytest.mark.slow


def test_profile_measures_fits_and_holds_out_every_kind(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    out = tmp_path / "p.toml"
    args = ["profile", "--model", str(model), "--block-size", "32", "-o", str(out), "--name", "cpu", "--json"]
    r = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    kinds = {"prefill", "decode", "mixed"}
    assert {p["kind"] for p in doc["points"] if p["held_out"]} == kinds
    assert {p["kind"] for p in doc["points"] if not p["held_out"]} == kinds
    assert set(doc["heldout_error_by_kind"]) == kinds
    mixed = [p for p in doc["points"] if p["kind"] == "mixed"]
    assert all(p["tokens"] > 0 and p["batch"] > 0 and p["context"] > 0 and p["measured_s"] > 0 for p in mixed)
    profile = load_profile("cpu", out)
    assert CostModel(profile).kv_capacity_tokens() == doc["kv_capacity_tokens"]
