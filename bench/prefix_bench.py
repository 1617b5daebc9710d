"""Prefix caching and cache-aware routing: multi-turn chat on vLLM's CPU build, and the session mixes on the
simulator. Prints tables (docs/bench.md has them and their reading).

    python bench/prefix_bench.py live [--conversations 6] [--turns 4] [--concurrency 2] [--answer 24]
        [--system-words 1500] [--systems vllm,tetri-1,tetri-2-cache,tetri-2-load] [--json FILE]
    python bench/prefix_bench.py sim [--gpus 4,8] [--mixes chat-sessions,agent,rag-docs] [--rates …] [--seconds 60]

**live** — the traffic issue 39 measured: a 4-layer random-weight Llama (hidden 512, 8 heads, 4 KV heads,
context 8,192; `workers.engines.vllm.tinymodel`, float32, nothing downloaded), `--conversations`
conversations of `--turns` turns sharing one system prompt of `--system-words` words, `--concurrency`
conversations at a time (each turn sent when the one before has answered, with the whole history, through
the OpenAI chat API, streamed), answers of `--answer` tokens (temperature 0, `ignore_eos`). One server at
a time, on the same engine options:
  * vllm           plain vLLM's own server (`python -m vllm.entrypoints.openai.api_server`), its defaults
                   (prefix caching on);
  * tetri-1        `tetrictl up --engine vllm --mode colocated --colocated 1`;
  * tetri-2-cache  the same with 2 colocated instances, routing cache-aware (the default);
  * tetri-2-load   2 instances, routing least-load (cache-blind).
Measured at the client: the wall time of the whole traffic, TTFT (send → first content), p50 TTFT by turn;
from each server's /metrics, the prefix cache's hit ratio (prompt tokens found cached over those looked up:
vLLM's `vllm:prefix_cache_hits/queries`, Tetri's `tetri_prefix_cache_hit/query_tokens` summed over its
instances). Every answer is compared with plain vLLM's (the same text, turn by turn). All on this machine's
2 cores: the client, the control plane and the engines share them.

**sim** — llama3-8b-h100, `--gpus` colocated instances (vLLM v1's schedule), the session mixes
(`tetri.des.sessions`, sessions starting for `--seconds`, 60) at each of `--rates` (requests/s on 4 GPUs, twice
that on 8): Tetri routing cache-aware, Tetri routing
least-load (cache-blind), and vLLM v1 behind a round-robin balancer. Prints goodput (requests within the
SLO per second; TTFT ≤ 1 s and TPOT ≤ 100 ms unless `--slo`), mean and p99 TTFT, and the hit ratio; and
whether cache-aware loses any point to cache-blind by more than 2% of goodput.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from tetrictl.client import SseStream

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("vllm", "tetri-1", "tetri-2-cache", "tetri-2-load")
LABEL = {
    "vllm": "plain vllm serve",
    "tetri-1": "Tetri colocated ×1",
    "tetri-2-cache": "Tetri ×2, cache-aware",
    "tetri-2-load": "Tetri ×2, least-load",
}
MAX_LEN = 8192


# --- live: the traffic ---------------------------------------------------------------------------------
@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    text: str
    cached: int | None


@dataclass
class Run:
    system: str
    wall: float
    turns: list[Turn] = field(default_factory=list)
    hit_ratio: float | None = None
    per_instance: dict[str, float] = field(default_factory=dict)


def system_prompt(n_words: int) -> str:
    from workers.engines.vllm.tinymodel import words

    return "You are a careful assistant. " + " ".join(words(3, n_words))


def user_turn(conversation: int, turn: int) -> str:
    from workers.engines.vllm.tinymodel import words

    return " ".join(words(100 + 17 * conversation + turn, 24)) + "?"


async def converse(
    client: httpx.AsyncClient, model: str, conversation: int, args: argparse.Namespace, system: str
) -> list[Turn]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": user_turn(conversation, turn)})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.answer,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft, parts, cached = None, [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for msg in SseStream(resp):
                if "error" in msg:
                    raise RuntimeError(f"stream error: {msg['error']}")
                for choice in msg.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        parts.append(piece)
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                usage = msg.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        text = "".join(parts)
        out.append(Turn(conversation, turn, ttft if ttft is not None else time.perf_counter() - t0, text, cached))
        messages.append({"role": "assistant", "content": text})
    return out


async def traffic(url: str, args: argparse.Namespace) -> tuple[float, list[Turn]]:
    system = system_prompt(args.system_words)
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.concurrency)

        async def one(c: int) -> list[Turn]:
            async with gate:
                return await converse(client, model, c, args, system)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(c) for c in range(args.conversations)))
        return time.perf_counter() - t0, [t for conv in got for t in conv]


def metrics(url: str, hits: str, queries: str) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Summed counters `hits` and `queries` of a /metrics page, and per `instance` label."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    per: dict[str, list[float]] = {}
    total = [0.0, 0.0]
    for line in text.splitlines():
        for k, name in enumerate((hits, queries)):
            if line.startswith(name) and not line.startswith("#"):
                value = float(line.split()[-1])
                total[k] += value
                if 'instance="' in line:
                    inst = line.split('instance="', 1)[1].split('"', 1)[0]
                    per.setdefault(inst, [0.0, 0.0])[k] += value
    return total[0], total[1], {i: (h, q) for i, (h, q) in per.items()}


# --- live: the servers ----------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        with suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
            if httpx.get(f"{url}/v1/models", timeout=2).json()["data"]:
                return
        time.sleep(1)
    raise RuntimeError(f"the server is not ready within {timeout:.0f} s; see {log}")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with suppress(ProcessLookupError):  # what outlived it (an engine core)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def server(system: str, model: Path, root: Path) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / f"{system}.log"
    common = ["--dtype", "float32", "--max-model-len", str(MAX_LEN)]
    if system == "vllm":
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        args += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *common]
        args += ["--enforce-eager", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    else:
        n = 1 if system == "tetri-1" else 2
        args = [sys.executable, "-m", "tetrictl.app", "up", "--engine", "vllm", "--model", str(model)]
        args += ["--mode", "colocated", "--colocated", str(n), "--port", str(port), "--grpc-port", "0"]
        args += ["--state-dir", str(root / system), *common]
    with log.open("w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0)
    try:
        _wait(url, proc, log)
        if system != "vllm":  # every instance up (the first to register answers /v1/models)
            want = 1 if system == "tetri-1" else 2
            deadline = time.monotonic() + 900
            while True:
                insts = httpx.get(f"{url}/api/v1/instances", timeout=10).json()["instances"]
                if sum(i["state"] == "active" for i in insts) >= want:
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{want} instances are not up; see {log}")
                time.sleep(1)
        if system == "tetri-2-load":
            httpx.put(f"{url}/api/v1/policies", json={"routing": "least-load"}, timeout=10).raise_for_status()
        yield url
    finally:
        _stop(proc)


def live(args: argparse.Namespace) -> None:
    from workers.engines.vllm.tinymodel import write_tiny_llama

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    root = Path(tempfile.mkdtemp(prefix="tetri-prefix-bench-"))
    model = write_tiny_llama(root / "tiny", hidden=512, heads=8, kv_heads=4, layers=4, max_len=MAX_LEN)
    runs: list[Run] = []
    ok = False
    try:
        for system in args.systems:
            print(f"{LABEL[system]}: starting", file=sys.stderr, flush=True)
            with server(system, model, root) as url:
                asyncio.run(warm(url))
                wall, turns = asyncio.run(traffic(url, args))
                if system == "vllm":
                    hits, queries, per = metrics(url, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
                else:
                    hits, queries, per = metrics(
                        url, "tetri_prefix_cache_hit_tokens_total", "tetri_prefix_cache_query_tokens_total"
                    )
                run = Run(system, wall, turns, hits / queries if queries else None)
                run.per_instance = {i: h / q for i, (h, q) in per.items() if q}
                runs.append(run)
                print(f"  {wall:.1f} s", file=sys.stderr, flush=True)
        ok = True
    finally:
        if runs:
            report(runs, args)
        if args.json:
            args.json.write_text(json.dumps([vars(r) | {"turns": [vars(t) for t in r.turns]} for r in runs]))
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs kept in {root}", file=sys.stderr)


async def warm(url: str) -> None:
    """One short request (its prompt shares nothing with the traffic's): the engine's first step is slow."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
        (await client.post("/v1/chat/completions", json=body)).raise_for_status()


def report(runs: list[Run], args: argparse.Namespace) -> None:
    base = next((r for r in runs if r.system == "vllm"), None)
    t = Table(
        title=f"{args.conversations} conversations × {args.turns} turns, {args.concurrency} at a time, a "
        f"{args.system_words}-word shared system prompt, {args.answer}-token answers (vLLM CPU build)",
        title_justify="left",
    )
    for c in ("server", "wall s", "× vLLM", "mean TTFT s", "× vLLM", "TTFT p50 by turn s", "hit ratio", "same answers"):
        t.add_column(c, justify="left" if c in ("server", "TTFT p50 by turn s") else "right")
    for r in runs:
        ttft = float(np.mean([x.ttft for x in r.turns]))
        by_turn = ", ".join(f"{np.median([x.ttft for x in r.turns if x.turn == k]):.2f}" for k in range(args.turns))
        same = "—"
        if base is not None:
            want = {(x.conversation, x.turn): x.text for x in base.turns}
            same = f"{sum(want.get((x.conversation, x.turn)) == x.text for x in r.turns)}/{len(r.turns)}"
        base_ttft = float(np.mean([x.ttft for x in base.turns])) if base else None
        hit = "—" if r.hit_ratio is None else f"{r.hit_ratio:.1%}"
        if len(r.per_instance) > 1:
            hit += " (" + ", ".join(f"{v:.0%}" for v in r.per_instance.values()) + ")"
        t.add_row(
            LABEL[r.system],
            f"{r.wall:.1f}",
            f"{r.wall / base.wall:.2f}" if base else "—",
            f"{ttft:.2f}",
            f"{ttft / base_ttft:.2f}" if base_ttft else "—",
            by_turn,
            hit,
            same,
        )
    Console(width=160).print(t)
    one = next((r for r in runs if r.system == "tetri-1"), None)
    for r in runs:
        if r.system.startswith("tetri-2") and one is not None and r.hit_ratio and one.hit_ratio:
            print(f"{LABEL[r.system]}: hit ratio {r.hit_ratio / one.hit_ratio:.2f}× one instance's")


# --- sim ---------------------------------------------------------------------------------------------------
def sim(args: argparse.Namespace) -> None:
    from tetri.des.cluster import ClusterConfig, simulate
    from tetri.des.metrics import summarize
    from tetri.des.sessions import make_sessions
    from tetri.des.slo import parse_slos
    from tetri.scheduling.policyset import PolicySet

    slo = parse_slos(args.slo)
    routes = (
        ("Tetri cache-aware", "cache-aware"),
        ("Tetri least-load", "least-load"),
        ("vLLM v1, round-robin", "round-robin"),
    )
    t = Table(
        title=f"Session mixes on llama3-8b-h100, colocated vLLM v1 schedule; SLO {slo.label()}; goodput req/s, TTFT s",
        title_justify="left",
    )
    for c in ("GPUs", "mix", "req/s", "routing", "goodput", "× blind", "mean TTFT", "p99 TTFT", "hit ratio"):
        t.add_column(c, justify="left" if c in ("mix", "routing") else "right")
    worst = []
    for gpus in args.gpus:
        for mix in args.mixes:
            for rate in args.rates[mix]:
                r = rate * gpus / 4  # the rates are for 4 GPUs; 8 take twice the traffic
                reqs = make_sessions(mix, int(r * args.seconds), r, seed=args.seed)
                out = {}
                for label, routing in routes:
                    pol = PolicySet(colocated_schedule="vllm-v1", routing=routing)
                    cfg = ClusterConfig(
                        mode="vanilla", profile="llama3-8b-h100", instances=gpus, policy=pol, seed=args.seed
                    )
                    result = simulate(reqs, cfg)
                    m = summarize(result, slo=slo)
                    out[label] = (m, result.prefix_hit_ratio)
                blind = out["Tetri least-load"][0]["goodput_rps"]
                for label, (m, hit) in out.items():
                    ratio = m["goodput_rps"] / blind if blind else float("nan")
                    t.add_row(
                        str(gpus),
                        mix,
                        f"{len(reqs) / max(x.arrival for x in reqs):.0f}",
                        label,
                        f"{m['goodput_rps']:.1f}",
                        f"{ratio:.2f}",
                        f"{m['avg_ttft_s']:.3f}",
                        f"{m['p99_ttft_s']:.3f}",
                        f"{hit:.1%}",
                    )
                worst.append(out["Tetri cache-aware"][0]["goodput_rps"] / blind if blind else 1.0)
                t.add_section()
    Console(width=160).print(t)
    print(f"cache-aware / cache-blind goodput: worst point {min(worst):.3f} (a loss past 2% would be < 0.98)")


# requests/s on 4 GPUs (8: twice): about half, three quarters, all and more than least-load's capacity
RATES = {
    "chat-sessions": (80.0, 120.0, 160.0, 200.0),
    "agent": (30.0, 45.0, 60.0, 75.0),
    "rag-docs": (100.0, 150.0, 200.0, 240.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    lv = sub.add_parser("live", help="multi-turn chat on vLLM's CPU build")
    lv.add_argument("--conversations", type=int, default=6)
    lv.add_argument("--turns", type=int, default=4)
    lv.add_argument("--concurrency", type=int, default=2)
    lv.add_argument("--answer", type=int, default=24)
    lv.add_argument("--system-words", type=int, default=1500)
    lv.add_argument("--systems", default=",".join(SYSTEMS))
    lv.add_argument("--json", type=Path)
    sm = sub.add_parser("sim", help="the session mixes on the simulator")
    sm.add_argument("--gpus", default="4,8")
    sm.add_argument("--mixes", default="chat-sessions,agent,rag-docs")
    sm.add_argument("--rates", help="mix=r1/r2/…,… requests/s on 4 GPUs (8 GPUs: twice)")
    sm.add_argument("--seconds", type=float, default=60.0, help="how long sessions keep starting")
    sm.add_argument("--slo", action="append", default=[])
    sm.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.what == "live":
        args.systems = [s for s in args.systems.split(",") if s]
        for bad in set(args.systems) - set(SYSTEMS):
            ap.error(f"unknown system {bad!r}")
        live(args)
        return
    args.gpus = [int(x) for x in args.gpus.split(",") if x]
    args.mixes = [m for m in args.mixes.split(",") if m]
    rates = dict(RATES)
    for part in (args.rates or "").split(","):
        if part:
            mix, _, values = part.partition("=")
            rates[mix] = tuple(float(v) for v in values.split("/"))
    args.rates = rates
    sim(args)


if __name__ == "__main__":
    main()
