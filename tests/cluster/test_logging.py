"""Logs where the operator asks for them: `tetrictl up --log-file F --log-format json --log-level info`
sends every process's log to one file as JSON lines; a bad level is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .harness import stop_up, tetrictl_up

pytestmark = pytest.mark.slow


def test_every_process_logs_json_lines_to_one_file(tmp_path: Path):
    log = tmp_path / "tetri.log"
    args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path / "state"), "--time-scale", "20"]
    p, doc = tetrictl_up([*args, "--log-file", str(log), "--log-format", "json", "--log-level", "info"])
    try:
        r = httpx.post(doc["url"] + "/v1/completions", json={"model": "tetri-sim", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        stop_up(p)
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # every line is one JSON object
    assert lines and all({"ts", "time", "level", "logger", "process", "pid", "message"} <= set(x) for x in lines)
    processes = {x["process"] for x in lines}
    assert {"daemon", "worker:prefill", "worker:decode"} <= processes, processes
    said = {(x["process"], x["message"]) for x in lines}
    assert ("daemon", "stopped") in said and any(m.startswith("serving on http://") for _, m in said)
    assert len({x["pid"] for x in lines}) >= 3


def test_a_bad_log_level_or_state_dir_is_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "daemon.main", "--log-level", "loud", "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "log_level" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bad_dir = subprocess.run(
        [sys.executable, "-m", "daemon.main", "--state-dir", "/proc/tetri-nope", "--port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_dir.returncode == 2 and "state_dir" in bad_dir.stderr and "Traceback" not in bad_dir.stderr
    up = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "up", "--log-format", "xml"], capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 2 and "--log-format" in up.stderr, up.stderr
