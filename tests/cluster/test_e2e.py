"""End to end on real processes over loopback: the daemon, sim workers, the official openai client,
the status table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .harness import LiveCluster, all_rows, start_cluster

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    c = start_cluster(tmp_path_factory.mktemp("disagg"), ["prefill", "decode"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def coloc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    # on asyncio's own loop (the disaggregated cluster runs the default, uvloop): both loops end to end
    env = {"TETRI_EVENT_LOOP": "asyncio"}
    c = start_cluster(tmp_path_factory.mktemp("coloc"), ["colocated", "colocated"], mode="colocated", env=env)
    yield c
    c.stop()


def rows(c: LiveCluster) -> dict[str, dict]:
    return all_rows(c.db_url)


async def stream_many(url: str, n: int) -> list[tuple[str, int, int, str | None]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[str, int, int, str | None]:
        want = 5 + (i % 7) * 3
        stream = await client.completions.create(
            model=MODEL,
            prompt=[(i * 7 + k) % 250 for k in range(10 + i % 40)],
            max_tokens=want,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"tetri": {"sla_ttft_ms": 500}},
        )
        got, rid, usage, reason = 0, "", None, None
        async for chunk in stream:
            rid = chunk.id
            got += len(chunk.choices[0].text.split()) if chunk.choices else 0
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if getattr(chunk, "usage", None):
                usage = chunk.usage.completion_tokens
        assert usage == want and got == want, (usage, got, want)
        return rid, want, got, reason

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def wait_rows(c: LiveCluster, ids: list[str], timeout: float = 10) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = rows(c)
        if all(i in got and got[i]["status"] == "finished" for i in ids) or time.monotonic() > deadline:
            return got


def check_rows(c: LiveCluster, got: dict[str, dict], results: list, roles: tuple[str, ...]) -> None:
    for rid, want, _, reason in results:
        r = got[rid]
        assert r["status"] == "finished" and r["phase"] == "done", r
        assert r["output_tokens"] == want and r["max_tokens"] == want
        assert reason == "length" and r["finish_reason"] == "length"
        assert r["prefill_instance"] in c.started_as(roles[0])
        if roles[1]:
            assert r["decode_instance"] in c.started_as(roles[1])
            assert r["decode_start_ts"] >= r["first_token_ts"] >= r["prefill_start_ts"] >= r["arrival_ts"]
        assert 0 < r["ttft_ms"] <= r["jct_ms"]
        assert r["sla_ttft_ms"] == 500


def test_50_concurrent_streams_disaggregated(disagg: LiveCluster):
    results = asyncio.run(stream_many(disagg.url, 50))
    got = wait_rows(disagg, [r[0] for r in results])
    check_rows(disagg, got, results, ("prefill", "decode"))


def test_50_concurrent_streams_colocated(coloc: LiveCluster):
    results = asyncio.run(stream_many(coloc.url, 50))
    got = wait_rows(coloc, [r[0] for r in results])
    check_rows(coloc, got, results, ("colocated", ""))
    used = {got[r[0]]["prefill_instance"] for r in results}
    assert len(used) == 2, "least-loaded routing spreads over both colocated instances"


def test_each_process_runs_the_chosen_event_loop(disagg: LiveCluster, coloc: LiveCluster):
    assert [disagg.ready["event_loop"], *(w["event_loop"] for w in disagg.worker_ready.values())] == ["uvloop"] * 3
    assert [coloc.ready["event_loop"], *(w["event_loop"] for w in coloc.worker_ready.values())] == ["asyncio"] * 3


def test_non_streaming_and_models(disagg: LiveCluster):
    client = openai.OpenAI(base_url=disagg.url + "/v1", api_key="x", max_retries=0)
    try:
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        a = client.completions.create(
            model=MODEL, prompt="hello tetri", max_tokens=7, extra_body={"return_token_ids": True}
        )
        b = client.completions.create(
            model=MODEL, prompt="hello tetri", max_tokens=7, extra_body={"return_token_ids": True}
        )
    finally:
        client.close()
    assert a.usage.completion_tokens == 7 and a.usage.prompt_tokens == len(b"hello tetri")
    assert a.choices[0].finish_reason == "length"
    assert a.choices[0].token_ids == b.choices[0].token_ids  # deterministic per prompt  # type: ignore[attr-defined]


def test_disaggregated_and_colocated_agree_on_tokens(disagg: LiveCluster, coloc: LiveCluster):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "return_token_ids": True}
    a = httpx.post(disagg.url + "/v1/completions", json=body, timeout=30).json()
    b = httpx.post(coloc.url + "/v1/completions", json=body, timeout=30).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert len(a["choices"][0]["token_ids"]) == 12


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ('{"model": "tetri-sim", "prompt": "x", ', 400, None),
        ({"model": MODEL, "max_tokens": 5}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [1] * 100_000, "max_tokens": 1}, 400, "prompt"),
        ({"model": "gpt-nope", "prompt": "hi"}, 404, "model"),
    ],
)
def test_bad_input_is_a_4xx_and_recorded(disagg: LiveCluster, body, status, param):
    before = sum(1 for r in rows(disagg).values() if r["status"] == "rejected")
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(disagg.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["param"] == param
    deadline = time.monotonic() + 5
    while sum(1 for r in rows(disagg).values() if r["status"] == "rejected") == before:
        assert time.monotonic() < deadline, "rejection not recorded"
        time.sleep(0.05)
    ok = httpx.post(disagg.url + "/v1/completions", json={"model": MODEL, "prompt": "still up", "max_tokens": 2})
    assert ok.status_code == 200


def test_admin_api_and_metrics(disagg: LiveCluster):
    asyncio.run(stream_many(disagg.url, 3))
    with httpx.Client(base_url=disagg.url, timeout=10) as h:
        summary = h.get("/api/v1/cluster").json()
        assert summary["instances"]["prefill"]["active"] == 1 and summary["instances"]["decode"]["active"] == 1
        inst = h.get("/api/v1/instances").json()["instances"]
        assert {i["role"] for i in inst} == {"prefill", "decode"}
        assert all(i["kv_capacity_tokens"] > 0 for i in inst)
        time.sleep(0.2)
        page = h.get("/api/v1/requests", params={"status": "finished", "limit": 2}).json()
        assert len(page["requests"]) == 2 and page["total"] >= 3
        one = h.get(f"/api/v1/requests/{page['requests'][0]['id']}").json()
        assert [p["phase"] for p in one["timeline"]] == ["queued", "prefill", "first_token", "decode", "done"]
        assert h.get("/api/v1/requests/nope").status_code == 404
        assert h.post(f"/api/v1/requests/{one['id']}/cancel").status_code == 409
        assert h.get("/api/v1/requests", params={"phase": "bogus"}).status_code == 400
        text = h.get("/metrics").text
        for name in (
            "tetri_ttft_seconds_bucket",
            "tetri_jct_seconds_count",
            "tetri_itl_seconds_count",
            "tetri_instance_kv_usage_ratio",
            "tetri_queue_depth",
            "tetri_generated_tokens_total",
        ):
            assert name in text
        assert h.get("/healthz").status_code == 200 and h.get("/readyz").json()["ready"] is True


def test_a_client_that_leaves_a_non_streaming_request_cancels_it(tmp_path: Path):
    """As a closed stream does: the request stops on its worker and is recorded as cancelled."""
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=0.1)  # 2000 tokens: about 20 s of wall time
    try:
        body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": 2000, "tetri": {"request_id": "gone"}}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=c.url, timeout=1.5) as h:
            h.post("/v1/completions", json=body)  # the client gives up and closes its connection
        deadline = time.monotonic() + 10
        while (row := httpx.get(f"{c.url}/api/v1/requests/gone").json())["status"] == "running":
            assert time.monotonic() < deadline, row
            time.sleep(0.05)
        assert row["status"] == "cancelled" and row["output_tokens"] < 2000
    finally:
        c.stop()
