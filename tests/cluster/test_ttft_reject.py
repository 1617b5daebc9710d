"""`ttft_miss` reject, live: over a real daemon and a colocated sim worker, requests that cannot start
within `ttft_target_s` (two long requests fill the KV cache) are answered 429 with Retry-After and an
OpenAI error body — streamed or not: a stream sends nothing before its first token, so it can still be a
429 — and recorded `rejected`; the requests already running are served whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tetrictl.client import SseStream

from .harness import LiveCluster, all_rows, start_cluster

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"
TARGET_S = 0.2  # model seconds; time scale 1 (model time = wall time)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    root: Path = tmp_path_factory.mktemp("reject")
    c = start_cluster(root, ["colocated"], mode="colocated", time_scale=1.0)
    try:
        yield c
    finally:
        c.stop()


def test_requests_past_the_ttft_target_get_429_and_are_recorded_rejected(cluster: LiveCluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as h:
        changes = {"colocated_schedule": "vllm-v1", "ttft_target_s": TARGET_S, "ttft_miss": "reject"}
        assert h.put("/api/v1/policies", json=changes).status_code == 200
    # two fillers hold 2 × (1500 + 500) of the tiny profile's 4,192 KV tokens for about 3 s
    filler = {"model": MODEL, "prompt": [7] * 1500, "max_tokens": 500, "ignore_eos": True, "stream": True}
    started = [threading.Event(), threading.Event()]
    served: list[int] = []

    def fill(i: int) -> None:
        n = 0
        with httpx.stream(
            "POST", cluster.url + "/v1/completions", json=filler | {"prompt": [7 + i] * 1500}, timeout=60
        ) as r:
            assert r.status_code == 200
            for doc in SseStream(r):
                n += len(doc["choices"][0]["text"]) > 0
                started[i].set()
        served.append(n)

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a filler never started"
    # these cannot fit beside the fillers (1,300 more prompt tokens): each waits past the target
    late = {"model": MODEL, "prompt": [9] * 1300, "max_tokens": 5}
    plain = httpx.post(cluster.url + "/v1/completions", json=late, timeout=60)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1300}], "max_tokens": 5}
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=chat | {"stream": True}, timeout=60) as r:
        r.read()
        streamed = r
    for got in (plain, streamed):
        assert got.status_code == 429, got.text
        assert got.headers["retry-after"] == "1"
        err = orjson.loads(got.content)["error"]
        assert err["code"] == "ttft_target_missed" and err["type"] == "RateLimitError"
        assert "TTFT target" in err["message"]
    for t in threads:
        t.join(60)
    assert len(served) == 2  # the fillers were not disturbed
    deadline = time.monotonic() + 10  # each row's last update is written after its answer
    rows = all_rows(cluster.db_url)
    while any(r["status"] == "running" for r in rows.values()):
        assert time.monotonic() < deadline, "rows still running"
        time.sleep(0.05)
        rows = all_rows(cluster.db_url)
    rejected = [r for r in rows.values() if r["status"] == "rejected"]
    assert len(rejected) == 2 and all("TTFT target" in (r["error"] or "") for r in rejected)
    assert sum(r["status"] == "finished" for r in rows.values()) == 2


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    root: Path = tmp_path_factory.mktemp("reject-split")
    c = start_cluster(root, ["prefill", "decode"], time_scale=1.0)
    try:
        yield c
    finally:
        c.stop()


def test_a_prefill_instance_rejects_too_and_the_client_gets_429(split: LiveCluster) -> None:
    """The split path: a burst of long prompts queues on the one prefill instance; those that waited past
    the target with no chunk run are answered 429 and recorded rejected, the rest served whole."""
    with httpx.Client(base_url=split.url, timeout=60) as h:
        changes = {"ttft_target_s": 0.05, "ttft_miss": "reject"}
        assert h.put("/api/v1/policies", json=changes).status_code == 200
        version = h.get("/api/v1/policies").json()["version"]
        deadline = time.monotonic() + 10
        while {i["policy_version"] for i in h.get("/api/v1/instances").json()["instances"]} != {version}:
            assert time.monotonic() < deadline, "the workers never took the policies"
            time.sleep(0.05)
    answers: list[httpx.Response] = []

    def ask(i: int) -> None:
        body = {"model": MODEL, "prompt": [11 + i] * 2000, "max_tokens": 4, "ignore_eos": True}
        answers.append(httpx.post(split.url + "/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(a.status_code for a in answers)
    assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
    for a in answers:
        if a.status_code == 429:
            assert a.headers["retry-after"] == "1"
            assert orjson.loads(a.content)["error"]["code"] == "ttft_target_missed"
        else:
            assert a.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    rows = all_rows(split.db_url)
    while any(r["status"] == "running" for r in rows.values()) or len(rows) < 12:
        assert time.monotonic() < deadline, "rows still running"
        time.sleep(0.05)
        rows = all_rows(split.db_url)
    assert sum(r["status"] == "rejected" for r in rows.values()) == codes.count(429)
    assert sum(r["status"] == "finished" for r in rows.values()) == codes.count(200)
