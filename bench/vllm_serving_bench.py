"""Plain vLLM vs Tetri colocated vs Tetri disaggregated, on the same requests, measured at the client.

    python bench/vllm_serving_bench.py [--model DIR] [--requests 50] [--rate 10] [--seed 0]
        [--patterns burst,poisson,sequential] [--systems vllm,colocated,disaggregated] [--json FILE]
        [--engine-cpus 1/0] [--rounds 1] [--output-tokens N]

One system runs at a time, each on the same engine options (float32, block size 32, max model len 1024,
prefix caching on (vLLM's default, and Tetri's workers'; the probe's random prompts share no prefix), enforce
eager, max-num-batched-tokens 512, VLLM_CPU_KVCACHE_SPACE=1 GiB):
  * vllm          — vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`), flags
                    mirroring what Tetri's engine passes to vLLM (workers/engines/vllm/engine.py `_engine_args`);
  * colocated     — Tetri's daemon (`--mode colocated`) and one vLLM worker doing both phases;
  * disaggregated — Tetri's daemon, one prefill and one decode vLLM worker, KV handed over by
                    HostKVConnector through a temporary store on /dev/shm.
Without --model a tiny random Llama (vocab 512) is written to a temporary directory.

The probe: `--requests` requests, prompts of 16–400 random token ids (1..500), 8–48 output tokens (or
`--output-tokens` each), seeded;
sent to /v1/completions as `"prompt": [ids]`, `max_tokens`, `temperature: 0`, `ignore_eos: true`,
`stream: true` and `return_token_ids: true` (tokens are counted from the ids, the same way for every
system; text is rendered as each server does). Arrival patterns: burst (all at t=0), poisson (`--rate`
req/s), sequential (one after another). A few warm-up requests precede each pattern. The model name comes
from GET /v1/models.

Measured client-side from the SSE stream, one async httpx client and the same code for every system:
TTFT (send → first chunk carrying a token), TPOT ((JCT − TTFT) / (tokens − 1)), JCT (send → end of
stream). Prints mean and p99 of each (ms) per system × pattern, and the ratios Tetri colocated / vLLM and
Tetri disaggregated / Tetri colocated, over the requests that succeeded (failures are counted and their
errors listed). All systems share this machine's cores with the client.

Beside the latencies, the CPU seconds of each system's serving processes over each pattern (warm-up
excluded), per request and per output token: vLLM's API server process, and Tetri's daemon and worker
processes — each process's own CPU (utime + stime of all its threads), without its children: vLLM's engine
core runs in a child process of the API server, as of each Tetri vLLM worker, and is not counted.

Token identity: each Tetri system's output ids are compared, request by request, with plain vLLM's for the
same round and pattern (greedy: they should be the same tokens); the count of identical answers is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from tetrictl.client import SseStream
from tetrictl.procs import spawn, stop_all, wait_ready

DTYPE, BLOCK, MAX_LEN, BATCHED = "float32", 32, 1024, 512
SYSTEMS = ("vllm", "colocated", "disaggregated")
PATTERNS = ("burst", "poisson", "sequential")
LABEL = {"vllm": "vLLM server", "colocated": "Tetri colocated", "disaggregated": "Tetri 1P+1D"}


@dataclass
class Result:
    ttft: float  # seconds
    jct: float
    tokens: int
    error: str | None = None  # a failed request (HTTP error, error event, short answer): not in the statistics
    ids: list[int] = field(default_factory=list)  # the output token ids, in order

    @property
    def tpot(self) -> float:
        return (self.jct - self.ttft) / (self.tokens - 1) if self.tokens > 1 else 0.0


def probe(n: int, seed: int, output_tokens: int | None = None) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = [int(x) for x in rng.integers(1, 501, int(rng.integers(16, 401)))]
        drawn = int(rng.integers(8, 49))
        out.append((prompt, output_tokens or drawn))
    return out


TICK = os.sysconf("SC_CLK_TCK")


def own_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads, not its children), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def arrivals(pattern: str, n: int, rate: float, seed: int) -> list[float] | None:
    """Send times in seconds from the start (None: sequential)."""
    if pattern == "burst":
        return [0.0] * n
    if pattern == "poisson":
        return [float(t) for t in np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, n))]
    return None


# --- the client ------------------------------------------------------------------------------------------
async def model_name(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    t0 = time.perf_counter()
    try:
        return await _one(client, model, prompt, max_tokens, t0)
    except (RuntimeError, httpx.HTTPError) as e:
        return Result(0.0, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}"[:300])


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, t0: float) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    ttft: float | None = None
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for msg in SseStream(resp):
            if "error" in msg:
                raise RuntimeError(f"stream error: {msg['error']}")
            n = len(ids)
            for c in msg.get("choices", []):
                ids += c.get("token_ids") or []
            if len(ids) > n and ttft is None:
                ttft = time.perf_counter() - t0
    jct = time.perf_counter() - t0
    if len(ids) != max_tokens or ttft is None:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(ids)}")
    return Result(ttft, jct, len(ids), ids=ids)


async def run_pattern(
    url: str, reqs: list[tuple[list[int], int]], times: list[float] | None, pids: dict[str, int]
) -> tuple[list[Result], dict[str, float]]:
    """The pattern's results, and the CPU seconds each serving process spent on it (warm-up excluded)."""
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = await model_name(client)
        for k in range(3):  # warm-up (distinct prompts); the pattern starts from an idle system
            await one(client, model, [(37 * k + j) % 500 + 1 for j in range(70 + 100 * k)], 8)
        before = {name: own_cpu(pid) for name, pid in pids.items()}
        if times is None:
            got = [await one(client, model, p, n) for p, n in reqs]
        else:
            t0 = time.perf_counter()

            async def at(t: float, p: list[int], n: int) -> Result:
                await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))
                return await one(client, model, p, n)

            got = list(await asyncio.gather(*(at(t, p, n) for t, (p, n) in zip(times, reqs, strict=True))))
        return got, {name: own_cpu(pid) - before[name] for name, pid in pids.items()}


# --- the systems ------------------------------------------------------------------------------------------
def _wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM server not ready within {timeout:.0f} s; see {log}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def vllm_server(model: Path, root: Path) -> Iterator[tuple[str, dict[str, int]]]:
    port = _free_port()
    args = [
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", DTYPE, "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN),
        "--max-num-batched-tokens", str(BATCHED), "--enable-chunked-prefill", "--enable-prefix-caching",
        "--enforce-eager", "--max-num-seqs", "64",  # Tetri's default max_num_seqs
        "--host", "127.0.0.1", "--port", str(port),
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",  # the daemon logs no access either
    ]  # fmt: skip
    if not any((model / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        args.append("--skip-tokenizer-init")  # token ids in, token ids out (Tetri's engine never tokenizes)
    log = root / "vllm-server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=f, stderr=subprocess.STDOUT, process_group=0,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, log)
        yield url, {"API server": proc.pid}
    finally:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        with suppress(ProcessLookupError):  # the engine core process, if it outlived the server
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def tetri(mode: str, model: Path, root: Path, engine_cpus: str | None = None) -> Iterator[tuple[str, dict[str, int]]]:
    state = Path(tempfile.mkdtemp(dir=root, prefix=f"{mode}-"))
    kv_store = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="tetri-kv-"))
    log = (root / f"tetri-{mode}.log").open("w")
    daemon_args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(state), "--mode", mode]
    daemon = spawn("daemon.main", daemon_args, stderr=log)
    procs = [daemon]
    try:
        ready = wait_ready(daemon, "daemon")
        roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        common = ["--engine", "vllm", "--model", str(model), "--daemon", ready["grpc"], "--dtype", DTYPE]
        common += ["--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN), "--chunk-size", str(BATCHED)]
        common += ["--kv-connector", "HostKVConnector", "--kv-store", str(kv_store)]
        cpus = dict(zip(("prefill", "decode"), engine_cpus.split("/"), strict=True)) if engine_cpus else {}
        for role in roles:
            pin = ["--engine-cpus", cpus[role]] if role in cpus else []
            procs.append(spawn("workers.main", ["--role", role, *common, *pin], stderr=log))
        for p, role in zip(procs[1:], roles, strict=True):
            wait_ready(p, role, timeout=600)
        yield ready["url"], {"daemon": daemon.pid} | {role: p.pid for p, role in zip(procs[1:], roles, strict=True)}
    finally:
        stop_all(procs, grace=30)
        log.close()
        shutil.rmtree(kv_store, ignore_errors=True)


# --- report -------------------------------------------------------------------------------------------------
def summary(rs: list[Result]) -> dict[str, float]:
    ok = [r for r in rs if r.error is None]
    out = {"failed": float(len(rs) - len(ok))}
    for k in ("ttft", "tpot", "jct"):
        xs = np.array([getattr(r, k) for r in ok] or [np.nan]) * 1000
        out[f"{k}_mean"], out[f"{k}_p99"] = float(xs.mean()), float(np.percentile(xs, 99))
    return out


COLS = ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99", "jct_mean", "jct_p99")


Spent = dict[str, dict[str, dict[str, float]]]  # system -> pattern -> process -> CPU seconds (all rounds)


def report(results: dict[str, dict[str, list[Result]]], cpu: Spent, args: argparse.Namespace) -> None:
    t = Table(
        title=f"{args.requests} requests per pattern (poisson at {args.rate:g}/s), client-side, ms",
        title_justify="left",
    )
    t.add_column("pattern")
    t.add_column("system")
    for c in COLS:
        t.add_column(c.replace("_", " ").replace("ttft", "TTFT").replace("tpot", "TPOT").replace("jct", "JCT"),
                     justify="right")  # fmt: skip
    t.add_column("failed", justify="right")
    for pattern in args.patterns:
        stats = {s: summary(results[s][pattern]) for s in args.systems if pattern in results.get(s, {})}
        for s, st in stats.items():
            t.add_row(pattern, LABEL[s], *(f"{st[c]:.1f}" for c in COLS), f"{st['failed']:.0f}")
        for a, b in (("colocated", "vllm"), ("disaggregated", "colocated")):
            if a in stats and b in stats:
                t.add_row(
                    "", f"[i]{LABEL[a]} / {LABEL[b]}[/i]", *(f"[i]{stats[a][c] / stats[b][c]:.2f}×[/i]" for c in COLS)
                )
        t.add_section()
    Console(width=150).print(t)
    cpu_table(results, cpu, args)
    errors = {r.error for ps in results.values() for rs in ps.values() for r in rs if r.error}
    for e in sorted(errors):
        print(f"failed: {e}")


def cpu_table(results: dict[str, dict[str, list[Result]]], spent: Spent, args: argparse.Namespace) -> None:
    t = Table(
        title="CPU of the serving processes (own, engine cores excluded): ms per request, µs per output token",
        title_justify="left",
    )
    for c in ("pattern", "system", "process", "CPU s", "ms / request", "µs / token"):
        t.add_column(c, justify="left" if c in ("pattern", "system", "process") else "right")
    for pattern in args.patterns:
        for s in args.systems:
            cpu = spent.get(s, {}).get(pattern)
            if not cpu:
                continue
            ok = [r for r in results[s][pattern] if r.error is None]
            n, tokens = max(1, len(ok)), max(1, sum(r.tokens for r in ok))
            rows = [*cpu.items(), ("all", sum(cpu.values()))] if len(cpu) > 1 else list(cpu.items())
            for name, sec in rows:
                t.add_row(pattern, LABEL[s], name, f"{sec:.2f}", f"{sec / n * 1e3:.2f}", f"{sec / tokens * 1e6:.0f}")
        t.add_section()
    Console(width=150).print(t)


def spread(rounds: list[dict[str, dict[str, list[Result]]]], args: argparse.Namespace) -> None:
    """Each round's ratio of mean TTFT, TPOT and JCT, per pattern: how much one run's ratio can be trusted."""
    for pattern in args.patterns:
        for a, b in (("colocated", "vllm"), ("disaggregated", "colocated")):
            per = []
            for r in rounds:
                if pattern in r.get(a, {}) and pattern in r.get(b, {}):
                    sa, sb = summary(r[a][pattern]), summary(r[b][pattern])
                    per.append("/".join(f"{sa[f'{k}_mean'] / sb[f'{k}_mean']:.2f}" for k in ("ttft", "tpot", "jct")))
            if per:
                print(f"{pattern:10s} {LABEL[a]} / {LABEL[b]}, TTFT/TPOT/JCT mean ratio by round: {'  '.join(per)}")


def identity(rounds: list[dict[str, dict[str, list[Result]]]], args: argparse.Namespace) -> None:
    """Token identity: each Tetri system's output ids against vLLM's for the same request, pattern and round
    (greedy, the same engine options: they should be the same tokens)."""
    for system in args.systems:
        if system == "vllm":
            continue
        same = total = 0
        for r in rounds:
            for pattern, rs in r.get(system, {}).items():
                base = r.get("vllm", {}).get(pattern)
                if base is None:
                    continue
                for mine, theirs in zip(rs, base, strict=True):
                    if mine.error is None and theirs.error is None:
                        total += 1
                        same += mine.ids == theirs.ids
        if total:
            print(f"token identity, {LABEL[system]} / vLLM server: {same} of {total} requests' output ids identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny Llama written here)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rate", type=float, default=10.0, help="poisson arrivals, requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-tokens", type=int, help="every request's output tokens (default: 8–48, drawn)")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", type=Path, help="write the raw per-request numbers here")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, interleaved (vLLM, colocated, 1P+1D, vLLM, …); the table pools "
        "the rounds, and each round's ratios of means are printed (this machine's speed drifts between runs)",
    )
    ap.add_argument(
        "--engine-cpus",
        metavar="P/D",
        help="disaggregated: the cores of the prefill / decode engine (the workers' --engine-cpus), e.g. 1/0 on "
        "2 cores (default: anywhere, with vLLM's own binding, which puts both engines' threads on all cores)",
    )
    args = ap.parse_args()
    args.patterns = [p for p in args.patterns.split(",") if p]
    args.systems = [s for s in args.systems.split(",") if s]
    for bad in set(args.patterns) - set(PATTERNS):
        ap.error(f"unknown pattern {bad!r}")
    for bad in set(args.systems) - set(SYSTEMS):
        ap.error(f"unknown system {bad!r}")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # Tetri workers' stdout is their ready line
    root = Path(tempfile.mkdtemp(prefix="tetri-serving-bench-"))
    model = args.model
    if model is None:
        model = root / "tiny-llama"
        subprocess.run([sys.executable, "-m", "workers.engines.vllm.tinymodel", str(model)], check=True,
                       capture_output=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    reqs = probe(args.requests, args.seed, args.output_tokens)
    results: dict[str, dict[str, list[Result]]] = {}
    spent: Spent = {}
    ok = False
    rounds: list[dict[str, dict[str, list[Result]]]] = []
    try:
        for n in range(args.rounds):
            rounds.append({})
            for system in args.systems:
                start = vllm_server(model, root) if system == "vllm" else tetri(system, model, root, args.engine_cpus)
                print(f"round {n + 1}, {LABEL[system]}: starting", file=sys.stderr, flush=True)
                with start as (url, pids):
                    for pattern in args.patterns:
                        times = arrivals(pattern, len(reqs), args.rate, args.seed)
                        t0 = time.perf_counter()
                        got, cpu = asyncio.run(run_pattern(url, reqs, times, pids))
                        here = spent.setdefault(system, {}).setdefault(pattern, {})
                        for name, sec in cpu.items():
                            here[name] = here.get(name, 0.0) + sec
                        rounds[-1].setdefault(system, {})[pattern] = got
                        results.setdefault(system, {}).setdefault(pattern, []).extend(got)
                        print(f"  {pattern}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        ok = True
    finally:
        if args.json:
            raw = {
                s: {p: [asdict(r) | {"tpot": r.tpot} for r in rs] for p, rs in ps.items()} for s, ps in results.items()
            }
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": raw}))
        if results:
            report(results, spent, args)
            if len(rounds) > 1:
                spread(rounds, args)
            identity(rounds, args)
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs kept in {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
