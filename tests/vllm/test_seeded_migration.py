"""Exact migration on vLLM (issue 31): a seeded request whose worker is killed mid-stream continues on
another worker with exactly the tokens an undisturbed run gives (`workers.engines.vllm.seeded`).

Real vLLM on the CPU, the tiny random-weight Llama in float32, one hybrid cluster (one model served by
all four, `pd_route` role: a request runs colocated unless it is pinned to a decode instance):
  co            colocated, ChunkSize 64: the 100-token prompt is prefilled in two chunks (the second chunk
                samples; vLLM 0.32 on the CPU would die rewinding the first one's discarded draw)
  pf            prefill (HostKVConnector)
  dec-1, dec-2  decode
The same seeded request gives one answer colocated and split (the decode engine starts its generator one
draw on); killed on dec-1 it finishes on co, killed on co it finishes on pf + dec-2, each time with that
answer. The first test checks the hook's draws against vLLM's own sampler, without an engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.vllm import cpu_kernels_for_this_cpu, need_vllm, vllm_kernels
from tetrictl.client import SseStream
from tetrictl.procs import spawn, stop_all, wait_ready
from workers.engines.vllm import seeded

need_vllm()

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK = 32
MAX_LEN = 512
CHUNK = 64  # the colocated engine's ChunkSize
PROMPT = [(13 * k) % 500 + 2 for k in range(100)]
MAX_TOKENS = 64
KILL_AFTER = 10  # tokens the client has seen when the worker serving it is killed
SEED = 1234
START_TIMEOUT = 600.0

LOGS: dict[str, Path] = {}  # each process's stderr (its engine's too), tailed into a failing test's report


@pytest.mark.isolated  # vLLM's native kernels run in the test's process: a crash there fails this test alone
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM's internals (torch's, deep_gemm's)
def test_advancing_a_generator_replays_vllms_sampler():
    """`seeded.advance` makes the draws vLLM's sampler makes: a generator advanced k steps samples what
    step k + 1 … of one run sample (the CPU build's fused Gumbel path, and the native path GPUs use).
    The sampler's kernels are the build vLLM's platform loader picks for this CPU, as in its engine."""
    import torch
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current_platform.import_kernels()  # never a build by name: vllm._C is AVX-512 code (SIGILL on AVX2 CPUs)
    kernels = vllm_kernels()
    print("vLLM's CPU kernels in this process:", *kernels)  # -rP shows it
    assert [k.name.split(".")[0] for k in kernels] == [cpu_kernels_for_this_cpu()], kernels

    # the hook wraps vLLM internals (the V1 model runner's _update_states, _sample, _bookkeeping_sync and
    # its discard_request_mask; the sampler's per-request generators): checked on this version
    assert vllm.__version__.startswith(seeded.CHECKED_VLLM), (
        f"workers/engines/vllm/seeded.py was checked against vLLM {seeded.CHECKED_VLLM}x, this is "
        f"{vllm.__version__}: recheck how its V1 model runner seeds, draws and rewinds, then update CHECKED_VLLM"
    )
    seeded.install()
    seeded.install()  # once only
    for name in ("_update_states", "_sample", "_bookkeeping_sync"):
        assert getattr(getattr(GPUModelRunner, name), "__wrapped__", None) is not None, name

    gen = torch.Generator().manual_seed(0)
    vocab, steps, k = 512, 24, 9
    logits = [torch.randn(1, vocab, generator=gen) for _ in range(steps)]
    top_p = torch.tensor([0.9])
    for path in ("forward_cpu", "forward_native"):
        sampler = TopKTopPSampler()
        sampler.forward = getattr(sampler, path)

        def run(g: torch.Generator, rows: list[torch.Tensor], sampler: TopKTopPSampler = sampler) -> list[int]:
            return [int(sampler(x.clone(), {0: g}, None, top_p)[0][0]) for x in rows]

        full = run(torch.Generator().manual_seed(SEED), logits)
        advanced = torch.Generator().manual_seed(SEED)
        seeded.advance(advanced, k, sampler, vocab)
        assert run(advanced, logits[k:]) == full[k:], path
        assert run(torch.Generator().manual_seed(SEED), logits[k:]) != full[k:], path  # not advanced: another


def worker(daemon_grpc: str, role: str, name: str, model: Path, store: Path, *extra: str) -> subprocess.Popen[str]:
    args = [
        "--role", role, "--engine", "vllm", "--model", str(model), "--daemon", daemon_grpc,
        "--instance-id", name, "--kv-store", str(store), "--block-size", str(BLOCK),
        "--max-model-len", str(MAX_LEN), "--dtype", "float32", "--max-num-seqs", "8", *extra,
    ]  # fmt: skip
    LOGS[name] = store.parent / f"{name}.log"
    with LOGS[name].open("a") as log:
        return spawn("workers.main", args, stderr=log)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("seeded")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = root / MODEL
    subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True, timeout=300)
    store = root / "kv"
    LOGS["daemon"] = root / "daemon.log"
    with LOGS["daemon"].open("a") as log:
        daemon = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(root)], stderr=log)
    procs = [daemon]
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        ready = wait_ready(daemon, "daemon")
        grpc = ready["grpc"]
        workers["co"] = worker(grpc, "colocated", "co", model, store, "--chunk-size", str(CHUNK))
        workers["pf"] = worker(grpc, "prefill", "pf", model, store)
        for name in ("dec-1", "dec-2"):
            workers[name] = worker(grpc, "decode", name, model, store)
        procs += workers.values()
        for name, p in workers.items():
            wait_ready(p, name, timeout=START_TIMEOUT)
        yield {"url": ready["url"], "workers": workers}
    finally:
        stop_all(procs, grace=15)
        for p in workers.values():  # a killed worker's engine processes (its process group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def body(rid: str, pin: str | None = None) -> dict:
    tetri = {"request_id": rid} | ({"decode_instance": pin} if pin else {})
    return {
        "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 0.9,
        "seed": SEED, "ignore_eos": True, "return_token_ids": True, "tetri": tetri,
    }  # fmt: skip


def answer(url: str, rid: str, pin: str | None = None) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json=body(rid, pin), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def stream_and_kill(c: dict, rid: str, victim: str, pin: str | None = None) -> list[int]:
    """Stream the request; kill -9 `victim` once the client has `KILL_AFTER` tokens; the whole answer."""
    tokens: list[int] = []
    done, killed = False, False
    with httpx.stream("POST", f"{c['url']}/v1/completions", json={**body(rid, pin), "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        stream = SseStream(r)
        for doc in stream:
            assert "error" not in doc, doc
            tokens += doc["choices"][0].get("token_ids") or []
            if not killed and len(tokens) >= KILL_AFTER:
                c["workers"][victim].send_signal(signal.SIGKILL)
                killed = True
        done = stream.done
    assert done and killed, (done, killed, len(tokens))
    return tokens


def row(url: str, rid: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        got = httpx.get(f"{url}/api/v1/requests/{rid}", timeout=10).json()
        if got.get("status") != "running" or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.fixture(scope="module")
def undisturbed(cluster: dict) -> list[int]:
    """The seeded request's answer, colocated (on co, its prompt in two chunks)."""
    tokens = answer(cluster["url"], "undisturbed")
    assert row(cluster["url"], "undisturbed")["prefill_instance"] == "co"
    return tokens


def test_a_seeded_request_gets_one_answer_colocated_and_split(cluster: dict, undisturbed: list[int]):
    url = cluster["url"]
    assert len(undisturbed) == MAX_TOKENS
    assert answer(url, "again") == undisturbed  # the seed makes it repeatable
    for dec in ("dec-1", "dec-2"):
        assert answer(url, f"split-{dec}", pin=dec) == undisturbed, dec
        got = row(url, f"split-{dec}")
        assert (got["prefill_instance"], got["decode_instance"]) == ("pf", dec)
    # another seed, another answer
    other = httpx.post(f"{url}/v1/completions", json={**body("other"), "seed": SEED + 1}, timeout=120).json()
    assert other["choices"][0]["token_ids"] != undisturbed


def test_a_split_request_whose_decode_worker_dies_finishes_colocated_with_the_same_tokens(
    cluster: dict, undisturbed: list[int]
):
    tokens = stream_and_kill(cluster, "kill-dec", "dec-1", pin="dec-1")
    got = row(cluster["url"], "kill-dec")
    assert got["status"] == "finished" and got["migrations"] == 1 and got["migrated_from"] == "dec-1", got
    assert got["prefill_instance"] == "co"  # the rest ran colocated: prompt + the tokens streamed, resumed
    assert tokens == undisturbed


def test_a_colocated_request_whose_worker_dies_finishes_split_with_the_same_tokens(
    cluster: dict, undisturbed: list[int]
):
    tokens = stream_and_kill(cluster, "kill-co", "co")
    got = row(cluster["url"], "kill-co")
    assert got["status"] == "finished" and got["migrations"] == 1 and got["migrated_from"] == "co", got
    # split: the prefill worker and a live decode worker (dec-2 after the test above killed dec-1)
    assert got["prefill_instance"] == "pf" and got["decode_instance"] in ("dec-1", "dec-2"), got
    assert tokens == undisturbed
