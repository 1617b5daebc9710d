"""README's real-model quickstart as written: the tiny model, `tetrictl up --engine vllm --model DIR`, a chat
completion through the daemon, `tetrictl down` from another process. The commands are README.md's own
(checked below), on free ports and a state directory of the test's."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cluster.harness import stop_up, tetrictl_up
from tests.vllm import need_vllm

need_vllm()
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAKE = "python -m workers.engines.vllm.tinymodel /tmp/tiny"
UP = "tetrictl up --engine vllm --model /tmp/tiny --mode colocated --colocated 1 --dtype float32"
DOWN = "tetrictl down"


def test_the_readme_quickstart_serves_a_chat_completion_on_vllm(tmp_path: Path):
    readme = ROOT.joinpath("README.md").read_text()
    for line in (MAKE, UP, DOWN):
        assert line in readme, f"README.md no longer gives {line!r}: change this test with it"
    model = tmp_path / "tiny"
    make = shlex.split(MAKE.replace("/tmp/tiny", str(model)))
    subprocess.run([sys.executable, *make[1:]], check=True, timeout=300)
    state = tmp_path / "state"
    up = shlex.split(UP.replace("/tmp/tiny", str(model)))[2:]
    p, doc = tetrictl_up([*up, "--port", "0", "--grpc-port", "0", "--state-dir", str(state)], timeout=600)
    try:
        assert doc["engine"] == "vllm" and [w["role"] for w in doc["workers"]] == ["colocated"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
        r = httpx.post(doc["url"] + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] >= 1
        models = httpx.get(doc["url"] + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
        down = subprocess.run(
            [sys.executable, "-m", "tetrictl.app", "down", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0, down.stderr
        assert p.wait(timeout=10) == 0
    finally:
        stop_up(p)
