"""What a cluster run produced — per request, per instance, flips and totals — in plain data. The
simulator (`cluster.py`) and the live bench runner (`tetrictl/bench_live.py`) both produce a `RunResult`,
so every table and metric (`metrics.py`) works on either."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    """One request's life. Times are seconds of model time; `decode_start` is the start of its first
    decode step (None if its only token came from the prefill)."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    prefill_start: float
    first_token: float
    decode_start: float | None
    finish: float
    prefill_instance: str
    decode_instance: str | None
    preemptions: int
    predicted: tuple[int, int] | None
    cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache (not computed)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def jct(self) -> float:
        return self.finish - self.arrival

    @property
    def prefill_wait(self) -> float:
        return self.prefill_start - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first, (JCT − TTFT) / (output − 1) (DistServe's, refs); 0 for a
        one-token answer (it has no decode)."""
        return (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass(frozen=True)
class RejectedRecord:
    """A request its instance turned away (`ttft_miss` reject: it waited past its TTFT target), at
    `rejected` seconds of model time; it produced nothing (the live daemon answered it 429)."""

    request_id: str
    arrival: float
    rejected: float
    instance: str


@dataclass(frozen=True)
class InstanceRecord:
    """One instance (= one GPU): roles held in order, seconds spent in iterations, and the span from
    its first activity (start of its first iteration) to its last (end of its last iteration, or of the
    last KV transfer out of it)."""

    instance_id: str
    roles: tuple[str, ...]
    busy_s: float
    first_activity: float | None
    last_activity: float | None
    prefill_iterations: int
    decode_iterations: int
    mixed_iterations: int = 0  # vllm-v1: prefill chunks batched with decodes
    prefix_query_tokens: int = 0  # its prefix cache: prompt tokens looked up, and found (new requests)
    prefix_hit_tokens: int = 0

    @property
    def span_s(self) -> float:
        if self.first_activity is None or self.last_activity is None:
            return 0.0
        return self.last_activity - self.first_activity


@dataclass(frozen=True)
class FlipRecord:
    instance_id: str
    from_role: str
    to_role: str
    reason: str
    started: float  # the watcher's decision: drain begins
    drained: float  # no work left on it
    done: float  # serving the new role


@dataclass(frozen=True)
class RunResult:
    """What a run produced: per request, per instance, flips and totals. A live runner produces the same."""

    requests: list[RequestRecord]
    instances: list[InstanceRecord]
    flips: list[FlipRecord]
    preemptions: int
    padding_tokens: int  # chunk padding: prefill compute spent on no token
    recomputed_tokens: int  # KV rebuilt after preemptions
    makespan: float  # first arrival → last finish: the wall time the provisioned GPUs are paid for
    events: int
    gpus: int = 0  # instances provisioned (one GPU each), whether or not they ever ran; 0: len(instances)
    rejected: list[RejectedRecord] = field(default_factory=list)  # not in `requests`: nothing was served

    @property
    def offered(self) -> int:
        """Requests that arrived: those served and those rejected."""
        return len(self.requests) + len(self.rejected)

    @property
    def provisioned(self) -> int:
        return self.gpus or len(self.instances)

    @property
    def prefix_hit_ratio(self) -> float:
        """Prompt tokens found in the instances' prefix caches over those looked up (vLLM's hit rate)."""
        queried = sum(i.prefix_query_tokens for i in self.instances)
        return sum(i.prefix_hit_tokens for i in self.instances) / queried if queried else 0.0
