"""`stream_interval` (as vLLM's `--stream-interval`): a daemon started with N sends a streamed answer's first
token at once and then one SSE event per N tokens, over a real daemon and sim worker; the tokens and text
are those of the answer unstreamed, in order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tetrictl.client import SseStream

from .harness import LiveCluster, start_cluster

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    root: Path = tmp_path_factory.mktemp("interval")
    c = start_cluster(root, ["colocated"], mode="colocated", env={"TETRI_DAEMON_STREAM_INTERVAL": "4"})
    try:
        yield c
    finally:
        c.stop()


def test_events_carry_the_first_token_then_four_at_a_time(cluster: LiveCluster) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 14, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = [doc["choices"][0] for doc in SseStream(r)]
    sizes = [len(e["token_ids"]) for e in events]
    assert sizes == [1, 4, 4, 4, 1, 0], sizes  # the last: the finishing chunk, no tokens
    assert [t for e in events for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert events[-1]["finish_reason"] == "length"
