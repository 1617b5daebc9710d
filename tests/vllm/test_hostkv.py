"""HostKVConnector (workers/engines/vllm/hostkv.py): the hand-over file format, the hand-over parameters,
the prefill side's lease, and — on real engines — a hand-over that cannot be read is recomputed, not an
engine failure. The end-to-end behaviour (every prompt length, identical prompts in flight, the decode
side loading the whole prompt) is in test_vllm_cluster.py."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.vllm import need_vllm, run_scenario
from workers.engines.vllm import connectors
from workers.engines.vllm.engine import VllmEngine, VllmOptions, parse_cpus

need_vllm()

# The tests that import hostkv (vLLM's connector base, torch) are `isolated`: they share one fresh
# process, so nothing of vLLM's is loaded in pytest's own (tests/isolation.py).


@pytest.fixture(scope="module")
def hostkv() -> ModuleType:
    with warnings.catch_warnings():  # importing vLLM's connector base warns about torch's own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from workers.engines.vllm import hostkv

    return hostkv


def _caches(dtype: Any, layers: int = 2) -> list[Any]:
    import torch

    # vLLM's CPU layout: [blocks, kv heads, block size, 2 × head dim]
    return [torch.zeros(16, 2, 32, 128, dtype=dtype) for _ in range(layers)]


@pytest.mark.isolated
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_hand_over_file_round_trips_into_other_blocks(tmp_path: Path, dtype_name: str, hostkv: ModuleType):
    import torch

    dtype = getattr(torch, dtype_name)
    src = _caches(dtype)
    for i, c in enumerate(src):
        c.copy_(torch.randn(c.shape).to(dtype) + i)
    path = tmp_path / "k.kv"
    with path.open("wb") as f:
        for c in src:  # what wait_for_save writes: each layer's blocks, in layer-name order
            f.write(hostkv._bytes(c[[3, 7, 2]]))
    dst = _caches(dtype)
    hostkv._read(str(path), dst, [9, 0, 5])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[9, 0, 5]], s[[3, 7, 2]])
        assert not d[[1, 2, 3, 4, 6, 7, 8]].any()  # nothing else written


@pytest.mark.isolated
def test_a_hand_over_of_the_wrong_size_is_refused(tmp_path: Path, hostkv: ModuleType):
    import torch

    src = _caches(torch.float32)
    path = tmp_path / "k.kv"
    with path.open("wb") as f:
        for c in src:
            f.write(hostkv._bytes(c[[1, 2]]))
    with pytest.raises(ValueError, match="shorter"):
        hostkv._read(str(path), _caches(torch.float32), [1, 2, 3])  # the request has more blocks
    with pytest.raises(ValueError, match="longer"):
        hostkv._read(str(path), _caches(torch.float32), [1])
    with pytest.raises(ValueError, match="shorter"):
        hostkv._read(str(path), _caches(torch.float32, layers=3), [1, 2])  # another model


@pytest.mark.isolated
def test_hand_over_parameters_name_one_file_both_sides_agree_on(hostkv: ModuleType):
    key = "0123abcd"
    assert connectors.prefill_params(connectors.HOST_KV, key) == {connectors.STORE: key}
    handle = connectors.handoff_params(connectors.HOST_KV, key, None)
    assert connectors.decode_params(handle) == {connectors.LOAD: key}
    assert connectors.kv_file("/s", "../../etc/x") == "/s/x.kv"  # a key names a file in the store only
    cfg = connectors.transfer_config(connectors.HOST_KV, "decode", False, "/s", {})
    assert cfg is not None
    assert cfg["kv_connector_module_path"] == hostkv.__name__
    assert cfg["kv_connector_extra_config"]["shared_storage_path"] == "/s"
    assert cfg["kv_load_failure_policy"] == "recompute"
    with pytest.raises(ValueError, match="unknown KV connector"):
        connectors.transfer_config("ExampleConnector", "decode", False, "/s", {})


def test_hand_overs_nobody_loaded_are_removed_after_the_lease(tmp_path: Path):
    engine = VllmEngine(VllmOptions(model="unused", kv_store=str(tmp_path), kv_lease_s=0.2), "prefill", "p")
    for key in ("a", "b"):
        Path(connectors.kv_file(str(tmp_path), key)).write_bytes(b"x")
        engine._lease(key)
    time.sleep(0.3)
    Path(connectors.kv_file(str(tmp_path), "c")).write_bytes(b"x")
    engine._lease("c")  # the next hand-over sweeps the expired ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kv"]


def test_engine_cpus_parse():
    assert parse_cpus(None) == set()
    assert parse_cpus("0") == {0}
    assert parse_cpus("2-4,7") == {2, 3, 4, 7}


def _scenario(tmp_path: Path, mode: str) -> dict:
    """tests/vllm/hostkv_scenario.py in a child process: vLLM's engines leave warnings this suite treats as
    errors."""
    return run_scenario(tmp_path, "hostkv_scenario.py", str(tmp_path / "kv"), mode)


@pytest.mark.slow
def test_an_unreadable_hand_over_is_recomputed(tmp_path: Path):
    """Two real engines: the prefill engine's file is cut short before the decode engine loads it; vLLM
    recomputes the prompt (kv_load_failure_policy) and the answer is the one the decode engine computes
    without a hand-over."""
    got = _scenario(tmp_path, "cut")
    assert got["handed"] == got["computed"] and len(got["handed"]) == 5
    assert got["left"] == []  # the unreadable file was removed with its load


@pytest.mark.slow
def test_a_bfloat16_decode_engine_runs_on_whole_prompts(tmp_path: Path):
    """A decode engine that loads whole prompts computes one token per request per step, so nothing in it
    asks Linux for AMX before vLLM's bfloat16 attention runs AMX instructions: without the worker's plugin
    asking at start its model worker died of SIGILL on the first request (on CPUs with AMX)."""
    got = _scenario(tmp_path, "bfloat16")
    assert len(got["handed"]) == 5 and got["loaded"] == 150 and got["left"] == []
