"""What the dashboard shows, computed from the API's documents: plain functions, no widgets, no I/O."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape

from tetri.scheduling.flip import InstanceView, TransitionWatcher

BLOCKS = "▁▂▃▄▅▆▇█"
QUEUE_FULL = TransitionWatcher.queue_full  # queued requests that count as a fully loaded instance
HISTORY = 60  # samples kept per sparkline (30 s at 2 Hz)


def load(inst: dict[str, Any]) -> float:
    """An instance's load as the flip watcher sees it: KV usage or queue pressure, whichever is higher."""
    view = InstanceView(inst["id"], inst["role"], inst["state"], inst["kv_usage"], inst["queued"])
    return view.load(QUEUE_FULL)


def spark(values: Iterable[float], width: int = 12, top: float = 1.0) -> str:
    """A text sparkline of the last ``width`` values scaled to ``top``."""
    vals = list(values)[-width:]
    if not vals:
        return ""
    hi = max(top, max(vals)) or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, round(v / hi * (len(BLOCKS) - 1)))] for v in vals)


@dataclass
class History:
    """Rolling samples: per-instance load, cluster TTFT and JCT (means over the latest finished requests)."""

    loads: dict[str, deque[float]] = field(default_factory=dict)
    ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    jct_ms: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def add_instances(self, instances: Sequence[dict[str, Any]]) -> None:
        for inst in instances:
            self.loads.setdefault(inst["id"], deque(maxlen=HISTORY)).append(load(inst))

    def add_finished(self, rows: Sequence[dict[str, Any]]) -> None:
        ttft = [r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None]
        jct = [r["jct_ms"] for r in rows if r.get("jct_ms") is not None]
        if ttft:
            self.ttft_ms.append(sum(ttft) / len(ttft))
        if jct:
            self.jct_ms.append(sum(jct) / len(jct))


def instance_cells(inst: dict[str, Any], history: History) -> tuple[str, ...]:
    return (
        inst["id"],
        inst["role"],
        str(inst["state"]),  # active / draining / flipping / unhealthy
        f"{inst['queued']:,}",
        f"{inst['running']:,}",
        f"{100 * inst['kv_usage']:.0f}%",
        f"{inst['tokens_per_s']:,.0f}",
        spark(history.loads.get(inst["id"], ())),
    )


INSTANCE_COLUMNS = ("instance", "role", "state", "queue", "running", "KV", "tok/s", "load")
REQUEST_COLUMNS = ("request", "phase", "status", "prompt", "output", "TTFT ms", "JCT ms", "prefill", "decode")


def request_cells(r: dict[str, Any]) -> tuple[str, ...]:
    def ms(v: Any) -> str:
        return "—" if v is None else f"{v:,.0f}"

    return (
        r["id"],
        r["phase"],
        r["status"],
        f"{r['prompt_tokens']:,}",
        f"{r['output_tokens'] or 0:,}",
        ms(r.get("ttft_ms")),
        ms(r.get("jct_ms")),
        r.get("prefill_instance") or "—",
        r.get("decode_instance") or "—",
    )


def timeline_text(doc: dict[str, Any], width: int = 24) -> str:
    """One request's timeline: arrival → prefill → first token → decode → done, ms after arrival, as bars."""
    points = doc.get("timeline") or []
    if not points:
        return f"{doc.get('id', '?')}: no timeline yet"
    t0 = points[0]["ts"]
    end = max(p["ts"] for p in points)
    span = max(end - t0, 1e-9)
    lines = [
        f"[b]{escape(str(doc['id']))}[/b]  {doc.get('status', '')}  prompt {doc.get('prompt_tokens', '?')} → "
        f"output {doc.get('output_tokens') or 0} tokens",
        f"prefill on {doc.get('prefill_instance') or '—'}, decode on {doc.get('decode_instance') or '—'}",
    ]
    for p in points:
        off = p["ts"] - t0
        bar = "█" * max(1, round(off / span * width)) if off > 0 else "│"
        lines.append(f"{p['phase']:<12} {1000 * off:>10,.1f} ms  {bar}")
    if doc.get("error"):
        lines.append(f"[red]error: {escape(str(doc['error']))}[/red]")
    return "\n".join(lines)
