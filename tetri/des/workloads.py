"""The TetriInfer paper's workloads (§5): LPLD, LPHD, HPLD, HPHD and Mixed, as lists of `Request`.

Classes (refs, TetriInfer arXiv 2401.11181): a prompt is *heavy* above 512 tokens, an output is
*heavy* above 128 tokens (ShareGPT's median answer). Inside each class the lengths are our choice
(assumed, the paper's exact generators are not published):

* light prompt: log-normal, median 18 tokens (TetriInfer's ShareGPT median, unverified), σ = 1.0,
  clipped to [2, 512];
* heavy prompt: uniform over [513, L − 128] with light outputs and [513, L / 2] with heavy outputs,
  L = max_model_len (1,920 and 1,024 for OPT-13B's 2,048), so that prompt + output fits the context;
* light output: uniform over [20, 128] (refs: outputs 20–2000);
* heavy output: uniform over [129, 2000], cut to the context left after the prompt;
* Mixed: ShareGPT-like, both log-normal, fitted to refs' (unverified) figures: prompt median 18 and
  mean ≈ 215 (σ = √(2 ln(215/18)) ≈ 2.23), output median 128 and mean ≈ 190 (σ = √(2 ln(190/128)) ≈
  0.89); prompts clipped to [2, L − 128], outputs to [1, context left]. Clipping pulls the means down
  (docs/bench.md gives the realised figures).

Arrivals are Poisson (exponential gaps, first request at t = 0) at `rate` requests per second, or all at
once with `rate = math.inf`. The bench (`experiments.py`) sets the rate to a load factor × the vanilla
system's saturated throughput on the same requests; `DEFAULT_RATES` are those rates at load 0.8 for two
`opt-13b-v100` instances (128 requests, seed 0), rounded, for callers that give none. `max_tokens` is
the context left after the prompt (the client set no limit; the answer ends at its true length,
`output_len`). Deterministic for a seed: lengths come first from the generator, so the same seed gives
the same lengths at any rate.

Every request must fit: prompt + output ≤ max_model_len and its peak KV (prompt + output − 1) ≤ the
instance's KV capacity; `make_workload` cuts outputs to fit when given the limits.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from tetri.planner.workload import WorkloadError

from .names import WORKLOADS

LIGHT_PROMPT_MAX = 512  # refs: heavy prefill > 512 prompt tokens
LIGHT_OUTPUT_MAX = 128  # refs: heavy decode > 128 output tokens
LIGHT_PROMPT_MEDIAN = 18  # refs: TetriInfer's ShareGPT prompt median ≈ 18 (unverified)
SHAREGPT_PROMPT_MEAN = 215  # refs: ShareGPT prompt mean ≈ 215 (unverified)
SHAREGPT_OUTPUT_MEDIAN = 128  # refs: TetriInfer's ShareGPT output median 128 (unverified)
SHAREGPT_OUTPUT_MEAN = 190  # refs: ShareGPT output mean ≈ 186–199 (unverified)
OUTPUT_MIN, OUTPUT_MAX = 20, 2000  # refs: outputs 20–2000 tokens

# Poisson arrival rates (requests/s): 0.8 × two vanilla opt-13b-v100 instances' saturated throughput.
DEFAULT_RATES = {"LPLD": 10.0, "LPHD": 0.15, "HPLD": 0.8, "HPHD": 0.09, "Mixed": 2.0}
DEFAULT_N = 128  # refs: the Mixed test runs 128 requests


class WorkloadSpecError(WorkloadError):
    """An unknown workload or impossible parameters (one line for the user)."""


HASH_BLOCK = 512  # tokens per hash id in a trace (Mooncake's)


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the simulator (or a live load generator) sees it. Times in seconds.

    `hash_ids` say which prompts share a prefix (Mooncake's trace format): one id per `hash_block` tokens
    of the prompt, equal leading ids meaning equal leading tokens; the simulator's prefix caches key on
    them (`tetri.scheduling.prefix.keys_from_hash_ids`). `session` names the conversation (or agent run)
    the request belongs to; `parent` the request it continues (its prompt holds that one's prompt and
    answer), for a live generator that must wait for the answer before it sends this."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int  # the true answer length, first token included
    max_tokens: int  # the client's limit (≥ output_len)
    hash_ids: tuple[int, ...] = ()
    hash_block: int = HASH_BLOCK
    session: str = ""
    parent: str = ""

    @property
    def peak_kv(self) -> int:
        """KV tokens held in the last decode step: the prompt plus every output token but the last."""
        return self.prompt_len + self.output_len - 1


def replay_tokens(r: Request, low: int = 1, high: int = 250) -> list[int]:
    """The token ids a live replay sends as `r`'s prompt, each in [low, high]: equal to another request's
    exactly as far as their hash ids say their prompts are equal (a hash block's tokens are a function of
    its id and their place in it), this request's own where it has none — so a live cluster's prefix
    caches, keyed on tokens, hit where the simulator's, keyed on the ids, do."""
    span = high - low + 1
    if r.hash_ids:
        block = r.hash_block
        return [low + _mix(r.hash_ids[i // block] * 1_000_003 + i % block) % span for i in range(r.prompt_len)]
    own = zlib.crc32(r.request_id.encode()) << 20
    return [low + _mix(own + i) % span for i in range(r.prompt_len)]


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fixed, well-spread function of x."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def check_workload_name(name: str) -> str:
    """The canonical spelling of a workload name (case-insensitive), or WorkloadSpecError."""
    for w in WORKLOADS:
        if w.lower() == name.strip().lower():
            return w
    raise WorkloadSpecError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")


def _lognormal(rng: np.random.Generator, median: float, mean: float, n: int) -> np.ndarray:
    sigma = math.sqrt(2.0 * math.log(mean / median))
    return rng.lognormal(math.log(median), sigma, n)


def _lengths(name: str, n: int, rng: np.random.Generator, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    light_prompt = lambda: np.clip(np.rint(rng.lognormal(math.log(LIGHT_PROMPT_MEDIAN), 1.0, n)), 2, LIGHT_PROMPT_MAX)  # noqa: E731
    light_output = lambda: rng.integers(OUTPUT_MIN, LIGHT_OUTPUT_MAX + 1, n)  # noqa: E731
    heavy_output = lambda: rng.integers(LIGHT_OUTPUT_MAX + 1, OUTPUT_MAX + 1, n)  # noqa: E731
    if name == "LPLD":
        return light_prompt(), light_output()
    if name == "LPHD":
        return light_prompt(), heavy_output()
    if name == "HPLD":
        return rng.integers(LIGHT_PROMPT_MAX + 1, max_model_len - LIGHT_OUTPUT_MAX + 1, n), light_output()
    if name == "HPHD":
        return rng.integers(LIGHT_PROMPT_MAX + 1, max_model_len // 2 + 1, n), heavy_output()
    prompt = np.clip(np.rint(_lognormal(rng, LIGHT_PROMPT_MEDIAN, SHAREGPT_PROMPT_MEAN, n)), 2, max_model_len - 128)
    output = np.maximum(1, np.rint(_lognormal(rng, SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_MEAN, n)))
    return prompt, output


def make_workload(
    name: str,
    n: int = DEFAULT_N,
    seed: int = 0,
    rate: float | None = None,
    *,
    max_model_len: int = 2048,
    kv_capacity: int | None = None,
    start: float = 0.0,
    prefix: str | None = None,
) -> list[Request]:
    """`n` requests of workload `name` arriving from `start` as a Poisson process at `rate` req/s
    (default `DEFAULT_RATES[name]`; `math.inf` = all at `start`). Outputs are cut so that each request
    fits `max_model_len` and, if given, `kv_capacity`."""
    name = check_workload_name(name)
    if n < 1:
        raise WorkloadSpecError(f"need at least one request, got n = {n}")
    rate = DEFAULT_RATES[name] if rate is None else rate
    if not rate > 0:
        raise WorkloadSpecError(f"arrival rate must be positive, got {rate}")
    if max_model_len < 2 * LIGHT_PROMPT_MAX + 2:
        raise WorkloadSpecError(f"max_model_len {max_model_len} is too short for heavy prompts and outputs")
    rng = np.random.default_rng([seed, WORKLOADS.index(name)])
    prompt, output = _lengths(name, n, rng, max_model_len)
    limit = max_model_len if kv_capacity is None else min(max_model_len, kv_capacity + 1)
    output = np.maximum(1, np.minimum(output, limit - prompt))
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    arrival = start + np.cumsum(gaps)
    tag = prefix if prefix is not None else name.lower()
    return [
        Request(f"{tag}-{i}", float(arrival[i]), int(prompt[i]), int(output[i]), max_model_len - int(prompt[i]))
        for i in range(n)
    ]


def shifting_workload(
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    first: str = "HPLD",
    then: str = "LPHD",
    rates: tuple[float, float] | None = None,
    max_model_len: int = 2048,
    kv_capacity: int | None = None,
) -> list[Request]:
    """A workload whose needs shift (the flip study): n/2 requests of `first` (prefill-heavy), then n − n/2
    of `then` (decode-heavy) arriving after the last of the first phase."""
    if n < 2:
        raise WorkloadSpecError(f"a shifting workload needs at least two requests, got n = {n}")
    r1, r2 = (
        rates
        if rates is not None
        else (DEFAULT_RATES[check_workload_name(first)], DEFAULT_RATES[check_workload_name(then)])
    )
    a = make_workload(first, n // 2, seed, r1, max_model_len=max_model_len, kv_capacity=kv_capacity, prefix="p1")
    b = make_workload(
        then,
        n - n // 2,
        seed,
        r2,
        max_model_len=max_model_len,
        kv_capacity=kv_capacity,
        start=a[-1].arrival + 1.0 / r1,
        prefix="p2",
    )
    return a + b


def describe(requests: list[Request]) -> dict[str, float]:
    """Realised length statistics (mean, median) and the arrival span, for docs and the bench."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    return {
        "n": float(len(requests)),
        "prompt_mean": float(p.mean()),
        "prompt_median": float(np.median(p)),
        "output_mean": float(o.mean()),
        "output_median": float(np.median(o)),
        "arrival_span_s": float(requests[-1].arrival - requests[0].arrival),
    }
