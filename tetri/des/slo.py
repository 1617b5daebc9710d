"""Latency SLOs and who meets them: the goodput side of the metrics (`metrics.py`).

A request meets its SLO when its TTFT and its TPOT ((JCT − TTFT) / (output − 1), refs: DistServe's
definition) are both within its class's targets. Classes are the paper's workload classes, decided per
request by its own lengths: a prompt is heavy above 512 tokens, an answer above 128 (refs), so a Mixed
workload's summarisation-like requests can carry a looser TTFT than its chats. A class without targets of
its own uses the default.

Spec strings, as `tetrictl bench --slo` takes them (repeatable): ``ttft=1,tpot=0.1`` sets the default;
``HPLD:ttft=5`` sets one class (an omitted target is the default's). Seconds. Pure: plain data in and out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from .records import RequestRecord
from .workloads import LIGHT_OUTPUT_MAX, LIGHT_PROMPT_MAX, WORKLOADS, WorkloadSpecError

CLASSES = tuple(w for w in WORKLOADS if w != "Mixed")  # LPLD, LPHD, HPLD, HPHD
DEFAULT_TTFT_S = 1.0  # the example SLO: TTFT p99 ≤ 1 s …
DEFAULT_TPOT_S = 0.1  # … and TPOT p99 ≤ 100 ms (assumed; every table prints the SLO it used)


@dataclass(frozen=True)
class Slo:
    ttft_s: float = DEFAULT_TTFT_S
    tpot_s: float = DEFAULT_TPOT_S

    def __post_init__(self) -> None:
        for name, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s)):
            if not (v > 0 and math.isfinite(v)):
                raise WorkloadSpecError(f"SLO {name} must be a positive number of seconds, got {v}")

    def met(self, r: RequestRecord) -> bool:
        return r.ttft <= self.ttft_s and r.tpot <= self.tpot_s

    def label(self) -> str:
        return f"TTFT ≤ {_s(self.ttft_s)}, TPOT ≤ {_s(self.tpot_s)}"


def _s(x: float) -> str:
    return f"{x * 1000:g} ms" if x < 1 else f"{x:g} s"


def request_class(prompt_len: int, output_len: int) -> str:
    """The paper's class of one request from its own lengths (refs: heavy prompt > 512, heavy answer > 128)."""
    return ("HP" if prompt_len > LIGHT_PROMPT_MAX else "LP") + ("HD" if output_len > LIGHT_OUTPUT_MAX else "LD")


@dataclass(frozen=True)
class SloSet:
    """The default targets and per-class overrides (keys from `CLASSES`)."""

    default: Slo = field(default_factory=Slo)
    by_class: Mapping[str, Slo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in self.by_class:
            if k not in CLASSES:
                raise WorkloadSpecError(f"unknown SLO class {k!r} (choose from {', '.join(CLASSES)})")

    def for_request(self, r: RequestRecord) -> Slo:
        return self.by_class.get(request_class(r.prompt_len, r.output_len), self.default)

    def met(self, r: RequestRecord) -> bool:
        return self.for_request(r).met(r)

    def label(self) -> str:
        parts = [self.default.label()]
        parts += [f"{k}: {v.label()}" for k, v in sorted(self.by_class.items())]
        return "; ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {
            "default": {"ttft_s": self.default.ttft_s, "tpot_s": self.default.tpot_s},
            "by_class": {k: {"ttft_s": v.ttft_s, "tpot_s": v.tpot_s} for k, v in sorted(self.by_class.items())},
            "label": self.label(),
        }


DEFAULT_SLO = SloSet()


def parse_slos(specs: Iterable[str]) -> SloSet:
    """`SloSet` from spec strings (module docstring); WorkloadSpecError names the bad part."""
    default = Slo()
    classes: dict[str, dict[str, float]] = {}
    for spec in specs:
        text = spec.strip()
        cls = None
        if ":" in text:
            cls, text = (x.strip() for x in text.split(":", 1))
            canon = {c.lower(): c for c in CLASSES}.get(cls.lower())
            if canon is None:
                raise WorkloadSpecError(f"--slo {spec!r}: unknown class {cls!r} (choose from {', '.join(CLASSES)})")
            cls = canon
        targets: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip().lower()
            if not eq or key not in ("ttft", "tpot"):
                raise WorkloadSpecError(f"--slo {spec!r}: expected ttft=SECONDS and/or tpot=SECONDS, got {part!r}")
            try:
                targets[key] = float(value)
            except ValueError:
                raise WorkloadSpecError(f"--slo {spec!r}: {key} must be a number of seconds, got {value!r}") from None
        if not targets:
            raise WorkloadSpecError(f"--slo {spec!r}: names no target (ttft=SECONDS, tpot=SECONDS)")
        if cls is None:
            default = replace(default, **{f"{k}_s": v for k, v in targets.items()})
        else:
            classes.setdefault(cls, {}).update(targets)
    by_class = {c: Slo(t.get("ttft", default.ttft_s), t.get("tpot", default.tpot_s)) for c, t in classes.items()}
    return SloSet(default, by_class)
