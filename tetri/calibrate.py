"""Fit the sim engine's roofline cost model to measurements of a real engine (pure: data in, profile out).

A `Measurement` is one timed iteration shape: a prefill of ``tokens`` tokens (``kind="prefill"``), a
decode step of ``batch`` sequences holding ``context`` KV tokens in all (``kind="decode"``), or both in
one iteration (``kind="mixed"``: vLLM v1's chunked prefill batching a prompt with running decodes), and
the seconds it took. `fit` finds the effective compute rate, the effective memory bandwidth and the fixed
per-iteration overhead that minimise the relative error of `CostModel`'s prediction over the training
points, and returns them as a `Profile` (mfu and bandwidth efficiency 1: the fitted rates are the
device's effective ones). `errors` gives the relative error of each point under a profile, so a caller
can report it on measurements held out of the fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from tetri.costmodel import CostModel, Gpu, ModelSpec, Profile

# log-space bounds: rates from 1 MFLOP/s (1 MB/s) to 1 EFLOP/s (1 EB/s), overheads from 0.1 µs to 10 s
BOUNDS = (np.log([1e6, 1e6, 1e-7, 1e-7]), np.log([1e18, 1e18, 10.0, 10.0]))


@dataclass(frozen=True)
class Measurement:
    kind: str  # prefill | decode | mixed
    seconds: float
    tokens: int = 0  # prefill, mixed: prompt tokens in the iteration
    batch: int = 0  # decode, mixed: sequences decoding in the step
    context: int = 0  # decode, mixed: KV tokens held by those sequences


KINDS = ("prefill", "decode", "mixed")


def predict(profile: Profile, m: Measurement) -> float:
    cm = CostModel(profile)
    if m.kind == "prefill":
        return cm.prefill_time(m.tokens)
    if m.kind == "mixed":
        return cm.mixed_batch_time([(m.tokens, 0)], m.batch, m.context)
    return cm.decode_step_time(m.batch, m.context)


def errors(profile: Profile, points: Sequence[Measurement]) -> list[float]:
    """Relative error |predicted − measured| / measured of each point."""
    return [abs(predict(profile, m) - m.seconds) / m.seconds for m in points]


def errors_by_kind(profile: Profile, points: Sequence[Measurement]) -> dict[str, float]:
    """Mean relative error per kind of iteration (the kinds present)."""
    out = {}
    for kind in KINDS:
        e = errors(profile, [m for m in points if m.kind == kind])
        if e:
            out[kind] = sum(e) / len(e)
    return out


def split(points: Sequence[Measurement]) -> tuple[list[Measurement], list[Measurement]]:
    """Every third point of each kind held out, the rest to fit."""
    train: list[Measurement] = []
    held: list[Measurement] = []
    for kind in KINDS:
        for i, m in enumerate(m for m in points if m.kind == kind):
            (held if i % 3 == 1 else train).append(m)
    return train, held


def _with(base: Profile, flops: float, bandwidth: float, overhead: float, prefill_overhead: float) -> Profile:
    gpu = replace(base.gpu, peak_flops=flops, hbm_bytes_per_s=bandwidth)
    return replace(
        base,
        gpu=gpu,
        mfu=1.0,
        bandwidth_efficiency=1.0,
        iteration_overhead_s=overhead,
        prefill_overhead_s=prefill_overhead,
    )


def fit(base: Profile, train: Sequence[Measurement]) -> Profile:
    """`base` with its compute rate, bandwidth, iteration overhead and prefill overhead fitted to ``train``
    (least squares on the relative error, in log space so all four stay positive)."""
    if len(train) < 4:
        raise ValueError("need at least 4 measurements to fit 4 parameters")
    fastest = min(m.seconds for m in train)

    def residuals(x: np.ndarray) -> np.ndarray:
        p = _with(base, *(math.exp(v) for v in x))
        return np.array([(predict(p, m) - m.seconds) / m.seconds for m in train])

    best = None
    for flops0 in (1e9, 1e11, 1e13):  # a few starts: the max() of the roofline has flat regions
        for bw0 in (1e9, 1e11):
            x0 = np.log([flops0, bw0, fastest / 2, fastest / 4])
            res = least_squares(residuals, x0, bounds=BOUNDS, method="trf", x_scale="jac", max_nfev=4000)
            if best is None or res.cost < best.cost:
                best = res
    assert best is not None
    f, b, o, po = (math.exp(v) for v in best.x)
    return _with(base, f, b, o, po)


def base_profile(
    name: str,
    model: ModelSpec,
    kv_capacity_tokens: int,
    *,
    max_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    device: str,
) -> Profile:
    """A profile for ``model`` on a measured device whose memory gives exactly ``kv_capacity_tokens``."""
    utilization = 0.9
    memory = (model.weight_bytes + (kv_capacity_tokens + 0.5) * model.kv_bytes_per_token) / utilization
    gpu = Gpu(key=f"{name}-device", name=device, peak_flops=1e12, hbm_bytes_per_s=1e10, memory_bytes=memory)
    return Profile(
        name=name,
        model=model,
        gpu=gpu,
        gpu_memory_utilization=utilization,
        mfu=1.0,
        bandwidth_efficiency=1.0,
        iteration_overhead_s=1e-3,
        link_gbps=100.0,
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        description=f"fitted by tetrictl profile on {device}",
        source="measured",
    )


def to_toml(p: Profile) -> str:
    """The profile as a profiles file (gpu, model and profile tables) the sim engine loads."""
    m, g = p.model, p.gpu
    mk = f"{p.name}-model"
    return "\n".join(
        [
            f"# written by `tetrictl profile`: {p.description}",
            "# peak_tflops and hbm_gb_per_s are the fitted effective rates (mfu = bandwidth_efficiency = 1)",
            "",
            f"[gpus.{g.key}]",
            f'name = "{g.name}"',
            f"peak_tflops = {g.peak_flops / 1e12!r}",
            f"hbm_gb_per_s = {g.hbm_bytes_per_s / 1e9!r}",
            f"memory_gb = {g.memory_bytes / 1e9!r}",
            "",
            f"[models.{mk}]",
            f'name = "{m.name}"',
            f"num_layers = {m.num_layers}",
            f"hidden_size = {m.hidden_size}",
            f"num_heads = {m.num_heads}",
            f"num_kv_heads = {m.num_kv_heads}",
            f"head_dim = {m.head_dim}",
            f"kv_bytes_per_token = {m.kv_bytes_per_token}",
            f"weight_gb = {m.weight_bytes / 1e9!r}",
            f"dtype_bytes = {m.dtype_bytes}",
            f"max_model_len = {m.max_model_len}",
            f"vocab_size = {m.vocab_size}",
            "",
            f"[profiles.{p.name}]",
            f'description = "{p.description}"',
            f'model = "{mk}"',
            f'gpu = "{g.key}"',
            f"gpu_memory_utilization = {p.gpu_memory_utilization!r}",
            "mfu = 1.0",
            "bandwidth_efficiency = 1.0",
            f"iteration_overhead_s = {p.iteration_overhead_s!r}",
            f"prefill_overhead_s = {p.prefill_overhead_s!r}",
            f"link_gbps = {p.link_gbps!r}",
            f"max_batched_tokens = {p.max_batched_tokens}",
            f"max_num_seqs = {p.max_num_seqs}",
            f"block_size = {p.block_size}",
            'source = "measured"',
            "",
        ]
    )
