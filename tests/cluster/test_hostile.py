"""Hostile input on a live daemon (real processes, real HTTP): every kind of bad request from the hostile
tester's 206 is a 4xx naming the bad field in OpenAI's error shape — never a 5xx — and none of them costs
another request its status-table row."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import LiveCluster, all_rows, start_cluster

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"
OK = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    cl = start_cluster(tmp_path_factory.mktemp("hostile"), ["prefill", "decode"])
    yield cl
    cl.stop()


def rows(c: LiveCluster) -> dict[str, dict]:
    return all_rows(c.db_url)


def raw(obj: dict[str, Any], **swap: str) -> bytes:
    """JSON with some values replaced verbatim (escapes json.dumps would never write, NaN, 1e400…)."""
    text = json.dumps(obj)
    for key, literal in swap.items():
        text = text.replace(f'"@{key}@"', literal)
    return text.encode()


# (body: a dict, or raw bytes; the param the error names)
COMPLETION_CASES: list[tuple[str, Any, str | None]] = [
    ("max_tokens 10^30", OK | {"max_tokens": 10**30}, "max_tokens"),
    ("max_tokens string", OK | {"max_tokens": "4"}, "max_tokens"),
    ("max_tokens bool", OK | {"max_tokens": True}, "max_tokens"),
    ("max_tokens float", OK | {"max_tokens": 4.0}, "max_tokens"),
    ("token id 2^31", OK | {"prompt": [1, 2**31]}, "prompt"),
    ("token id 2^63", OK | {"prompt": [2**63]}, "prompt"),
    ("token id 2^31 streaming", OK | {"prompt": [2**31], "stream": True}, "prompt"),
    ("token id negative", OK | {"prompt": [1, -1]}, "prompt"),
    ("token id past vocab", OK | {"prompt": [1, 1000]}, "prompt"),
    ("token id bool", OK | {"prompt": [True, 2]}, "prompt"),
    ("model lone surrogate", raw(OK | {"model": "@m@"}, m='"\\ud800"'), "model"),
    ("prompt lone surrogate", raw(OK | {"prompt": "@p@"}, p='"ab\\udc00"'), "prompt"),
    ("user lone surrogate", raw(OK | {"user": "@u@"}, u='"\\udfff"'), "user"),
    ("key lone surrogate", raw(OK | {"@k@": 1}, k='"\\ud800"'), None),
    ("n=3", OK | {"n": 3}, "n"),
    ("best_of", OK | {"best_of": 2}, "best_of"),
    ("echo", OK | {"echo": True}, "echo"),
    ("logprobs", OK | {"logprobs": 2}, "logprobs"),
    ("suffix", OK | {"suffix": "x"}, "suffix"),
    ("logit_bias", OK | {"logit_bias": {"1": 5}}, "logit_bias"),
    ("stop not strings", OK | {"stop": [1]}, "stop"),
    ("too many stops", OK | {"stop": ["x"] * 17}, "stop"),
    ("tools", OK | {"tools": [{"type": "function"}]}, "tools"),
    ("unknown field", OK | {"frobnicate": 1}, "frobnicate"),
    ("temperature NaN", raw(OK | {"temperature": "@t@"}, t="NaN"), "temperature"),
    ("sla 1e400", raw(OK | {"tetri": {"sla_ttft_ms": "@s@"}}, s="1e400"), "tetri.sla_ttft_ms"),
    ("request id pattern", OK | {"tetri": {"request_id": "a b"}}, "tetri.request_id"),
    ("batched prompt", OK | {"prompt": ["a", "b"]}, "prompt"),
    ("empty prompt", OK | {"prompt": []}, "prompt"),
    ("stream string", OK | {"stream": "yes"}, "stream"),
    ("malformed JSON", b'{"model": "tetri-sim", "prompt": ', None),
    ("not an object", b"[1, 2, 3]", None),
    ("deep nesting", b"[" * 5000 + b"]" * 5000, None),
]


@pytest.mark.parametrize(
    ("body", "param"), [(b, p) for _, b, p in COMPLETION_CASES], ids=[n for n, _, _ in COMPLETION_CASES]
)
def test_bad_completion_is_a_400_naming_the_field(c: LiveCluster, body: Any, param: str | None):
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(c.url + "/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "BadRequestError" and err["param"] == param


def test_body_size_limit_is_a_413(c: LiveCluster):
    big = json.dumps(OK | {"prompt": "x" * (5 * 1024 * 1024)}).encode()
    r = httpx.post(c.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(
        c.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413


ADMIN_CASES = [
    ("GET", "/api/v1/requests?offset=9223372036854775808", None, 400),
    ("GET", "/api/v1/requests?offset=-1", None, 400),
    ("GET", "/api/v1/requests?limit=abc", None, 400),
    ("GET", "/api/v1/requests?status=bogus", None, 400),
    ("GET", "/api/v1/requests/%ED%A0%80", None, 404),
    ("PUT", "/api/v1/instances/x/plan", raw({"requests": [{"id": "@i@"}]}, i='"\\ud800"'), 400),
    ("PUT", "/api/v1/policies", raw({"dispatch": "@d@"}, d='"\\udc00"'), 400),
    ("PUT", "/api/v1/policies", b'{"chunk_size": 1e400}', 400),
    ("PUT", "/api/v1/policies", b'{"no_such_policy": 1}', 400),
    ("POST", "/api/v1/instances/nope/flip", b'{"to": "decode"}', 404),
    ("POST", "/api/v1/instances/x/flip", b'{"to": 5}', 400),
    ("GET", "/v1/nope", None, 404),
    ("DELETE", "/v1/completions", None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), ADMIN_CASES)
def test_bad_admin_call_is_a_4xx_in_the_error_shape(c: LiveCluster, method: str, path: str, body: Any, status: int):
    r = httpx.request(method, c.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_a_plan_with_infinite_numbers_is_a_400(c: LiveCluster):
    decode = c.started_as("decode")[0]
    plan = raw({"memory": 1000, "schedule": [{"id": "a", "start": "@s@"}]}, s="1e400")
    r = httpx.put(
        f"{c.url}/api/v1/instances/{decode}/plan",
        content=plan,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "plan"


def test_same_request_id_twice_at_once_is_one_200_and_one_409(c: LiveCluster):
    async def both() -> list[int]:
        body = OK | {"tetri": {"request_id": "twice-at-once"}}
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            rs = await asyncio.gather(*(h.post("/v1/completions", json=body) for _ in range(2)))
        return sorted(r.status_code for r in rs)

    assert asyncio.run(both()) == [200, 409]


def test_bad_requests_interleaved_with_good_ones_lose_no_row(c: LiveCluster):
    """30 good requests among the bad ones, all at once: every good one answered 200 and recorded."""
    bad = [b for _, b, _ in COMPLETION_CASES]

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:

            async def send(body: Any) -> httpx.Response:
                kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
                return await h.post("/v1/completions", headers={"content-type": "application/json"}, **kw)

            goods = [OK | {"prompt": [i % 200 + 1, 2, 3]} for i in range(30)]
            rs = await asyncio.gather(*(send(b) for pair in zip(goods, bad * 2, strict=False) for b in pair))
        assert all(r.status_code < 500 for r in rs)
        ok = [r for r in rs if r.status_code == 200]
        assert len(ok) == 30
        return [r.json()["id"] for r in ok]

    ids = asyncio.run(burst())
    deadline = time.monotonic() + 10
    while True:
        got = rows(c)
        if all(got.get(i, {}).get("status") == "finished" for i in ids):
            break
        assert time.monotonic() < deadline, [i for i in ids if got.get(i, {}).get("status") != "finished"]
        time.sleep(0.05)
    assert not [r for r in got.values() if r["status"] == "running"]


# every integer field of both APIs that reaches a worker (or is refused on its way): (endpoint, path)
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
INT_FIELDS = [
    ("/v1/completions", ("max_tokens",)),
    ("/v1/completions", ("top_k",)),
    ("/v1/completions", ("seed",)),
    ("/v1/completions", ("stop_token_ids", 0)),
    ("/v1/completions", ("prompt", 1)),
    ("/v1/completions", ("n",)),
    ("/v1/completions", ("best_of",)),
    ("/v1/completions", ("logprobs",)),
    ("/v1/chat/completions", ("max_tokens",)),
    ("/v1/chat/completions", ("max_completion_tokens",)),
    ("/v1/chat/completions", ("top_k",)),
    ("/v1/chat/completions", ("seed",)),
    ("/v1/chat/completions", ("stop_token_ids", 0)),
    ("/v1/chat/completions", ("n",)),
    ("/v1/chat/completions", ("top_logprobs",)),
]
EDGES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30]


def with_int(endpoint: str, path: tuple[str | int, ...], value: int, stream: bool) -> dict[str, Any]:
    body = json.loads(json.dumps(OK if endpoint == "/v1/completions" else CHAT_OK)) | {"stream": stream}
    if path[0] == "stop_token_ids":
        body["stop_token_ids"] = [value]
    elif path[0] == "prompt":
        body["prompt"] = [5, value, 7]
    else:
        body[str(path[0])] = value
    return body


def read_stream(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(INT_FIELDS),
    value=st.one_of(st.sampled_from(EDGES), st.integers(-(2**70), 2**70), st.integers(-3, 40)),
    stream=st.booleans(),
)
def test_every_integer_field_is_served_or_a_400_naming_it_never_a_5xx_or_a_cut_stream(
    c: LiveCluster, field: tuple[str, tuple[str | int, ...]], value: int, stream: bool
):
    endpoint, path = field
    r = httpx.post(c.url + endpoint, json=with_int(endpoint, path, value, stream), timeout=30)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == path[0], err
        return
    if stream:  # every token, then the finish reason, then [DONE]: never cut, never an error event
        events = read_stream(r)
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), r.text
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
