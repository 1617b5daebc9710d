"""The roofline cost model against the figures in profiles.toml (and docs/references.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tetri.costmodel import DEFAULT_PROFILES_PATH, CostModel, default_chunk_size, list_profiles, load_profile

REQUIRED = ("opt-13b-v100", "llama3-8b-h100", "tiny")


def cost(name: str) -> CostModel:
    return CostModel(load_profile(name))


def test_required_profiles_are_shipped():
    names = list_profiles()
    assert set(REQUIRED) <= set(names)
    assert names == sorted(names)


def test_gpu_and_model_figures_come_from_the_data_file():
    opt = load_profile("opt-13b-v100")
    assert (opt.gpu.peak_flops, opt.gpu.hbm_bytes_per_s, opt.gpu.memory_bytes) == (125e12, 900e9, 32e9)
    m = opt.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (40, 5120, 40, 40, 128)
    assert (m.kv_bytes_per_token, m.weight_bytes, m.max_model_len, m.vocab_size) == (819_200, 26e9, 2048, 50272)
    assert opt.link_gbps == 200
    assert opt.max_batched_tokens == 512  # TetriInfer's ChunkSize for OPT-13B

    llama = load_profile("llama3-8b-h100")
    assert (llama.gpu.peak_flops, llama.gpu.hbm_bytes_per_s, llama.gpu.memory_bytes) == (989e12, 3.35e12, 80e9)
    m = llama.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (32, 4096, 32, 8, 128)
    assert (m.kv_bytes_per_token, m.weight_bytes, m.max_model_len, m.vocab_size) == (131_072, 16e9, 8192, 128256)
    assert llama.link_gbps == 400

    gpus = {load_profile(n).gpu.key: load_profile(n).gpu for n in list_profiles()}
    assert gpus["a100-80gb"].peak_flops == 312e12
    assert gpus["h200"].hbm_bytes_per_s == 4.8e12
    assert gpus["h200"].memory_bytes == 141e9


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_is_consistent_and_has_a_positive_block_aligned_kv_cache(name):
    p = load_profile(name)
    m = p.model
    assert m.kv_bytes_per_token == 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    c = CostModel(p)
    cap = c.kv_capacity_tokens()
    assert cap > 0
    assert cap % p.block_size == 0
    free = p.gpu.memory_bytes * p.gpu_memory_utilization - m.weight_bytes
    assert cap <= free / m.kv_bytes_per_token < cap + p.block_size
    assert 0 < p.mfu <= 1 and 0 < p.bandwidth_efficiency <= 1 and 0 < p.gpu_memory_utilization <= 1
    assert p.max_batched_tokens >= 1 and p.max_num_seqs >= 1


def test_opt13b_on_v100_leaves_a_tight_cache():
    # (32e9 · 0.9 − 26e9) / 819,200 = 3,417.9 tokens → 3,408 in blocks of 16: under two 2,048-token requests.
    assert cost("opt-13b-v100").kv_capacity_tokens() == 3408


def test_tiny_profile_has_a_small_cache():
    assert 1000 <= cost("tiny").kv_capacity_tokens() <= 8192


@pytest.mark.parametrize("name", REQUIRED)
def test_decode_step_grows_with_context_and_batch(name):
    c = cost(name)
    times = [c.decode_step_time(8, k) for k in (0, 1000, 2000, 4000)]
    assert times == sorted(times) and times[0] < times[-1]
    # A step reads the weights at least once: never faster than the weight read plus the overhead.
    p = c.profile
    assert c.decode_step_time(1, 0) >= p.iteration_overhead_s + p.model.weight_bytes / c.effective_bandwidth
    # Large batches are compute-bound eventually: not free.
    assert c.decode_step_time(100_000, 0) > c.decode_step_time(1, 0)
    assert c.decode_step_time(0, 0) == 0.0


@pytest.mark.parametrize("name", REQUIRED)
def test_prefill_time_is_about_linear_in_tokens_and_grows_with_context(name):
    c = cost(name)
    o = c.profile.iteration_overhead_s
    t1, t2 = c.prefill_time(1024) - o, c.prefill_time(2048) - o
    # Linear term plus a quadratic attention term, small for real models; the tiny model (2M parameters,
    # hidden 256) is attention-heavy at 2K tokens.
    assert 1.9 < t2 / t1 < (2.3 if name != "tiny" else 2.6)
    assert c.prefill_time(512, context_tokens=1024) > c.prefill_time(512)
    # The second half of a chunked 2,048-token prompt costs more than the first (attention to the first).
    assert c.prefill_time(1024, 1024) > c.prefill_time(1024, 0)
    assert c.prefill_time(0) == 0.0


def test_prefill_flops_formula():
    c = cost("opt-13b-v100")
    m = c.profile.model
    t, ctx = 512, 256
    expected = 2 * m.params * t + 4 * m.num_layers * m.hidden_size * t * (ctx + t / 2)
    assert c.prefill_flops(t, ctx) == pytest.approx(expected)
    assert m.params == pytest.approx(13e9)


def test_prefill_batch_pays_the_overhead_once():
    c = cost("llama3-8b-h100")
    o = c.profile.iteration_overhead_s
    together = c.prefill_batch_time([(600, 0), (600, 0)])
    assert together == pytest.approx(o + 2 * (c.prefill_time(600) - o), rel=0.01)
    assert c.prefill_batch_time([]) == 0.0


@pytest.mark.parametrize("name", REQUIRED)
def test_transfer_time_is_bytes_over_link_bandwidth(name):
    c = cost(name)
    n = 1000
    assert c.kv_bytes(n) == n * c.profile.model.kv_bytes_per_token
    assert c.transfer_time(n) == pytest.approx(c.kv_bytes(n) * 8 / (c.profile.link_gbps * 1e9))


def test_opt13b_transfer_at_200_gbps():
    # 512 tokens × 819,200 B = 419.4 MB over 25 GB/s = 16.8 ms.
    assert cost("opt-13b-v100").transfer_time(512) == pytest.approx(512 * 819_200 / 25e9)


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown profile 'nope'") as info:
        load_profile("nope")
    message = str(info.value)
    assert "\n" not in message
    for name in REQUIRED:
        assert name in message


def test_negative_counts_are_rejected():
    c = cost("tiny")
    with pytest.raises(ValueError):
        c.prefill_time(-1)
    with pytest.raises(ValueError):
        c.decode_step_time(1, -5)


def _edited(tmp_path: Path, old: str, new: str) -> Path:
    text = DEFAULT_PROFILES_PATH.read_text()
    assert old in text
    path = tmp_path / "profiles.toml"
    path.write_text(text.replace(old, new, 1))
    return path


def test_a_kv_figure_that_contradicts_the_architecture_is_rejected(tmp_path):
    path = _edited(tmp_path, "kv_bytes_per_token = 819200", "kv_bytes_per_token = 800000")
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        load_profile("opt-13b-v100", path)


def test_a_profile_whose_weights_do_not_fit_is_rejected(tmp_path):
    path = _edited(tmp_path, "weight_gb = 26.0", "weight_gb = 29.0")
    with pytest.raises(ValueError, match="no KV cache"):
        load_profile("opt-13b-v100", path)


def test_missing_fields_and_unknown_references_are_named(tmp_path):
    path = _edited(tmp_path, 'gpu = "v100"', 'gpu = "v99"')
    with pytest.raises(ValueError, match="unknown gpu 'v99'"):
        load_profile("opt-13b-v100", path)
    path = _edited(tmp_path, "link_gbps = 200.0", "")
    with pytest.raises(ValueError, match="lacks 'link_gbps'"):
        load_profile("opt-13b-v100", path)


def test_defaults_apply_when_optional_fields_are_absent(tmp_path):
    path = tmp_path / "p.toml"
    text = DEFAULT_PROFILES_PATH.read_text()
    path.write_text(
        text
        + """
[profiles.minimal]
model = "llama-3-8b"
gpu = "h100"
mfu = 0.4
bandwidth_efficiency = 0.7
iteration_overhead_s = 0.001
link_gbps = 100
"""
    )
    p = load_profile("minimal", path)
    assert (p.gpu_memory_utilization, p.max_batched_tokens, p.max_num_seqs, p.block_size) == (0.9, 2048, 256, 16)
    assert p.link_gbps == 100.0
    assert "minimal" in list_profiles(path)
    assert math.isclose(CostModel(p).transfer_time(8), 8 * 131072 / 12.5e9)


def test_chunk_size_is_the_measured_one_or_the_roofline_knee(tmp_path):
    # the knee: where a prefill's FLOPs take as long as reading the weights (and its KV)
    for name, knee in (("opt-13b-v100", 87), ("llama3-8b-h100", 184), ("llama3-8b-h200", 129)):
        cm = CostModel(load_profile(name))
        t = cm.knee_tokens()
        assert round(t) == knee, name
        m = cm.profile.model
        compute = (2 * m.params * t + 2 * m.num_layers * m.hidden_size * t * t) / cm.effective_flops
        assert math.isclose(compute, (m.weight_bytes + t * m.kv_bytes_per_token) / cm.effective_bandwidth, rel_tol=1e-6)
    assert default_chunk_size(load_profile("opt-13b-v100")) == 512  # the paper's, measured (refs)
    assert default_chunk_size(load_profile("llama3-8b-h100")) == 192  # the knee, rounded up to whole blocks
    assert load_profile("llama3-8b-h100").source == "derived"
    cases = (
        ("chunk_size = 512 ", "chunk_size = -5 ", "chunk_size must be a whole number"),
        ("block_size = 16                # vLLM default\n", 'block_size = 16\nsource = "guessed"\n', "source must be"),
    )
    for old, new, needle in cases:
        with pytest.raises(ValueError, match=needle):
            load_profile("opt-13b-v100", _edited(tmp_path, old, new))
