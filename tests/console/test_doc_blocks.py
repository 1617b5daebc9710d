"""Every shell block in README.md and docs/ runs as written on the cluster it names, or says why not.

A block is preceded by one annotation (an HTML comment, invisible on GitHub):

    <!-- doc-test: run -->                             no cluster; run in an empty directory
    <!-- doc-test: run up --prefill 2 --decode 2 -->  on a fresh `tetrictl up` with those flags
    <!-- doc-test: skip <why> -->                      not run here, and why (another test, a GPU …)

A block runs as one bash script (`set -eo pipefail`) with `TETRI_URL` set to the cluster, on free ports
and a faster clock (the commands do not depend on either): the README's `http://127.0.0.1:8000`
becomes the cluster's URL and the example instance id `worker-50213` a live decode instance's.
`tetrictl top` lines are left out (interactive: tests/tui/test_top_tmux.py drives it in tmux).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.harness import stop_up, tetrictl_up

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(sh|bash|shell|console)\s*$")
NOTE = re.compile(r"^<!-- doc-test: (run|skip)(.*?) -->$")
EXAMPLE_URL, EXAMPLE_ID = "http://127.0.0.1:8000", "worker-50213"


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the fence
    how: str  # "run", "skip", or None when unannotated
    arg: str  # up flags for run, the reason for skip
    body: str


def blocks() -> list[Block]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                note = NOTE.match(lines[i - 1]) if i else None
                out.append(
                    Block(
                        f"{path.relative_to(ROOT)}:{i + 1}",
                        note.group(1) if note else "",
                        note.group(2).strip() if note else "",
                        "\n".join(lines[i + 1 : end]),
                    )
                )
                i = end
            i += 1
    return out


ALL = blocks()
RUN = [b for b in ALL if b.how == "run"]


def test_every_shell_block_says_whether_it_runs():
    bare = [b.where for b in ALL if not b.how]
    assert not bare, f"shell blocks without a <!-- doc-test: run|skip … --> line above them: {bare}"
    assert all(b.arg for b in ALL if b.how == "skip"), "a skipped block gives its reason"
    assert all(not b.arg or b.arg.startswith("up") for b in RUN)
    assert len(RUN) >= 5


def script(body: str, url: str | None, decode: str | None) -> str:
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("tetrictl top")]
    text = "\n".join(lines)
    if url is not None:
        text = text.replace(EXAMPLE_URL, url)
    if decode is not None:
        text = text.replace(EXAMPLE_ID, decode)
    return "set -eo pipefail\nset -x\n" + text + "\n"


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_block_runs_as_written(block: Block, tmp_path: Path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("TETRI_URL", None)
    up, url, decode = None, None, None
    if block.arg:
        flags = block.arg.split()[1:]
        up, doc = tetrictl_up(
            [*flags, "--port", "0", "--grpc-port", "0", "--time-scale", "50", "--state-dir", str(tmp_path / "state")]
        )
        url = doc["url"]
        decode = next(w["instance_id"] for w in doc["workers"] if w["role"] in ("decode", "colocated"))
        env["TETRI_URL"] = url
    work = tmp_path / "work"
    work.mkdir()
    try:
        r = subprocess.run(
            ["bash", "-c", script(block.body, url, decode)], cwd=work, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, f"{block.where}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        for plan in work.glob("*.json"):  # a plan solved --from-cluster has the cluster's M
            doc = json.loads(plan.read_text())
            if isinstance(doc, dict) and "from_cluster" in doc:
                assert doc["memory"] == doc["from_cluster"]["kv_capacity_tokens"], plan
    finally:
        if up is not None:
            stop_up(up)
