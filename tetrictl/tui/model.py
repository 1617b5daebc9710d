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


WINDOW_S = 10.0  # the cluster TTFT/JCT window: the daemon's histograms, differenced over this long


def quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The q-quantile of a histogram as Prometheus' histogram_quantile() estimates it: linear within the
    bucket it falls in (from 0 for the first); in the last (above every bound), the highest bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * (rank - seen) / n
        seen += n
    return bounds[-1]


@dataclass(frozen=True)
class Window:
    """One latency histogram over a window: how many requests, their mean, p50 and p99 (seconds)."""

    count: int
    mean: float
    p50: float
    p99: float

    @classmethod
    def between(cls, old: dict[str, Any], new: dict[str, Any]) -> Window | None:
        """The requests observed between two snapshots of one daemon histogram (`latency` in
        /api/v1/cluster); None when there were none (or the daemon restarted and its counts fell)."""
        counts = [b - a for a, b in zip(old["counts"], new["counts"], strict=True)]
        n = sum(counts)
        if n <= 0 or min(counts) < 0:
            return None
        p50, p99 = (quantile(q, new["bounds"], counts) or 0.0 for q in (0.5, 0.99))
        return cls(n, (new["sum"] - old["sum"]) / n, p50, p99)


@dataclass
class History:
    """Rolling samples: per-instance load, and the cluster's TTFT and JCT over the last `WINDOW_S`,
    from the daemon's histograms (the same ones /metrics exports)."""

    samples: int = 20  # latency snapshots kept: WINDOW_S over the refresh period
    loads: dict[str, deque[float]] = field(default_factory=dict)
    ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    jct_ms: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    snapshots: deque[dict[str, Any]] = field(default_factory=deque)
    ttft: Window | None = None
    jct: Window | None = None

    def add_instances(self, instances: Sequence[dict[str, Any]]) -> None:
        for inst in instances:
            self.loads.setdefault(inst["id"], deque(maxlen=HISTORY)).append(load(inst))

    def add_latency(self, latency: dict[str, Any]) -> None:
        """One refresh's `latency` document; the window is from the oldest snapshot kept to this one."""
        self.snapshots.append(latency)
        while len(self.snapshots) > self.samples + 1:
            self.snapshots.popleft()
        old = self.snapshots[0]
        self.ttft = Window.between(old["ttft_s"], latency["ttft_s"])
        self.jct = Window.between(old["jct_s"], latency["jct_s"])
        if self.ttft is not None:
            self.ttft_ms.append(1000 * self.ttft.mean)
        if self.jct is not None:
            self.jct_ms.append(1000 * self.jct.mean)


def window_text(name: str, w: Window | None) -> str:
    """A latency label (fits the cluster pane at 160 columns): how many requests the window holds, and
    their mean, p50 and p99 in ms."""
    if w is None:
        return f"{name} ms ({WINDOW_S:g} s): none finished"
    ms = [f"{1000 * v:,.0f}" for v in (w.mean, w.p50, w.p99)]
    return f"{name} ms ({WINDOW_S:g} s, {w.count:,} req): mean {ms[0]} · p50 {ms[1]} · p99 {ms[2]}"


def instance_cells(inst: dict[str, Any], history: History) -> tuple[str, ...]:
    return (
        inst["id"],
        inst["role"],
        f"{inst['state']},cordoned" if inst.get("cordoned") else str(inst["state"]),  # active / draining / …
        f"{inst['queued']:,}",
        f"{inst['running']:,}",
        f"{100 * inst['kv_usage']:.0f}%",
        "—" if inst.get("prefix_hit_ratio") is None else f"{100 * inst['prefix_hit_ratio']:.0f}%",
        f"{inst['tokens_per_s']:,.0f}",
        spark(history.loads.get(inst["id"], ())),
    )


# "hit": the prefix cache's hit ratio (prompt tokens found cached over those looked up)
INSTANCE_COLUMNS = ("instance", "role", "state", "queue", "running", "KV", "hit", "tok/s", "load")
# fits the requests pane at 160 columns (no sideways scrolling); the detail pane has both instances
REQUEST_COLUMNS = ("request", "state", "prompt", "output", "TTFT ms", "JCT ms", "instance")


def request_cells(r: dict[str, Any]) -> tuple[str, ...]:
    """A request's row: its phase while it runs, else how it ended; the instance serving it (last)."""

    def ms(v: Any) -> str:
        return "—" if v is None else f"{v:,.0f}"

    return (
        r["id"],
        r["phase"] if r["status"] == "running" else r["status"],
        f"{r['prompt_tokens']:,}",
        f"{r['output_tokens'] or 0:,}",
        ms(r.get("ttft_ms")),
        ms(r.get("jct_ms")),
        r.get("decode_instance") or r.get("prefill_instance") or "—",
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
