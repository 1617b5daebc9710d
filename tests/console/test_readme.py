"""The README's operator examples run as written on the cluster the README names (`tetrictl up --prefill 2
--decode 2`), each exiting 0: the console block, line by line (the flip's example id replaced by a live
decode instance's; `tetrictl top`, interactive, is left to tests/tui)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.harness import stop_up, tetrictl_up

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def console_block() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("With a cluster of two instances of each role up (`tetrictl up --prefill 2 --decode 2`")
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None
    lines = [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_the_readme_console_block_runs_as_written(tmp_path: Path):
    lines = console_block()
    assert lines[0].startswith("tetrictl status") and any(line.startswith("tetrictl flip ") for line in lines)
    # the README's cluster, on free ports and a faster clock (the commands do not depend on either)
    p, doc = tetrictl_up(
        ["--prefill", "2", "--decode", "2", "--port", "0", "--grpc-port", "0", "--time-scale", "50",
         "--state-dir", str(tmp_path / "state")]
    )  # fmt: skip
    try:
        decode = next(w["instance_id"] for w in doc["workers"] if w["role"] == "decode")
        env = dict(os.environ, TETRI_URL=doc["url"])
        for line in lines:
            if line.startswith("tetrictl top"):
                continue
            argv = shlex.split(line.replace("worker-50213", decode))
            assert argv[0] == "tetrictl"
            r = subprocess.run(
                [sys.executable, "-m", "tetrictl.app", *argv[1:]], capture_output=True, text=True, timeout=300,
                cwd=tmp_path, env=env,
            )  # fmt: skip
            assert r.returncode == 0, f"{line}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        plan = json.loads((tmp_path / "plan.json").read_text())
        assert plan["from_cluster"]["kv_capacity_tokens"] == plan["memory"]
    finally:
        stop_up(p)
