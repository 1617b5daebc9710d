"""A roofline cost model for one LLM-serving GPU: iteration times, KV capacity, KV transfer time.

Pure functions of a `Profile` (a model on a GPU plus serving knobs) read from ``profiles.toml``; no
clock, no asyncio. The formulas, the figures and what is assumed are in docs/sim-engine.md.

* Prefill of T tokens with C tokens of prior context (a later chunk of a chunked prefill) costs
  2·params·T + 4·layers·hidden·T·(C + T/2) FLOPs; an iteration takes the larger of that over
  (peak × MFU) and its memory traffic (weights once + the KV it reads and writes) over
  (HBM bandwidth × bandwidth efficiency), plus a fixed per-iteration overhead.
* A decode step over B sequences holding K KV tokens in all reads the weights once and all K tokens
  of KV: memory-bound, (weight bytes + K·kv_bytes_per_token) / effective bandwidth, but never less
  than its compute, (2·params·B + 4·layers·hidden·K) / effective FLOP/s; plus the overhead.
* A mixed iteration (vLLM v1: prefill chunks in the same batch as decodes) reads the weights once; its
  FLOPs and KV traffic are the prefill's plus the decode's, plus the prefill's overhead.
* KV capacity (tokens) = ⌊(memory × utilization − weight bytes) / kv_bytes_per_token⌋ rounded down to a
  multiple of the block size.
* KV transfer of N tokens over the profile's link = kv_bytes(N) / (link_gbps · 1e9 / 8).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILES_PATH = Path(__file__).with_name("profiles.toml")
# The one profile every command and setting defaults to (`tetrictl up`, `worker start`, `bench`, `bench
# --sweep`, `advise`; each one's --profile help names it): TetriInfer's own setup, OPT-13B on a V100.
DEFAULT_PROFILE = "opt-13b-v100"

_PROFILE_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.9,
    "max_batched_tokens": 2048,
    "max_num_seqs": 256,
    "block_size": 16,
    "description": "",
    "prefill_overhead_s": 0.0,
    "chunk_size": 0,
    "source": "derived",
}
SOURCES = ("derived", "measured")


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    peak_flops: float  # dense FP16/BF16 tensor FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float


@dataclass(frozen=True)
class ModelSpec:
    key: str
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    weight_bytes: float
    dtype_bytes: int
    max_model_len: int
    vocab_size: int

    @property
    def params(self) -> float:
        """Parameter count implied by the weight size (weight bytes / bytes per parameter)."""
        return self.weight_bytes / self.dtype_bytes


@dataclass(frozen=True)
class Profile:
    name: str
    model: ModelSpec
    gpu: Gpu
    gpu_memory_utilization: float
    mfu: float  # compute efficiency (model FLOP utilisation), assumed
    bandwidth_efficiency: float  # achieved / peak HBM bandwidth, assumed
    iteration_overhead_s: float  # fixed cost per engine iteration, assumed
    link_gbps: float  # KV-transfer link, gigabits per second
    max_batched_tokens: int = 2048  # prompt-token budget of one prefill iteration (chunk size)
    max_num_seqs: int = 256
    block_size: int = 16
    description: str = ""
    # extra fixed cost of an iteration that prefills (admitting new requests: input preparation, block
    # allocation, first-token sampling); 0 in the shipped profiles, fitted by `tetrictl profile`
    prefill_overhead_s: float = 0.0
    # TetriInfer's ChunkSize on this profile when one was measured (the paper's 512 for OPT-13B on V100);
    # 0: the roofline's knee (`default_chunk_size`)
    chunk_size: int = 0
    source: str = "derived"  # derived: published specs + assumed efficiencies; measured: fitted (`tetrictl profile`)


@dataclass(frozen=True)
class CostModel:
    profile: Profile

    @property
    def effective_flops(self) -> float:
        return self.profile.gpu.peak_flops * self.profile.mfu

    @property
    def effective_bandwidth(self) -> float:
        return self.profile.gpu.hbm_bytes_per_s * self.profile.bandwidth_efficiency

    # --- prefill -------------------------------------------------------------------------------

    def prefill_flops(self, num_tokens: int, context_tokens: int = 0) -> float:
        """FLOPs to prefill `num_tokens` tokens after `context_tokens` already in the KV cache."""
        _check_tokens(num_tokens, context_tokens)
        m = self.profile.model
        linear = 2.0 * m.params * num_tokens
        attention = 4.0 * m.num_layers * m.hidden_size * num_tokens * (context_tokens + num_tokens / 2.0)
        return linear + attention

    def prefill_batch_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one prefill iteration over `(num_tokens, context_tokens)` chunks; 0 if empty."""
        m = self.profile.model
        flops = 0.0
        kv_tokens = 0
        any_chunk = False
        for num_tokens, context_tokens in chunks:
            flops += self.prefill_flops(num_tokens, context_tokens)
            kv_tokens += num_tokens + context_tokens
            any_chunk = True
        if not any_chunk:
            return 0.0
        compute = flops / self.effective_flops
        memory = (m.weight_bytes + kv_tokens * m.kv_bytes_per_token) / self.effective_bandwidth
        return self.profile.iteration_overhead_s + self.profile.prefill_overhead_s + max(compute, memory)

    def prefill_time(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Seconds for one iteration prefilling `num_tokens` after `context_tokens` of prior context."""
        _check_tokens(num_tokens, context_tokens)
        if num_tokens == 0:
            return 0.0
        return self.prefill_batch_time([(num_tokens, context_tokens)])

    # --- decode --------------------------------------------------------------------------------

    def decode_step_time(self, batch_size: int, total_context_tokens: int) -> float:
        """Seconds for one decode step of `batch_size` sequences holding `total_context_tokens` KV."""
        _check_tokens(batch_size, total_context_tokens)
        if batch_size == 0:
            return 0.0
        m = self.profile.model
        memory = (m.weight_bytes + total_context_tokens * m.kv_bytes_per_token) / self.effective_bandwidth
        flops = 2.0 * m.params * batch_size + 4.0 * m.num_layers * m.hidden_size * total_context_tokens
        compute = flops / self.effective_flops
        return self.profile.iteration_overhead_s + max(memory, compute)

    # --- mixed (vLLM v1: prefill chunks batched with decodes) -------------------------------------

    def mixed_batch_time(self, chunks: Iterable[tuple[int, int]], batch_size: int, decode_context_tokens: int) -> float:
        """Seconds for one iteration that prefills `(num_tokens, context_tokens)` chunks and decodes one
        token for each of `batch_size` sequences holding `decode_context_tokens` KV in all: the weights
        are read once for both, the FLOPs and the KV traffic add up. With no chunks it is
        `decode_step_time`, with no decodes `prefill_batch_time` (the overheads included)."""
        _check_tokens(batch_size, decode_context_tokens)
        chunks = list(chunks)
        if batch_size == 0:
            return self.prefill_batch_time(chunks)
        if not chunks:
            return self.decode_step_time(batch_size, decode_context_tokens)
        m = self.profile.model
        flops = sum(self.prefill_flops(n, c) for n, c in chunks)
        flops += 2.0 * m.params * batch_size + 4.0 * m.num_layers * m.hidden_size * decode_context_tokens
        kv_tokens = sum(n + c for n, c in chunks) + decode_context_tokens
        memory = (m.weight_bytes + kv_tokens * m.kv_bytes_per_token) / self.effective_bandwidth
        overhead = self.profile.iteration_overhead_s + self.profile.prefill_overhead_s
        return overhead + max(flops / self.effective_flops, memory)

    def knee_tokens(self) -> float:
        """Prompt tokens at which one prefill iteration turns compute-bound: below, it is paid for by
        reading the weights (tokens are nearly free); above, time grows with the tokens. The roofline's
        saturation point, where ChunkSize is cheapest per token without giving up throughput."""
        m = self.profile.model
        lo, hi = 1.0, float(max(m.max_model_len, 1 << 20))

        def compute_bound(t: float) -> bool:
            flops = 2.0 * m.params * t + 2.0 * m.num_layers * m.hidden_size * t * t
            memory = (m.weight_bytes + t * m.kv_bytes_per_token) / self.effective_bandwidth
            return flops / self.effective_flops >= memory

        if not compute_bound(hi):
            return hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
        return hi

    # --- memory and transfer -------------------------------------------------------------------

    def kv_capacity_tokens(self) -> int:
        """KV slots (tokens) left after the weights, a multiple of the block size; may be ≤ 0."""
        p = self.profile
        free = p.gpu.memory_bytes * p.gpu_memory_utilization - p.model.weight_bytes
        tokens = math.floor(free / p.model.kv_bytes_per_token)
        return (tokens // p.block_size) * p.block_size

    def kv_bytes(self, num_tokens: int) -> int:
        _check_tokens(num_tokens)
        return num_tokens * self.profile.model.kv_bytes_per_token

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to move `num_tokens` tokens of KV over the profile's link."""
        return self.kv_bytes(num_tokens) / (self.profile.link_gbps * 1e9 / 8.0)


def default_chunk_size(profile: Profile) -> int:
    """The profile's ChunkSize: the measured one if it has one, else the roofline's knee rounded up to a
    whole number of KV blocks."""
    if profile.chunk_size:
        return profile.chunk_size
    block = profile.block_size
    return max(block, math.ceil(CostModel(profile).knee_tokens() / block) * block)


def _check_tokens(*counts: int) -> None:
    for n in counts:
        if n < 0:
            raise ValueError(f"token and sequence counts must be non-negative, got {n}")


# --- loading -----------------------------------------------------------------------------------


def _read(path: Path | None) -> dict[str, Any]:
    with (path or DEFAULT_PROFILES_PATH).open("rb") as f:
        return tomllib.load(f)


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, Mapping):
        raise ValueError(f"profiles file: [{name}] must be a table")
    return section


def _field(table: Mapping[str, Any], key: str, where: str, kind: type) -> Any:
    if key not in table:
        raise ValueError(f"profiles file: {where} lacks '{key}'")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"profiles file: {where}.{key} must be {kind.__name__}, got {value!r}")
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"profiles file: {where}.{key} must be positive, got {value!r}")
    return value


def _gpu(gpus: Mapping[str, Any], key: str, where: str) -> Gpu:
    if key not in gpus:
        raise ValueError(f"profiles file: {where} names unknown gpu '{key}'; known: {', '.join(sorted(gpus))}")
    t = gpus[key]
    w = f"gpus.{key}"
    return Gpu(
        key=key,
        name=_field(t, "name", w, str),
        peak_flops=_field(t, "peak_tflops", w, float) * 1e12,
        hbm_bytes_per_s=_field(t, "hbm_gb_per_s", w, float) * 1e9,
        memory_bytes=_field(t, "memory_gb", w, float) * 1e9,
    )


def _model(models: Mapping[str, Any], key: str, where: str) -> ModelSpec:
    if key not in models:
        raise ValueError(f"profiles file: {where} names unknown model '{key}'; known: {', '.join(sorted(models))}")
    t = models[key]
    w = f"models.{key}"
    spec = ModelSpec(
        key=key,
        name=_field(t, "name", w, str),
        num_layers=_field(t, "num_layers", w, int),
        hidden_size=_field(t, "hidden_size", w, int),
        num_heads=_field(t, "num_heads", w, int),
        num_kv_heads=_field(t, "num_kv_heads", w, int),
        head_dim=_field(t, "head_dim", w, int),
        kv_bytes_per_token=_field(t, "kv_bytes_per_token", w, int),
        weight_bytes=_field(t, "weight_gb", w, float) * 1e9,
        dtype_bytes=_field(t, "dtype_bytes", w, int),
        max_model_len=_field(t, "max_model_len", w, int),
        vocab_size=_field(t, "vocab_size", w, int),
    )
    implied = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
    if implied != spec.kv_bytes_per_token:
        raise ValueError(
            f"profiles file: {w}.kv_bytes_per_token is {spec.kv_bytes_per_token} but "
            f"2·layers·kv_heads·head_dim·dtype_bytes is {implied}"
        )
    return spec


def _nonnegative(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"profiles file: {where} must be a number ≥ 0, got {value!r}")
    return float(value)


def _chunk(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"profiles file: {where} must be a whole number of tokens ≥ 0, got {value!r}")
    return value


def list_profiles(path: Path | None = None) -> list[str]:
    """Names of the profiles in the data file (default: the shipped ``profiles.toml``), sorted."""
    return sorted(_section(_read(path), "profiles"))


def load_profile(name: str, path: Path | None = None) -> Profile:
    """The named profile; ValueError naming the known profiles if there is none by that name."""
    data = _read(path)
    profiles = _section(data, "profiles")
    if name not in profiles:
        raise ValueError(f"unknown profile '{name}'; known profiles: {', '.join(sorted(profiles))}")
    t = {**_PROFILE_DEFAULTS, **profiles[name]}
    w = f"profiles.{name}"
    profile = Profile(
        name=name,
        model=_model(_section(data, "models"), _field(t, "model", w, str), w),
        gpu=_gpu(_section(data, "gpus"), _field(t, "gpu", w, str), w),
        gpu_memory_utilization=_field(t, "gpu_memory_utilization", w, float),
        mfu=_field(t, "mfu", w, float),
        bandwidth_efficiency=_field(t, "bandwidth_efficiency", w, float),
        iteration_overhead_s=_field(t, "iteration_overhead_s", w, float),
        link_gbps=_field(t, "link_gbps", w, float),
        max_batched_tokens=_field(t, "max_batched_tokens", w, int),
        max_num_seqs=_field(t, "max_num_seqs", w, int),
        block_size=_field(t, "block_size", w, int),
        description=str(t["description"]),
        prefill_overhead_s=_nonnegative(t["prefill_overhead_s"], f"{w}.prefill_overhead_s"),
        chunk_size=_chunk(t["chunk_size"], f"{w}.chunk_size"),
        source=str(t["source"]),
    )
    if profile.source not in SOURCES:
        raise ValueError(f"profiles file: {w}.source must be one of {', '.join(SOURCES)}, got {profile.source!r}")
    for key in ("gpu_memory_utilization", "mfu", "bandwidth_efficiency"):
        if getattr(profile, key) > 1:
            raise ValueError(f"profiles file: {w}.{key} must be at most 1, got {getattr(profile, key)}")
    capacity = CostModel(profile).kv_capacity_tokens()
    if capacity <= 0:
        raise ValueError(f"profiles file: {w} leaves no KV cache (weights do not fit in the usable memory)")
    return profile
