"""Length mixes for the SLO matrix (`bench/slo_matrix.py`, docs/bench.md): chat-, code- and RAG-like
requests with Poisson arrivals, as `Request`s.

Each length is log-normal, fitted to a median and a 90th percentile (σ = ln(p90 / median) / 1.2816), or
normal where the source's mean is below its median, clipped so that prompt + output fits the context:

* chat: prompt log-normal, median 417, p90 1678; output log-normal, median 139, p90 484 — the
  LMSYS-Chat-1M-4K trace's figures (Vidur's analysis of it);
* code: prompt log-normal, median 1000, p90 3000; output log-normal, median 250, p90 800 — our choice
  (assumed: a file of context in, a function back);
* rag: prompt normal, median 2730, σ 758, in [512, 4096] — the Arxiv-Summarization-4K trace's prompts
  (Vidur), a long retrieved context; output log-normal, median 80, p90 250 — our choice (assumed: a short
  grounded answer).

`max_tokens` is the context left after the prompt (the client set no limit), as in `make_workload`:
nothing but a predictor knows an answer's length. Deterministic for a seed: lengths are drawn before the
arrival gaps, so the same seed gives the same requests at any rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .workloads import Request, WorkloadSpecError

Z90 = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class Lengths:
    median: float
    p90: float | None = None  # log-normal
    sigma: float | None = None  # normal (the source's mean is below its median)
    lo: int = 1
    hi: int | None = None

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma is not None:
            x = rng.normal(self.median, self.sigma, n)
        else:
            assert self.p90 is not None
            x = rng.lognormal(math.log(self.median), math.log(self.p90 / self.median) / Z90, n)
        return np.clip(np.rint(x), self.lo, self.hi if self.hi is not None else np.inf).astype(int)


MIXES: dict[str, tuple[Lengths, Lengths]] = {
    "chat": (Lengths(417, 1678, lo=2), Lengths(139, 484)),
    "code": (Lengths(1000, 3000, lo=2), Lengths(250, 800)),
    "rag": (Lengths(2730, sigma=758, lo=512, hi=4096), Lengths(80, 250)),
}


def make_mix(name: str, n: int, rate: float, seed: int = 0, *, max_model_len: int = 8192) -> list[Request]:
    """`n` requests of mix `name` arriving as a Poisson process at `rate` requests per second from t = 0."""
    if name not in MIXES:
        raise WorkloadSpecError(f"unknown mix {name!r} (choose from {', '.join(MIXES)})")
    if n < 1:
        raise WorkloadSpecError(f"need at least one request, got n = {n}")
    if not rate > 0 or math.isinf(rate):
        raise WorkloadSpecError(f"arrival rate must be positive and finite, got {rate}")
    rng = np.random.default_rng([seed, list(MIXES).index(name)])
    prompts, outputs = MIXES[name]
    prompt = np.minimum(prompts.draw(rng, n), max_model_len - 1)
    output = np.maximum(1, np.minimum(outputs.draw(rng, n), max_model_len - prompt))
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    arrival = np.cumsum(gaps)
    return [
        Request(f"{name}-{i}", float(arrival[i]), int(prompt[i]), int(output[i]), max_model_len - int(prompt[i]))
        for i in range(n)
    ]
