"""How an engine picks tokens: the plain data the daemon resolves from a request (and the model's
defaults) and a worker hands to its engine (vLLM's SamplingParams; the sim engine's tokens ignore it).
The wire form is `tetri.proto`'s `Sampling`; each side converts at its gRPC edge."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # the request ends after any of these (counted, like vLLM)
    ignore_eos: bool = False


GREEDY = Sampling()  # the default: greedy, no stop token
