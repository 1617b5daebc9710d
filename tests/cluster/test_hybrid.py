"""A hybrid cluster, live: one model served by a colocated, a prefill and a decode sim worker at once. The
daemon chooses per request whether it runs colocated or split (the `pd_route` policy, hot-swapped over
the admin API), and instances flip between the three roles while requests run, losing none."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .harness import LiveCluster, start_cluster, wait_for

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    root: Path = tmp_path_factory.mktemp("hybrid")
    c = start_cluster(root, ["colocated", "prefill", "decode"], time_scale=50.0)
    try:
        yield c
    finally:
        c.stop()


def _serve(h: httpx.Client, prompt_len: int, seed: int = 7, pin: str | None = None) -> dict:
    """One request to its end (`pin`: the decode instance it names); its row once written."""
    body = {"model": MODEL, "prompt": [seed] * prompt_len, "max_tokens": 8, "ignore_eos": True}
    if pin is not None:
        body["tetri"] = {"decode_instance": pin}
    r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    row: dict = {}

    def written() -> bool:
        nonlocal row
        got = h.get(f"/api/v1/requests/{rid}")
        row = got.json() if got.status_code == 200 else {}
        return row.get("status") == "finished"

    wait_for(written, 30)
    assert row["output_tokens"] == 8
    return row


def _path(row: dict, c: str, p: str, d: str) -> str:
    if row["prefill_instance"] == p:
        assert row["decode_instance"] == d
        return "split"
    assert row["prefill_instance"] == c and row["decode_instance"] in (None, c), row
    return "colocated"


def test_the_route_chooses_per_request_and_is_hot_swapped(cluster: LiveCluster) -> None:
    (c,), (p,), (d,) = cluster.started_as("colocated"), cluster.started_as("prefill"), cluster.started_as("decode")
    with httpx.Client(base_url=cluster.url, timeout=60) as h:
        # today's clusters as they were: the default route runs everything colocated where it can
        assert {_path(_serve(h, n), c, p, d) for n in (40, 400)} == {"colocated"}
        changes = {"pd_route": "length", "pd_prompt_tokens": 200, "colocated_schedule": "vllm-v1"}
        assert h.put("/api/v1/policies", json=changes).status_code == 200
        paths = {n: _path(_serve(h, n, seed=n), c, p, d) for n in (40, 199, 200, 400, 60, 900)}
        assert paths == {40: "colocated", 199: "colocated", 200: "split", 400: "split", 60: "colocated", 900: "split"}
        assert _path(_serve(h, 40, pin=d), c, p, d) == "split"  # a request naming its decode instance splits
        assert h.put("/api/v1/policies", json={"pd_route": "split"}).status_code == 200
        assert {_path(_serve(h, n), c, p, d) for n in (40, 400)} == {"split"}
        bad = h.put("/api/v1/policies", json={"pd_route": "shortest"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "pd_route"
        assert h.get("/api/v1/policies").json()["policies"]["pd_route"] == "split"  # unchanged


def _load(url: str, stop: threading.Event, served: list[int], failed: list[str]) -> None:
    """Requests one after another, short and long, until `stop`: each must be served whole."""
    with httpx.Client(base_url=url, timeout=60) as h:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"model": MODEL, "prompt": [n % 50 + 1] * (40 if n % 2 else 400), "max_tokens": 16}
            r = h.post("/v1/completions", json=body | {"ignore_eos": True})
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 16:
                failed.append(r.text)
            served.append(n)


def test_instances_flip_between_the_three_roles_under_load(cluster: LiveCluster) -> None:
    (c,), (p,), (d,) = cluster.started_as("colocated"), cluster.started_as("prefill"), cluster.started_as("decode")
    stop, served, failed = threading.Event(), [], []
    threads = [threading.Thread(target=_load, args=(cluster.url, stop, served, failed)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=cluster.url, timeout=60) as h:
            assert h.put("/api/v1/policies", json={"pd_route": "length", "pd_prompt_tokens": 200}).status_code == 200

            def flip(iid: str, to: str) -> None:
                r = h.post(f"/api/v1/instances/{iid}/flip", json={"to": to, "reason": "test"})
                assert r.status_code == 202, r.text
                wait_for(lambda: h.get(f"/api/v1/instances/{iid}").json()["role"] == to, 60)
                wait_for(lambda: h.get(f"/api/v1/instances/{iid}").json()["state"] == "active", 60)

            wait_for(lambda: len(served) >= 6, 30)
            flip(c, "decode")  # colocated → decode: two decode instances, every request split
            # the only prefill instance with no colocated instance left: nothing else could serve
            r = h.post(f"/api/v1/instances/{p}/flip", json={"to": "colocated"})
            assert r.status_code == 409 and "nothing else could serve" in r.json()["error"]["message"]
            n = len(served)
            wait_for(lambda: len(served) >= n + 6, 30)
            flip(d, "colocated")  # decode → colocated: a hybrid cluster again, the other way round
            n = len(served)
            wait_for(lambda: len(served) >= n + 6, 30)
            flip(p, "colocated")  # the last prefill instance goes: its held KV drains to decode instance c
            n = len(served)
            wait_for(lambda: len(served) >= n + 6, 30)
            roles = {i["id"]: i["role"] for i in h.get("/api/v1/instances").json()["instances"]}
            assert roles == {c: "decode", p: "colocated", d: "colocated"}
            flips = h.get("/api/v1/flips").json()["flips"]
            assert [(f["instance_id"], f["from_role"], f["to_role"], f["outcome"]) for f in flips][-3:] == [
                (c, "colocated", "decode", "done"),
                (d, "decode", "colocated", "done"),
                (p, "prefill", "colocated", "done"),
            ]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failed, failed[:3]
