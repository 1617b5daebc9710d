"""Measure a real vLLM engine for `tetrictl profile`: prefill time against prompt tokens, decode step time
against batch size and context, and mixed iterations (vLLM's chunked prefill puts a new prompt in the
same step as the running decodes). Runs one colocated `VllmEngine` in this process (vLLM's engine core
in its own process, as always) on an otherwise idle machine.

A mixed iteration is timed from outside as the decoders' gap between tokens that ends when the new
prompt's first token comes out: both come from that step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tetri.calibrate import Measurement
from tetri.costmodel import ModelSpec
from workers.engines.base import EngineRequest

from .engine import VllmEngine, VllmOptions

PREFILL_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (32, 128, 384)
DECODE_STEPS = 24
REPEATS = 3
# (decoding sequences, context tokens each, prompt tokens prefilled beside them)
MIXED = ((1, 64, 64), (1, 64, 256), (2, 128, 128), (2, 256, 384), (4, 64, 192), (4, 128, 64), (8, 32, 256),
         (8, 128, 128), (16, 64, 384))  # fmt: skip
WARM_TOKENS = 4  # decoders' tokens before the prompt is sent: they are in steady decode by then


def model_spec(model_dir: str | Path, max_model_len: int) -> ModelSpec:
    """The sim's description of a Hugging Face model directory (its config.json and weight files)."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    weights = sum(f.stat().st_size for f in d.glob("*.safetensors")) or sum(f.stat().st_size for f in d.glob("*.bin"))
    layers = int(cfg["num_hidden_layers"])
    return ModelSpec(
        key=d.name,
        name=str(d),
        num_layers=layers,
        hidden_size=int(cfg["hidden_size"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
        weight_bytes=float(weights),
        dtype_bytes=dtype_bytes,
        max_model_len=max_model_len,
        vocab_size=int(cfg["vocab_size"]),
    )


async def _timed(engine: VllmEngine, rid: str, prompt: list[int], n: int) -> list[float]:
    """Arrival time of each output token, seconds after the request was sent."""
    t0 = time.perf_counter()
    out = []
    async for _ in engine.generate(EngineRequest(rid, tuple(prompt), n)):
        out.append(time.perf_counter() - t0)
    return out


async def _stamps(
    engine: VllmEngine, rid: str, prompt: list[int], n: int, warm: asyncio.Event | None = None
) -> list[float]:
    """`perf_counter` at each output token; `warm` is set after WARM_TOKENS of them."""
    out = []
    async for _ in engine.generate(EngineRequest(rid, tuple(prompt), n)):
        out.append(time.perf_counter())
        if warm is not None and len(out) == WARM_TOKENS:
            warm.set()
    return out


async def _mixed_step(engine: VllmEngine, decoders: list[list[int]], prompt: list[int], rid: str) -> list[float]:
    """The decoders' gaps that end with the step giving `prompt` its first token (one per decoder)."""
    warm = [asyncio.Event() for _ in decoders]
    runs = [
        asyncio.create_task(_stamps(engine, f"{rid}-d{i}", p, DECODE_STEPS, w))
        for i, (p, w) in enumerate(zip(decoders, warm, strict=True))
    ]
    await asyncio.gather(*(w.wait() for w in warm))
    first = (await _stamps(engine, rid, prompt, 1))[0]
    gaps = []
    for t in await asyncio.gather(*runs):
        k = min(range(1, len(t)), key=lambda i: abs(t[i] - first))  # the decoder's token from that step
        gaps.append(t[k] - t[k - 1])
    return gaps


async def measure(
    options: VllmOptions, progress: Callable[[str], None] | None = None
) -> tuple[list[Measurement], dict[str, int | str]]:
    """Every prefill, decode and mixed point (medians over REPEATS), and the engine's facts (capacity,
    block)."""
    engine = VllmEngine(options, "colocated", "profile")
    await engine.start()
    ids = itertools.count()
    say = progress or (lambda _msg: None)
    points: list[Measurement] = []
    try:
        vocab = engine._llm.vllm_config.model_config.get_vocab_size()

        def prompt(n: int) -> list[int]:
            k = next(ids)
            return [(k * 7919 + j * 31) % (vocab - 1) + 1 for j in range(n)]

        await _timed(engine, "warmup", prompt(64), 4)  # first-call costs (graph setup, allocations)
        for n in PREFILL_TOKENS:
            if n > options.chunk_size or n + 1 > engine.max_model_len:
                continue
            times = [(await _timed(engine, f"p{next(ids)}", prompt(n), 1))[0] for _ in range(REPEATS)]
            points.append(Measurement("prefill", statistics.median(times), tokens=n))
            say(f"prefill {n} tokens: {1000 * points[-1].seconds:.1f} ms")
        for b, c in itertools.product(DECODE_BATCHES, DECODE_CONTEXTS):
            if c + DECODE_STEPS > engine.max_model_len or b > options.max_num_seqs:
                continue
            steps: list[float] = []
            for _ in range(REPEATS):
                runs = await asyncio.gather(
                    *(_timed(engine, f"d{next(ids)}", prompt(c), DECODE_STEPS) for _ in range(b))
                )
                # the steady decode phase: from each request's 2nd token to its last
                steps += [(t[-1] - t[1]) / (len(t) - 2) for t in runs if len(t) > 2]
            ctx = b * (c + DECODE_STEPS // 2)
            points.append(Measurement("decode", statistics.median(steps), batch=b, context=ctx))
            say(f"decode batch {b} × {c} tokens: {1000 * points[-1].seconds:.2f} ms/step")
        for b, c, n in MIXED:
            if b > options.max_num_seqs or n + b > options.chunk_size or c + DECODE_STEPS > engine.max_model_len:
                continue
            gaps: list[float] = []
            for _ in range(REPEATS):
                gaps += await _mixed_step(engine, [prompt(c) for _ in range(b)], prompt(n), f"m{next(ids)}")
            ctx = b * (c + WARM_TOKENS)
            points.append(Measurement("mixed", statistics.median(gaps), tokens=n, batch=b, context=ctx))
            say(f"mixed {n} tokens + batch {b} × {c} tokens: {1000 * points[-1].seconds:.1f} ms")
        facts: dict[str, int | str] = {
            "kv_capacity_tokens": engine.kv_capacity,
            "block_size": engine.block_size,
            "max_model_len": engine.max_model_len,
        }
    finally:
        await engine.stop()
    return points, facts
