"""Prometheus metrics (one registry per daemon): request counts, TTFT/JCT/ITL histograms, tokens, and
per-instance load read from the cluster at scrape time.

The histograms and the token count are fed on the per-token path from the event loop, so they are plain
tallies (`Tally`, `Tokens`) read by a collector at scrape time: prometheus_client's own take a lock per
bucket, per sum and per count, about 20 µs a token on this project's machines (docs/vllm.md)."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .db.models import Phase

IN_FLIGHT = tuple(p.value for p in Phase if p != Phase.DONE)
_CPU = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
_DELAY = (1e-3, 2.5e-3, 5e-3, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_LAG = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ClusterCollector(Collector):
    def __init__(self, source: Callable[[], tuple[list[dict[str, Any]], dict[str, int]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        instances, phases = self.source()
        depth = GaugeMetricFamily("tetri_queue_depth", "Requests in flight by phase", labels=["phase"])
        for phase in IN_FLIGHT:  # every phase, 0 included: a series that vanishes at 0 graphs as a gap
            depth.add_metric([phase], phases.get(phase, 0))
        yield depth
        specs = [
            ("tetri_instance_queued", "Requests queued on the instance", "queued"),
            ("tetri_instance_running", "Requests running on the instance", "running"),
            ("tetri_instance_kv_usage_ratio", "KV cache usage (0-1)", "kv_usage"),
            ("tetri_instance_kv_used_tokens", "KV cache used, tokens", "kv_used_tokens"),
            ("tetri_instance_held_kv_tokens", "Prefill KV not yet pulled by a decode instance", "held_kv_tokens"),
            ("tetri_instance_tokens_per_second", "Tokens produced per (model) second", "tokens_per_s"),
            ("tetri_instance_healthy", "1 if the instance is active", None),
        ]
        for name, doc, key in specs:
            g = GaugeMetricFamily(name, doc, labels=["instance", "role"])
            for inst in instances:
                value = (1.0 if inst["state"] == "active" else 0.0) if key is None else float(inst[key])
                g.add_metric([inst["id"], inst["role"]], value)
            yield g
        # each engine's own prefix-cache counters, as its load reports give them (vLLM's prefix_cache_queries
        # and prefix_cache_hits, in tokens): *_total series, reset when the engine restarts
        counters = [
            (
                "tetri_prefix_cache_query_tokens",
                "Prompt tokens looked up in the instance's prefix cache",
                "prefix_query_tokens",
            ),
            (
                "tetri_prefix_cache_hit_tokens",
                "Prompt tokens found in the instance's prefix cache",
                "prefix_hit_tokens",
            ),
        ]
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc, labels=["instance"])
            for inst in instances:
                c.add_metric([inst["id"]], float(inst[key]))
            yield c
        index = GaugeMetricFamily(
            "tetri_prefix_index_blocks",
            "Blocks the control plane's index says the instance's prefix cache holds",
            labels=["instance"],
        )
        for inst in instances:
            index.add_metric([inst["id"]], float(inst.get("index_blocks", 0)))
        yield index


class Tally(Collector):
    """A histogram observed from one thread (the event loop): a bisect and two additions."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: Prometheus' `le`
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """The histogram as the admin API gives it: per-bucket counts (`counts[i]`: values at most
        `bounds[i]` and above the bound before; the last: above every bound), their `count` and `sum`.
        Two snapshots' difference is the window between them, as Prometheus' rate() takes it."""
        counts = list(self.counts)
        return {"bounds": list(self.bounds), "counts": counts, "count": sum(counts), "sum": self.sum}

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, n in zip([*map(floatToGoString, self.bounds), "+Inf"], counts, strict=True):
            running += n
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=total)


class Tokens(Collector):
    """The output-token counter, observed from the event loop."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int) -> None:
        self.value += n

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("tetri_generated_tokens", "Output tokens streamed", value=self.value)


class Metrics:
    def __init__(self, source: Callable[[], tuple[list[dict[str, Any]], dict[str, int]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tetri_requests", "Requests by final status", ["status"], registry=self.registry)
        self.tokens = Tokens()
        self.migrations = Counter(
            "tetri_request_migrations", "Requests moved off an instance that died mid-request", registry=self.registry
        )
        self.ttft = Tally("tetri_ttft_seconds", "Time to first token", _LAT)
        self.jct = Tally("tetri_jct_seconds", "Job completion time", _LAT)
        self.itl = Tally("tetri_itl_seconds", "Inter-token latency", _LAT)
        # the control plane's own work, which grows with the instance count (bench/scale_bench.py)
        self.route = Tally("tetri_route_seconds", "Choosing a request's entry instance (wall, daemon)", _CPU)
        self.report = Tally(
            "tetri_report_seconds", "Taking one load report and building its decode-load broadcast (wall, daemon)", _CPU
        )
        self.broadcast_delay = Tally(
            "tetri_broadcast_delay_seconds",
            "From a decode instance's report of a new load to the first broadcast showing it (wall, daemon)",
            _DELAY,
        )
        # how late the event loop runs what is ready: every relayed token and every load report waits as long
        self.loop_lag = Tally(
            "tetri_loop_lag_seconds", "How late the daemon's event loop wakes a timer (wall; see sample_loop_lag)", _LAG
        )
        tallies = (self.ttft, self.jct, self.itl, self.route, self.report, self.broadcast_delay, self.loop_lag)
        for c in (self.tokens, *tallies, _ClusterCollector(source)):
            self.registry.register(c)
        self.predictor_accuracy = Gauge(
            "tetri_predictor_accuracy", "Length predictor bucket accuracy", ["kind"], registry=self.registry
        )
        self.store_up = Gauge(
            "tetri_store_up", "1 while the status table takes writes, 0 while it is unavailable", registry=self.registry
        )
        self.store_buffered = Gauge(
            "tetri_store_buffered_rows",
            "Status-table rows held in memory, not written yet (past store_buffer_rows new requests get 503)",
            registry=self.registry,
        )

    def latency(self) -> dict[str, dict[str, Any]]:
        """TTFT, JCT and ITL histograms (seconds, cluster clock) since the daemon started."""
        return {"ttft_s": self.ttft.snapshot(), "jct_s": self.jct.snapshot(), "itl_s": self.itl.snapshot()}

    def watch_predictor(self, service: Any) -> None:
        """Live and held-out accuracy of the length predictor, read at scrape time."""
        self.predictor_accuracy.labels(kind="live").set_function(lambda: service.stats.live_accuracy or 0.0)
        self.predictor_accuracy.labels(kind="holdout").set_function(lambda: service.stats.holdout_accuracy or 0.0)

    def watch_store(self, writer: Any) -> None:
        """Whether the status table takes writes, and the rows held for it (`BatchWriter`), at scrape time."""
        self.store_up.set_function(lambda: float(writer.outage is None))
        self.store_buffered.set_function(lambda: float(writer.buffered))


async def sample_loop_lag(tally: Tally, period_s: float = 0.05) -> None:
    """Observe, every `period_s`, how much later than asked the event loop woke this task: the time a
    ready callback (a token to relay, a report to answer) waits behind the rest of the loop's work."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + period_s
        await asyncio.sleep(period_s)
        tally.observe(max(0.0, loop.time() - asked))
