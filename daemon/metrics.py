"""Prometheus metrics (one registry per daemon): request counts, TTFT/JCT/ITL histograms, tokens, and
per-instance load read from the cluster at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ClusterCollector(Collector):
    def __init__(self, source: Callable[[], tuple[list[dict[str, Any]], dict[str, int]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        instances, phases = self.source()
        depth = GaugeMetricFamily("tetri_queue_depth", "Requests in flight by phase", labels=["phase"])
        for phase, n in phases.items():
            depth.add_metric([phase], n)
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


class Metrics:
    def __init__(self, source: Callable[[], tuple[list[dict[str, Any]], dict[str, int]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tetri_requests", "Requests by final status", ["status"], registry=self.registry)
        self.tokens = Counter("tetri_generated_tokens", "Output tokens streamed", registry=self.registry)
        self.migrations = Counter(
            "tetri_request_migrations", "Requests moved off an instance that died mid-request", registry=self.registry
        )
        self.ttft = Histogram("tetri_ttft_seconds", "Time to first token", buckets=_LAT, registry=self.registry)
        self.jct = Histogram("tetri_jct_seconds", "Job completion time", buckets=_LAT, registry=self.registry)
        self.itl = Histogram("tetri_itl_seconds", "Inter-token latency", buckets=_LAT, registry=self.registry)
        self.registry.register(_ClusterCollector(source))
        self.predictor_accuracy = Gauge(
            "tetri_predictor_accuracy", "Length predictor bucket accuracy", ["kind"], registry=self.registry
        )

    def watch_predictor(self, service: Any) -> None:
        """Live and held-out accuracy of the length predictor, read at scrape time."""
        self.predictor_accuracy.labels(kind="live").set_function(lambda: service.stats.live_accuracy or 0.0)
        self.predictor_accuracy.labels(kind="holdout").set_function(lambda: service.stats.holdout_accuracy or 0.0)
