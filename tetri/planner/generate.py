"""Synthetic workloads from published length statistics (no data set is downloaded).

Classes (figures from docs/references.md, which names each source; the spread parameters where a
source gives only a mean are our assumption, stated here and in docs/planner.md):

* ``short`` — chat turns, LMSYS-Chat-1M per turn (Llama-2 tokenizer): prompt mean 69.5, output mean
  214.5 tokens. Log-normal with those means and σ = 1.0 (prompt) / 0.8 (output), assumed.
* ``long`` — long-document summarisation, Arxiv-Summarization-4K (Vidur): prompt median 2730,
  p90 3702 (mean 2588); output median 167, p90 372 (mean 291). Prompt: normal fitted to median and p90
  (σ = 758), clipped to [512, 4096]; output: log-normal fitted to median and p90 (σ = 0.625), which
  gives a mean of ≈ 203, lighter-tailed than the source's 291.
* ``gen`` — long generation (TetriInfer's light-prompt, heavy-decode class): prompt log-normal with
  ShareGPT's median 18 (σ = 1.0, assumed), clipped to [2, 512]; output uniform over the heavy-decode
  range (128, 2000] (TetriInfer: outputs 20–2000 tokens, heavy above 128; the uniform shape is assumed).

All lengths are clipped to [1, 4096]. Predicted output ranges follow TetriInfer's predictor: 200-token
buckets (configurable), right with probability ``accuracy``, else an adjacent bucket. Arrivals are a
Poisson process of ``rate`` requests per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workload import Workload, WorkloadError

CLASSES = ("short", "long", "gen")
MAX_LEN = 4096


@dataclass(frozen=True)
class Mix:
    parts: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, text: str) -> Mix:
        parts = []
        for item in text.split(","):
            name, sep, frac = item.strip().partition(":")
            if name not in CLASSES:
                raise WorkloadError(f"--mix: unknown class {name!r} (choose from {', '.join(CLASSES)})")
            try:
                f = float(frac) if sep else 1.0
            except ValueError:
                raise WorkloadError(f"--mix: {item.strip()!r} needs a number after ':'") from None
            if not f > 0:
                raise WorkloadError(f"--mix: share of {name!r} must be positive")
            parts.append((name, f))
        total = sum(f for _, f in parts)
        return cls(tuple((n, f / total) for n, f in parts))


def _lognormal_mean(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)


def _draw(rng: np.random.Generator, cls: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    if cls == "short":
        s = _lognormal_mean(rng, 69.5, 1.0, n)
        o = _lognormal_mean(rng, 214.5, 0.8, n)
    elif cls == "long":
        s = np.clip(rng.normal(2730, 758, n), 512, MAX_LEN)
        o = rng.lognormal(np.log(167), 0.625, n)
    else:  # gen
        s = np.clip(rng.lognormal(np.log(18), 1.0, n), 2, 512)
        o = rng.integers(129, 2001, n).astype(np.float64)
    clip = lambda x: np.clip(np.rint(x), 1, MAX_LEN).astype(np.int64)  # noqa: E731
    return clip(s), clip(o)


def predicted_ranges(
    rng: np.random.Generator, o: np.ndarray, accuracy: float, bucket: int
) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] buckets of width ``bucket``: the true one with probability ``accuracy``."""
    true_b = (o - 1) // bucket
    wrong = rng.random(len(o)) >= accuracy
    step = np.where(rng.random(len(o)) < 0.5, -1, 1)
    step = np.where(true_b == 0, 1, step)
    b = np.where(wrong, true_b + step, true_b)
    return b * bucket + 1, (b + 1) * bucket


def generate(
    mix: Mix,
    n: int,
    seed: int,
    rate: float | None = None,
    accuracy: float | None = None,
    bucket: int = 200,
) -> Workload:
    if n < 1:
        raise WorkloadError("-n must be at least 1")
    rng = np.random.default_rng(seed)
    shares = np.array([f for _, f in mix.parts])
    classes = rng.choice(len(mix.parts), size=n, p=shares)
    s = np.empty(n, dtype=np.int64)
    o = np.empty(n, dtype=np.int64)
    for k, (name, _) in enumerate(mix.parts):
        idx = np.flatnonzero(classes == k)
        s[idx], o[idx] = _draw(rng, name, len(idx))
    if rate is not None:
        if not rate > 0:
            raise WorkloadError("--rate must be positive")
        a = np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(np.int64)
    else:
        a = np.zeros(n, dtype=np.int64)
    ids = tuple(f"{mix.parts[c][0]}-{i:06d}" for i, c in enumerate(classes.tolist()))
    lo = hi = None
    if accuracy is not None:
        if not 0 <= accuracy <= 1:
            raise WorkloadError("--accuracy must be within [0, 1]")
        if bucket < 1:
            raise WorkloadError("--bucket must be positive")
        lo, hi = predicted_ranges(rng, o, accuracy, bucket)
    return Workload(ids, s, o, a, lo, hi)


def with_width(w: Workload, width: int, seed: int) -> Workload:
    """Predicted ranges of a given width that always contain the truth (for the A_min study)."""
    rng = np.random.default_rng(seed)
    lo = np.maximum(1, w.o - rng.integers(0, width + 1, w.n))
    return Workload(w.ids, w.s, w.o, w.a, lo, lo + width)
