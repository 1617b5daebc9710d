"""`tetrictl up --policies NAME` and `tetrictl policy set --policies NAME` start from a named policy set;
`tetrictl down` stops a running `up` from another terminal."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.presets import TETRIINFER, VLLM_V1

from .harness import start_cluster, stop_up, tetrictl_up

pytestmark = pytest.mark.slow


def tetrictl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrictl.app", *args], capture_output=True, text=True, timeout=120)


def policies(url: str) -> dict:
    return httpx.get(url + "/api/v1/policies", timeout=10).json()["policies"]


def test_up_starts_the_named_policies_and_down_stops_it_from_another_process(tmp_path: Path):
    state = str(tmp_path / "state")
    args = ["--port", "0", "--grpc-port", "0", "--state-dir", state, "--profile", "tiny", "--time-scale", "50"]
    p, doc = tetrictl_up([*args, "--policies", "tetriinfer"])
    try:
        assert doc["policies"] == "tetriinfer" and doc["engine"] == "sim"
        assert policies(doc["url"]) == TETRIINFER.to_dict()
        again = tetrictl("up", *args)  # one `up` per state directory
        assert again.returncode == 1 and "is up already" in again.stderr
        down = tetrictl("down", "--state-dir", state, "--json")
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)["stopped"] == p.pid
        assert p.wait(timeout=5) == 0  # `down` returned after `up` had exited, drained
        with pytest.raises(httpx.ConnectError):
            httpx.get(doc["url"] + "/healthz", timeout=2)
        gone = tetrictl("down", "--state-dir", state)
        assert gone.returncode == 1 and "no cluster is up" in gone.stderr
    finally:
        stop_up(p)


def test_up_defaults_to_vllm_v1(tmp_path: Path):
    args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny", "--time-scale", "50"]
    p, doc = tetrictl_up([*args, "--mode", "colocated", "--colocated", "1"])
    try:
        assert doc["policies"] == "vllm-v1" and policies(doc["url"]) == VLLM_V1.to_dict()
    finally:
        stop_up(p)


def test_policy_set_takes_a_named_set_or_an_advice(tmp_path: Path):
    advice = PolicySet(colocated_schedule="vllm-v1", queue_order="srpt", predictor="learned", ttft_target_s=0.5)
    advice_file = tmp_path / "advice.json"
    advice_file.write_text(json.dumps({"advice": {"mode": "colocated", "policies": advice.to_dict()}}))
    c = start_cluster(tmp_path, ["prefill", "decode"])
    try:
        r = tetrictl("policy", "set", "--url", c.url, "--policies", "tetriinfer", "--chunk", "256", "--json")
        assert r.returncode == 0, r.stderr
        assert policies(c.url) == TETRIINFER.changed(chunk_size=256).to_dict()  # the flags change the set
        r = tetrictl("policy", "set", "--url", c.url, "--policies", "advised", "--advice", str(advice_file))
        assert r.returncode == 0, r.stderr
        assert policies(c.url) == advice.to_dict()
        before = policies(c.url)
        bad = tmp_path / "bad.json"
        for args, needle in [
            (["--policies", "fast"], "--policies must be one of vllm-v1, tetriinfer, advised"),
            (["--policies", "advised"], "--policies advised needs --advice FILE"),
            (["--advice", str(advice_file)], "--advice goes with --policies advised"),
            (["--policies", "advised", "--advice", str(tmp_path / "none.json")], "cannot read"),
            (["--policies", "advised", "--advice", str(bad)], "is not JSON (line 1"),
        ]:
            bad.write_text("{nope")
            r = tetrictl("policy", "set", "--url", c.url, *args)
            assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        bad.write_text(json.dumps({"advice": {"policies": {"chunk_size": 512, "warp": 9}}}))
        r = tetrictl("policy", "set", "--url", c.url, "--policies", "advised", "--advice", str(bad))
        assert r.returncode == 2 and "warp: unknown policy field" in r.stderr, r.stderr
        assert policies(c.url) == before  # nothing half-set
    finally:
        c.stop()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/tmp/m"], "--model applies to --engine vllm"),
        (["--engine", "vllm"], "--engine vllm needs --model DIR"),
        (["--engine", "vllm", "--model", "/tmp/m", "--time-scale", "5"], "--time-scale applies to the sim engine"),
        (["--engine", "tpu"], "--engine must be sim or vllm"),
        (["--policies", "fast"], "--policies must be one of"),
    ],
)
def test_up_refuses_bad_flags_before_starting_anything(tmp_path: Path, args: list[str], needle: str):
    r = tetrictl("up", "--state-dir", str(tmp_path / "s"), "--port", "0", "--grpc-port", "0", *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "s").exists()


def test_a_stale_pid_file_blocks_nothing_and_down_works_while_up_starts(tmp_path: Path):
    """The pid file counts only while an `up` holds its lock: one left by an `up` killed outright (its pid
    maybe another process's now: here pid 1) is no cluster; `down` stops an `up` that is still starting."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "up.pid").write_text("1\n")
    none = tetrictl("down", "--state-dir", str(state))
    assert none.returncode == 1 and "no cluster is up" in none.stderr
    args = ["up", "--port", "0", "--grpc-port", "0", "--state-dir", str(state), "--profile", "tiny"]
    p = subprocess.Popen([sys.executable, "-m", "tetrictl.app", *args, "--time-scale", "50", "--json"], text=True)
    try:
        deadline = time.monotonic() + 30
        while (state / "up.pid").read_text().strip() != str(p.pid):  # taken before anything starts
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        down = tetrictl("down", "--state-dir", str(state), "--json")
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)["stopped"] == p.pid and p.wait(timeout=10) == 0
        assert not (state / "up.pid").exists()
    finally:
        if p.poll() is None:
            p.kill()
