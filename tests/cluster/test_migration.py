"""Faults under load on real processes: kill -9 of a decode and of a prefill worker under 20 streams
(every stream completes with exactly the tokens an undisturbed run gives: migrated, nothing repeated or
skipped), SIGTERM of the daemon under load (a graceful drain), `tetrictl up` restarting a dead worker.
After each, no status-table row is missing or left `running`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tetri.costmodel import load_profile
from tetrictl.client import SseStream
from tetrictl.procs import spawn, stop_all, wait_ready
from workers.engines.sim import sim_token

from .harness import LiveCluster, all_rows, start_cluster, wait_for

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"
VOCAB = load_profile("tiny").model.vocab_size


def expected(prompt: list[int], n: int) -> list[int]:
    """The tokens an undisturbed sim run streams for this prompt."""
    return [sim_token(prompt, i, VOCAB) for i in range(n)]


class Stream:
    """One streaming completion read as the client sees it."""

    def __init__(self, prompt: list[int], max_tokens: int) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.id = ""
        self.tokens: list[int] = []
        self.errors: list[dict] = []
        self.done = False  # saw [DONE]
        self.finish: str | None = None
        self.status = 0

    async def run(self, h: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}
        body["return_token_ids"] = True
        async with h.stream("POST", "/v1/completions", json=body) as r:
            self.status = r.status_code
            stream = SseStream(r)
            async for doc in stream:
                if "error" in doc:
                    self.errors.append(doc["error"])
                    continue
                self.id = doc["id"]
                self.tokens += doc["choices"][0].get("token_ids") or []
                self.finish = doc["choices"][0]["finish_reason"] or self.finish
            self.done = stream.done


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(i * 37 + k * 11) % 250 for k in range(length)] for i in range(n)]


def wait_settled(db_url: str, ids: list[str], timeout: float = 10) -> dict[str, dict]:
    """The rows once none of `ids` is running (flushes are batched)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = all_rows(db_url)
        if all(i in rows and rows[i]["status"] != "running" for i in ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def instance(c: LiveCluster, iid: str) -> dict:
    return httpx.get(f"{c.url}/api/v1/instances/{iid}", timeout=5).json()


async def serving(h: httpx.AsyncClient, iid: str) -> int:
    """Requests the daemon has on this instance now."""
    return int((await h.get(f"/api/v1/instances/{iid}")).json()["inflight"])


async def stop_when(
    c: LiveCluster,
    role: str,
    ready: Callable[[httpx.AsyncClient, str], Awaitable[bool]],
    streams: list[Stream],
    sig: int,
) -> str:
    """Run the streams; send `sig` to the first worker of `role` that is `ready`; wait for every stream to
    end; the victim. (Any worker of the role: which instance the requests land on depends on when each
    registered, as seen by the prefill instance's last load broadcast.)"""
    async with httpx.AsyncClient(base_url=c.url, timeout=120) as h:
        tasks = [asyncio.create_task(s.run(h)) for s in streams]
        deadline = time.monotonic() + 60
        candidates = c.started_as(role)
        victim = None
        while victim is None:
            for i in candidates:
                if await ready(h, i):
                    victim = i
                    break
            else:
                if time.monotonic() > deadline:
                    state = [(len(s.tokens), s.status, s.done, s.errors[:1]) for s in streams]
                    serving_now = {i: await serving(h, i) for i in candidates}
                    raise AssertionError(
                        f"the streams never reached the point to stop a worker at: {state} {serving_now}"
                    )
                await asyncio.sleep(0.01)
        c.workers[victim].send_signal(sig)
        await asyncio.gather(*tasks)
        return victim


def check_complete(c: LiveCluster, streams: list[Stream], victim: str) -> dict[str, dict]:
    for s in streams:
        assert s.status == 200 and not s.errors and s.done, (s.id, s.errors)
        assert s.tokens == expected(s.prompt, s.max_tokens), s.id  # nothing repeated, nothing skipped
        assert s.finish == "length"
    rows = wait_settled(c.db_url, [s.id for s in streams])
    for s in streams:
        r = rows[s.id]
        assert r["status"] == "finished" and r["output_tokens"] == s.max_tokens, r
    moved = [rows[s.id] for s in streams if rows[s.id]["migrations"]]
    assert moved, "no request was on the killed worker"
    assert all(victim in r["migrated_from"] for r in moved)
    assert not [r for r in all_rows(c.db_url).values() if r["status"] == "running"]
    return rows


def test_decode_worker_killed_under_20_streams(tmp_path: Path):
    # a real-time clock: decoding 600 tokens lasts seconds, so the kill lands mid-decode even on a loaded
    # machine (at 5× the streams could end between the check and the kill)
    c = start_cluster(tmp_path, ["prefill", "decode", "decode"], time_scale=1.0)
    try:
        streams = [Stream(p, 600) for p in prompts(20, 12)]

        async def decoding(h: httpx.AsyncClient, victim: str) -> bool:  # several streams decoding on the victim
            return sum(len(s.tokens) >= 3 for s in streams) >= 5 and await serving(h, victim) >= 3

        victim = asyncio.run(stop_when(c, "decode", decoding, streams, signal.SIGKILL))
        rows = check_complete(c, streams, victim)
        assert all(r["decode_instance"] != victim for r in rows.values() if r["id"] in {s.id for s in streams})
    finally:
        c.stop()


def test_prefill_worker_killed_under_20_streams(tmp_path: Path):
    # slow prefill (long prompts, a slow clock) so requests are queued and prefilling when it dies
    c = start_cluster(tmp_path, ["prefill", "prefill", "decode"], time_scale=0.2)
    try:
        streams = [Stream(p, 20) for p in prompts(20, 300)]

        async def prefilling(h: httpx.AsyncClient, victim: str) -> bool:
            return await serving(h, victim) >= 3

        victim = asyncio.run(stop_when(c, "prefill", prefilling, streams, signal.SIGKILL))
        check_complete(c, streams, victim)
    finally:
        c.stop()


def test_daemon_sigterm_drains_under_load(tmp_path: Path):
    log = (tmp_path / "daemon.log").open("w")
    env = {"TETRI_DAEMON_DRAIN_GRACE_S": "1.5"}
    c = start_cluster(tmp_path, ["prefill", "decode"], time_scale=5.0, env=env, daemon_stderr=log)
    short = [Stream(p, 30) for p in prompts(8, 10)]  # finish well inside the grace period
    long = [Stream(p, 1800) for p in prompts(4, 9)]  # cannot finish in it
    late: list[httpx.Response] = []

    async def load() -> None:
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
            tasks = [asyncio.create_task(s.run(h)) for s in short + long]
            while not all(s.tokens for s in short + long):
                await asyncio.sleep(0.01)
            c.daemon.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            late.append(await h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}))
            await asyncio.gather(*tasks)

    try:
        asyncio.run(load())
        c.daemon.wait(timeout=15)
        assert late[0].status_code == 503 and late[0].headers["retry-after"]
        assert late[0].json()["error"]["code"] == "draining"
        for s in short:  # finished inside the grace period
            assert s.done and not s.errors and s.tokens == expected(s.prompt, 30)
        rows = all_rows(c.db_url)
        for s in long:  # an error event, then [DONE]; the row says why, with the true count
            assert s.done and s.errors and s.errors[0]["code"] == "daemon_shutdown"
            assert s.tokens == expected(s.prompt, len(s.tokens)) and 0 < len(s.tokens) < 1800
            r = rows[s.id]
            assert r["status"] == "interrupted" and r["error"] == "daemon shutdown"
            assert r["output_tokens"] == len(s.tokens)
        assert all(rows[s.id]["status"] == "finished" for s in short)
        turned_away = [r for r in rows.values() if r["status"] == "rejected"]  # the 503 is recorded
        assert [r["error"] for r in turned_away] == ["the daemon is shutting down (draining)"]
        assert not [r for r in rows.values() if r["status"] == "running"]
        log.close()
        assert "Traceback" not in (tmp_path / "daemon.log").read_text()  # a drain, not a crash
    finally:
        log.close()
        c.stop()


def test_tetrictl_up_restarts_a_killed_worker(tmp_path: Path):
    p = spawn(
        "tetrictl.app",
        ["up", "--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny", "--json"],
    )
    try:
        assert p.stdout is not None
        text = ""
        while True:  # the ready report, pretty-printed
            text += p.stdout.readline()
            try:
                doc = json.loads(text)
                break
            except json.JSONDecodeError:
                assert p.poll() is None
        victim = next(w for w in doc["workers"] if w["role"] == "decode")
        with httpx.Client(base_url=doc["url"], timeout=10) as h:
            assert h.get("/readyz").status_code == 200
            os.kill(victim["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while True:  # a replacement registers; the dead one is marked and then removed
                ids = {i["id"]: i for i in h.get("/api/v1/instances").json()["instances"]}
                fresh = [i for i in ids.values() if i["role"] == "decode" and i["id"] != victim["instance_id"]]
                if fresh and fresh[0]["state"] == "active" and h.get("/readyz").status_code == 200:
                    break
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.1)
            ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert p.poll() is None  # the cluster kept running
    finally:
        stop_all([p])


def test_workers_refuse_a_live_id_and_a_port_in_use(tmp_path: Path):
    c = start_cluster(tmp_path, ["prefill", "decode"])
    try:
        live = next(iter(c.workers))
        p, _ = c.add_worker("prefill", expect_ready=False, extra=["--instance-id", live])
        assert p.stdout is not None
        msg = json.loads(p.stdout.readline())
        assert msg["event"] == "error" and "held by a live worker" in msg["error"]
        assert p.wait(timeout=10) == 1
        p.stdout.close()
        port = c.grpc.rsplit(":", 1)[1]
        d = spawn("daemon.main", ["--port", "0", "--grpc-port", port, "--state-dir", str(tmp_path / "second")])
        assert d.stdout is not None
        msg = json.loads(d.stdout.readline())
        assert msg["event"] == "error" and f":{port}" in msg["error"] and "in use" in msg["error"]
        assert d.wait(timeout=10) == 2
        d.stdout.close()
        http_port = c.url.rsplit(":", 1)[1]  # the HTTP port in use: one line naming it and the flag, no traceback
        with tempfile.TemporaryFile("w+") as errs:
            args = ["--port", http_port, "--grpc-port", "0", "--state-dir", str(tmp_path / "third")]
            d = spawn("daemon.main", args, stderr=errs)
            assert d.stdout is not None
            msg = json.loads(d.stdout.readline())
            assert d.wait(timeout=10) == 2
            d.stdout.close()
            errs.seek(0)
            assert "Traceback" not in errs.read()
        assert msg["event"] == "error" and f":{http_port} (in use)" in msg["error"] and "--port" in msg["error"]
        _, wildcard = c.add_worker("decode", extra=["--host", "0.0.0.0"])
        assert not wildcard["address"].startswith("0.0.0.0")
        assert instance(c, wildcard["instance_id"])["address"] == wildcard["address"]
    finally:
        c.stop()


def test_ready_after_restart_readyz(tmp_path: Path):
    """A daemon restarted after the drain serves again (the status table is intact)."""
    c = start_cluster(tmp_path, ["colocated"], mode="colocated")
    try:
        r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200
        c.daemon.send_signal(signal.SIGTERM)
        c.daemon.wait(timeout=10)
        c.daemon.stdout.close()  # type: ignore[union-attr]
        d = spawn("daemon.main", ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path)])
        ready = wait_ready(d, "daemon")
        c.daemon = d
        assert ready["recovered_interrupted"] == 0
        assert all_rows(c.db_url)[r.json()["id"]]["status"] == "finished"
    finally:
        c.stop()


def test_frozen_decode_worker_is_migrated_around(tmp_path: Path):
    """A decode worker that stops answering without closing anything (SIGSTOP: the process is frozen, its
    sockets open) is noticed by gRPC keepalive; its streams migrate and complete exactly."""
    c = start_cluster(tmp_path, ["prefill"], time_scale=1.0)
    logs = {}
    for k in range(2):  # each decode worker logs what it aborts
        log = tmp_path / f"decode-{k}.log"
        _, info = c.add_worker("decode", time_scale=1.0, extra=["--log-level", "info", "--log-file", str(log)])
        logs[info["instance_id"]] = log
    try:
        streams = [Stream(p, 500) for p in prompts(6, 12)]

        async def decoding(h: httpx.AsyncClient, victim: str) -> bool:
            return sum(len(s.tokens) >= 3 for s in streams) >= 3 and await serving(h, victim) >= 1

        victim = asyncio.run(stop_when(c, "decode", decoding, streams, signal.SIGSTOP))
        rows = check_complete(c, streams, victim)
        # it comes back after its requests moved: it drops them (no decoding for nobody, its KV freed) and
        # reports in again, empty
        c.workers[victim].send_signal(signal.SIGCONT)
        moved = [s.id for s in streams if rows[s.id]["migrations"]]
        wait_for(lambda: all(f"request {i}: its caller left; aborted" in logs[victim].read_text() for i in moved))
        with httpx.Client(base_url=c.url, timeout=10) as h:

            def back_and_empty() -> bool:
                i = h.get(f"/api/v1/instances/{victim}").json()
                return i["state"] == "active" and i["running"] == 0 and i["kv_used_tokens"] == 0

            wait_for(back_and_empty, timeout=30)
    finally:
        for w in c.workers.values():
            w.send_signal(signal.SIGCONT)
        c.stop()
