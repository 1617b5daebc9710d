"""The set of runtime policies an operator reads and changes (hot-swap): one validated value object.

`PolicySet.changed(**fields)` returns a new set or raises `PolicyError` naming the bad field; the daemon
applies it without restart and records each changed field in the audit table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .colocated import COLOCATED_SCHEDULES
from .dispatch import DISPATCH_POLICIES
from .flip import FLIP_POLICIES
from .names import ADMISSION_POLICIES, PREDICTORS, QUEUE_ORDERS, RESERVE_POINTS, TTFT_MISSES
from .prefill import PREFILL_POLICIES
from .routing import PD_ROUTES, ROUTINGS


class PolicyError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PolicySet:
    prefill_policy: str = "fcfs"  # fcfs | sjf | ljf
    prefill_sched_batch: int = 16  # PrefillSchedBatch
    chunk_size: int = 512  # ChunkSize, tokens per prefill iteration
    predictor: str = "none"  # none | oracle | learned
    predictor_accuracy: float = 1.0  # oracle only
    predictor_granularity: int = 200
    dispatch: str = "least-kv"  # pot | least-kv
    decode_admission: str = "greedy"  # greedy | reserve-static | reserve-dynamic | plan
    reserve_point: str = "lower"  # lower | mid | upper: the point of a predicted bucket policies count
    flip_policy: str = "off"  # off | idle | advise
    flip_low: float = 0.10
    flip_high: float = 0.80
    flip_window_s: float = 60.0
    colocated_schedule: str = "prefill-first"  # prefill-first | vllm-v0 | vllm-v1 (tetri.scheduling.colocated)
    queue_order: str = "fcfs"  # fcfs | srpt: the order decode and colocated instances admit waiting requests in
    aging_admissions: int = 256  # srpt: a request waiting while this many others are admitted goes first
    ttft_target_s: float = 0.0  # colocated: requests that waited past it go after those that can meet it
    # (until aging_admissions others were admitted); 0: off
    ttft_miss: str = "last"  # last (as above) | reject: a request past ttft_target_s leaves, answered 429 (on
    # prefill instances too: a prompt with no chunk run yet)
    token_budget: int = 0  # vllm-v1: tokens an iteration while no prompt is urgent (instance.py); 0: the
    # engine's max_num_batched_tokens
    pd_route: str = "role"  # role | split | length: colocated or split, per request (tetri.scheduling.routing)
    pd_prompt_tokens: int = 1024  # length: prompts this long run split
    pd_output_tokens: int = 0  # length: and requests predicted to produce this many tokens; 0: not considered
    pd_backlog_slack: int = 0  # length: the other path when the chosen one has more than this many more
    # requests waiting; 0: the length alone decides
    routing: str = "cache-aware"  # cache-aware | least-load | round-robin: the entry instance (routing.py)
    cache_slack: int = 4  # cache-aware: an instance holding the prompt's prefix is chosen only while its
    # backlog is within this many requests of the least-loaded instance's (the saturation guard)

    def __post_init__(self) -> None:
        choices = {
            "prefill_policy": PREFILL_POLICIES,
            "predictor": PREDICTORS,
            "dispatch": DISPATCH_POLICIES,
            "decode_admission": ADMISSION_POLICIES,
            "reserve_point": RESERVE_POINTS,
            "flip_policy": FLIP_POLICIES,
            "colocated_schedule": COLOCATED_SCHEDULES,
            "queue_order": QUEUE_ORDERS,
            "ttft_miss": TTFT_MISSES,
            "pd_route": PD_ROUTES,
            "routing": ROUTINGS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise PolicyError(name, f"unknown value {getattr(self, name)!r} (choose from {', '.join(allowed)})")
        for name in (
            "prefill_sched_batch",
            "chunk_size",
            "predictor_granularity",
            "aging_admissions",
            "pd_prompt_tokens",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PolicyError(name, f"must be a positive integer, got {v!r}")
        for name in ("predictor_accuracy", "flip_low", "flip_high", "flip_window_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
                raise PolicyError(name, f"must be a number, got {v!r}")
        v = self.pd_output_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PolicyError("pd_output_tokens", f"must be a number of tokens ≥ 0 (0: not considered), got {v!r}")
        v = self.pd_backlog_slack
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PolicyError("pd_backlog_slack", f"must be a number of requests ≥ 0 (0: off), got {v!r}")
        v = self.cache_slack
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PolicyError("cache_slack", f"must be a number of requests ≥ 0, got {v!r}")
        v = self.token_budget
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PolicyError("token_budget", f"must be a number of tokens ≥ 0 (0: the engine's), got {v!r}")
        v = self.ttft_target_s
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or not 0 <= v < math.inf:
            raise PolicyError("ttft_target_s", f"must be a number of seconds ≥ 0 (0: off), got {v!r}")
        if not 0 <= self.predictor_accuracy <= 1:
            raise PolicyError("predictor_accuracy", "must be within [0, 1]")
        if not 0 <= self.flip_high <= 1:
            raise PolicyError("flip_high", "must be within [0, 1]")
        if not 0 <= self.flip_low < self.flip_high:
            raise PolicyError("flip_low", "flip thresholds need 0 ≤ flip_low < flip_high ≤ 1")
        if not self.flip_window_s > 0 or math.isinf(self.flip_window_s):
            raise PolicyError("flip_window_s", "must be a positive number of seconds")

    def changed(self, **fields: Any) -> PolicySet:
        names = {f.name for f in dataclasses.fields(self)}
        for k in fields:
            if k not in names:
                raise PolicyError(k, "unknown policy field")
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
