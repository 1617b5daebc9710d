"""docs/monitoring: the Prometheus scrape configuration and the Grafana dashboard name only what a live
daemon's /metrics exports — every metric in every query, every label in a `by (…)` or a legend."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.harness import start_cluster

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[1] / "docs" / "monitoring"


def exported(text: str) -> dict[str, set[str]]:
    """Sample name → label names, from a /metrics page (a family with no sample yet counts by name)."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(fam.type, [""])
        for suffix in suffixes:
            out.setdefault(fam.name + suffix, set())
        for s in fam.samples:
            out.setdefault(s.name, set()).update(set(s.labels) - {"le"})
    return out


def test_scrape_config_and_dashboard_match_the_daemon(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=1.0)
    try:
        with httpx.Client(base_url=c.url, timeout=60) as h:
            h.post("/v1/completions", json={"model": "tetri-sim", "prompt": "a", "max_tokens": 3})  # a status
            body = {"model": "tetri-sim", "prompt": "b", "max_tokens": 400, "stream": True}
            with h.stream("POST", "/v1/completions", json=body) as s:  # in flight while scraped: a phase
                next(line for line in s.iter_lines() if line.startswith("data: {"))
                page = h.get("/metrics")
        scrape = yaml.safe_load((DOCS / "prometheus.yml").read_text())
        job = scrape["scrape_configs"][0]
        assert page.status_code == 200 and job["metrics_path"] == page.url.path
        assert all(re.fullmatch(r"[\w.\-]+:\d+", t) for sc in job["static_configs"] for t in sc["targets"])
    finally:
        c.stop()
    metrics = exported(page.text)
    dash = json.loads((DOCS / "grafana-tetri.json").read_text())
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 10
    used = set()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        for t in panel["targets"]:
            names = set(re.findall(r"\btetri_\w+", t["expr"]))
            assert names, t["expr"]
            used |= names
            for name in names:
                assert name in metrics, f"{panel['title']}: {name} is not exported"
            labels = set(re.findall(r"by \(([^)]*)\)", t["expr"])) | set(re.findall(r"{{(\w+)}}", t["legendFormat"]))
            labels = {x.strip() for group in labels for x in group.split(",")} - {"le"}
            have = set().union(*(metrics[n] for n in names))
            assert labels <= have, f"{panel['title']}: labels {labels - have} are not on {names}"
    # and the dashboard shows every family (`_created`: prometheus_client's counter creation times)
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in metrics if not n.endswith("_created")}
    assert families <= {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used} | {"tetri_instance_kv_used_tokens"}
