"""`tetrictl up --fronts 2`: a controller and two fronts, and what `kill -9` of each does (issue 28).

A front killed ends only its own streams, and its rows end `interrupted`; the other front's streams run
to the end; the supervisor starts the front again. The controller killed: the fronts serve throughout on
their last view, the restarted controller takes the workers back (the same processes re-register) and
accepts a policy change again, with the policies it had. No finished row is lost, none is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .harness import all_rows, stop_up, tetrictl_up

MODEL = "tetri-sim"
pytestmark = pytest.mark.slow


async def _stream(h: httpx.AsyncClient, url: str, started: asyncio.Event, max_tokens: int) -> tuple[str, list[str]]:
    """One streamed completion: its id and the data lines it got ([DONE] last when it completed)."""
    body = {"model": MODEL, "prompt": "a front", "max_tokens": max_tokens, "stream": True}
    rid, lines = "", []
    try:
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if not rid and line.startswith("data: {"):
                        rid = json.loads(line[6:])["id"]
                        started.set()
    except httpx.HTTPError:
        pass  # the front serving it was killed
    finally:
        started.set()  # (a stream that failed at once: the assertions on its lines say so)
    return rid, lines


async def _first_id(db_url: str) -> str:
    """The one running request's id."""
    running = [i for i, r in all_rows(db_url).items() if r["status"] == "running"]
    assert len(running) == 1, running
    return running[0]


def _wait_rows(db_url: str, ids: set[str], timeout: float = 20.0) -> dict[str, dict]:
    """The rows of `ids` once every one is there and none is running (the fronts' writers flush)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = all_rows(db_url)
        mine = {i: rows[i] for i in ids if i in rows}
        if set(mine) >= ids and all(r["status"] != "running" for r in mine.values()):
            return mine
        assert time.monotonic() < deadline, {i: (mine.get(i) or {}).get("status") for i in ids}
        time.sleep(0.2)


def test_kill_a_front_then_the_controller(tmp_path: Path):
    args = ["--fronts", "2", "--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny"]
    p, doc = tetrictl_up(args)
    db = f"sqlite:///{(tmp_path / 'tetri.db').as_posix()}"
    try:
        front0, front1 = doc["fronts"]
        assert doc["controller"]["pid"] not in (front0["pid"], front1["pid"])

        async def front_killed() -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
            async with httpx.AsyncClient(timeout=120) as h:
                on0 = [asyncio.Event() for _ in range(4)]
                on1 = [asyncio.Event() for _ in range(20)]
                t0 = [asyncio.create_task(_stream(h, front0["url"], e, 1500)) for e in on0]
                t1 = [asyncio.create_task(_stream(h, front1["url"], e, 300)) for e in on1]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in on0 + on1)), 60)
                # their rows are written (a row in a front's writer for less than a flush interval, 50 ms,
                # dies with the front: docs/cluster.md)
                await asyncio.sleep(0.3)
                os.kill(front0["pid"], signal.SIGKILL)
                return await asyncio.gather(*t0), await asyncio.gather(*t1)

        killed, kept = asyncio.run(front_killed())
        assert all(rid for rid, _ in killed + kept), [lines[:1] for rid, lines in killed + kept if not rid]
        # 20 of 20 streams on the other front complete
        assert all(lines[-1] == "[DONE]" for _, lines in kept), [lines[-2:] for _, lines in kept]
        assert all(json.loads(lines[-2])["choices"][0]["finish_reason"] == "length" for _, lines in kept)
        assert all(lines[-1:] != ["[DONE]"] for _, lines in killed)  # those on the killed front ended with it
        rows = _wait_rows(db, {rid for rid, _ in killed + kept})
        for rid, _ in killed:
            assert rows[rid]["status"] == "interrupted" and rows[rid]["error"]
            assert rows[rid]["front"].startswith("front-0.")
        for rid, _ in kept:
            assert rows[rid]["status"] == "finished" and rows[rid]["output_tokens"] == 300

        # a request one front serves is cancelled through the controller's admin API (or any front's)
        async def cancelled_elsewhere() -> tuple[str, list[str]]:
            async with httpx.AsyncClient(timeout=60) as h:
                started = asyncio.Event()
                task = asyncio.create_task(_stream(h, front1["url"], started, 1500))
                await asyncio.wait_for(started.wait(), 30)
                await asyncio.sleep(0.3)  # its row is flushed
                r = await h.post(doc["controller"]["url"] + f"/api/v1/requests/{(await _first_id(db))}/cancel")
                assert r.status_code == 200 and r.json()["cancelled"], r.text
                return await task

        rid, lines = asyncio.run(cancelled_elsewhere())
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "cancelled"
        assert _wait_rows(db, {rid})[rid]["status"] == "cancelled"

        # the controller killed: requests are served throughout, a policy change is accepted again
        served: list[str] = []
        with httpx.Client(timeout=30) as h:
            instances = h.get(doc["controller"]["url"] + "/api/v1/instances").json()["instances"]
            os.kill(doc["controller"]["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            accepted_after = None
            while time.monotonic() - killed_at < 15 or accepted_after is None:
                assert time.monotonic() - killed_at < 15, "no policy change accepted within 15 s"
                body = {"model": MODEL, "prompt": "on", "max_tokens": 4}
                # a connection each: the kernel spreads them over both fronts (the restarted one too)
                r = h.post(doc["url"] + "/v1/completions", json=body, headers={"connection": "close"})
                assert r.status_code == 200, r.text
                served.append(r.json()["id"])
                if accepted_after is None:
                    r = h.put(doc["url"] + "/api/v1/policies", json={"decode_admission": "reserve-static"})
                    if r.status_code == 200:
                        accepted_after = time.monotonic() - killed_at
                    else:
                        assert r.status_code == 503 and r.headers["retry-after"], r.text
                time.sleep(0.1)
            after = h.get(doc["controller"]["url"] + "/api/v1/instances").json()["instances"]
            # the same worker processes, re-registered with the new controller
            assert sorted(i["id"] for i in after) == sorted(i["id"] for i in instances)
            assert all(w["pid"] and os.kill(w["pid"], 0) is None for w in doc["workers"])
            for front in (doc["url"], front1["url"]):  # each front follows the new controller's policies
                deadline = time.monotonic() + 5
                while h.get(front + "/api/v1/policies").json()["policies"]["decode_admission"] != "reserve-static":
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
        assert accepted_after is not None and accepted_after < 15
        rows = _wait_rows(db, set(served))
        assert all(rows[i]["status"] == "finished" for i in served)  # no finished row lost
        fronts = {rows[i]["front"] for i in served}
        assert any(f.startswith("front-0.") and not f.startswith(f"front-0.{front0['pid']}.") for f in fronts), fronts
        assert not [r for r in all_rows(db).values() if r["status"] == "running"]
    finally:
        stop_up(p)


def test_a_killed_up_leaves_no_process_behind(tmp_path: Path):
    """Every child dies with its parent (tetri/children.py): `tetrictl up` killed outright takes its
    supervisor, and with it the controller and the fronts, and the workers."""
    args = ["--fronts", "1", "--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny"]
    p, doc = tetrictl_up(args)
    pids = [doc["controller"]["pid"], *(f["pid"] for f in doc["fronts"]), *(w["pid"] for w in doc["workers"])]
    try:
        p.kill()
        p.wait()
        deadline = time.monotonic() + 20
        while alive := [pid for pid in pids if _alive(pid)]:
            assert time.monotonic() < deadline, alive
            time.sleep(0.1)
    finally:
        stop_up(p)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
