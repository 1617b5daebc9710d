"""The store goes away under a live cluster (issue 31, item 4): SQLite's disk fills up, or PostgreSQL is
stopped for 10 s, while requests keep coming. Serving goes on, the status-table rows are held and written
when the store is back: every request answered has its final row (finished, its output count), 0 rows
lost. Past `store_buffer_rows` held rows, new requests get 503 `store_unavailable` naming the cause; a
request in flight finishes; once the store is back, new requests are served again.

SQLite: the database on a tmpfs of its own (mounted here: root), filled with a file until writes fail,
then the file deleted. Without the right to mount, the SQLite case skips with the reason (CI requires it:
`TETRI_REQUIRE_TMPFS=1`); tests/db/test_store_outage.py covers the writer on a full SQLite database
anywhere. PostgreSQL: a server of this module's own (tests/pgserver.py), `pg_ctl stop -m fast`, then
started again on the same port and data directory."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.pgserver import PgServer
from tetrictl.client import SseStream

from .harness import LiveCluster, all_rows, start_cluster, wait_for

pytestmark = pytest.mark.slow
MODEL = "tetri-sim"
LONG = 2000  # tokens of a request in flight across the outage (seconds at time scale 1)


# --- the two stores and their outages ---------------------------------------------------------------------
class SmallDisk:
    """A tmpfs for the SQLite file; `fill()` takes its last byte (writes fail: SQLITE_FULL), `free()` gives
    it back."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.filler = where / "filler"
        where.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)]  # the WAL grows to 4 MB or so
        r = subprocess.run(mount, capture_output=True, text=True)
        if r.returncode != 0:
            why = f"mounting a tmpfs for the full-disk test needs root: {r.stderr.strip()}"
            if os.environ.get("TETRI_REQUIRE_TMPFS") == "1":
                raise RuntimeError(f"TETRI_REQUIRE_TMPFS=1 but {why}")
            pytest.skip(why)

    @property
    def url(self) -> str:
        return f"sqlite:///{self.where / 'tetri.db'}"

    def fill(self) -> None:
        with self.filler.open("ab", buffering=0) as f:
            block = b"\0" * 65536
            while True:
                try:
                    f.write(block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    if len(block) == 1:
                        return
                    block = block[: len(block) // 2]

    def free(self) -> None:
        self.filler.unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.where)], capture_output=True)


@dataclass
class Store:
    kind: str
    url: str
    down: Callable[[], None]  # the outage begins
    up: Callable[[], None]  # it ends
    cause: str  # what the 503 names


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgServer]:
    """A PostgreSQL server these tests may stop (the session's is shared)."""
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        disk = SmallDisk(tmp_path / "disk")
        try:
            yield Store("sqlite", disk.url, disk.fill, disk.free, "database or disk is full")
        finally:
            disk.close()  # after the cluster's teardown (fixtures end after the test's own finally)
        return
    pg: PgServer = request.getfixturevalue("own_pg")
    try:
        yield Store("postgresql", pg.new_database(), pg.halt, pg.start, "psycopg.")
    finally:
        if pg.proc.poll() is not None:  # a test that failed mid-outage: the next one needs the server
            pg.start()


# --- traffic --------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    id: str = ""
    tokens: int = 0
    body: dict = field(default_factory=dict)
    retry_after: str | None = None


async def ask(h: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool) -> Answer:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if not stream:
        r = await h.post("/v1/completions", json=body)
        doc = r.json()
        if r.status_code != 200:
            return Answer(r.status_code, body=doc, retry_after=r.headers.get("retry-after"))
        return Answer(200, doc["id"], doc["usage"]["completion_tokens"])
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with h.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Answer(r.status_code, body=json.loads(await r.aread()), retry_after=r.headers.get("retry-after"))
        rid, tokens = "", -1
        async for chunk in SseStream(r):
            assert "error" not in chunk, chunk
            rid = chunk["id"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return Answer(200, rid, tokens)


class Traffic:
    """Requests, `concurrency` at a time, from a thread of its own until `stop()`: short ones, streamed and
    not, each answer kept."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        self.url = url
        self.concurrency = concurrency
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        try:
            await self._requests()
        except BaseException as e:  # raised again by stop(), in the test's thread
            self.error = e

    async def _requests(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as h:

            async def one(k: int) -> None:
                i = 0
                while not self._stop.is_set():
                    self.answers.append(await ask(h, [7, k, i % 50], 3 + (i + k) % 20, stream=(i + k) % 2 == 0))
                    i += 1

            await asyncio.gather(*(one(k) for k in range(self.concurrency)))

    def served(self) -> int:
        if self.error is not None:
            raise self.error
        return sum(a.status == 200 for a in self.answers)

    def stop(self) -> list[Answer]:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.answers


def gauges(c: LiveCluster) -> dict[str, float]:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    return {
        name: float(line.split()[1])
        for line in text.splitlines()
        for name in ("tetri_store_up", "tetri_store_buffered_rows")
        if line.startswith(name + " ")
    }


def store_down(c: LiveCluster) -> bool:
    return gauges(c)["tetri_store_up"] == 0.0


def all_written(c: LiveCluster) -> bool:
    g = gauges(c)
    return g["tetri_store_up"] == 1.0 and g["tetri_store_buffered_rows"] == 0.0


def assert_none_lost(c: LiveCluster, answers: list[Answer]) -> dict[str, dict]:
    """Every request answered 200 has its final row: finished, with the output count it was given."""
    served = [a for a in answers if a.status == 200]
    rows = all_rows(c.db_url)
    lost = [a.id for a in served if a.id not in rows]
    assert not lost, f"{len(lost)} of {len(served)} rows lost: {lost[:5]}"
    wrong = [(a.id, a.tokens, rows[a.id]["status"], rows[a.id]["output_tokens"]) for a in served
             if (rows[a.id]["status"], rows[a.id]["output_tokens"]) != ("finished", a.tokens)]  # fmt: skip
    assert not wrong, wrong[:5]
    return rows


@contextmanager
def cluster(tmp_path: Path, store: Store, time_scale: float = 5.0, **env: str) -> Iterator[LiveCluster]:
    state = tmp_path / "state"
    c = start_cluster(state, ["colocated"], mode="colocated", time_scale=time_scale, db_url=store.url, env=env)
    try:
        yield c
    finally:
        c.stop()


# --- the tests --------------------------------------------------------------------------------------------
def test_serving_goes_on_while_the_store_is_away_and_no_row_is_lost(store: Store, tmp_path: Path):
    """SQLite's disk full (a few seconds) or PostgreSQL stopped for 10 s, under traffic: every request is
    served, the rows are held (/metrics says so), reads answer 503 where the database cannot be read, and
    once the store is back every row lands as its request ended."""
    with cluster(tmp_path, store) as c:
        traffic = Traffic(c.url)
        try:
            wait_for(lambda: traffic.served() >= 20)
            store.down()
            began = time.monotonic()
            wait_for(lambda: store_down(c), timeout=30)  # the next flush fails: the writer says so
            before = traffic.served()
            hold = 10.0 if store.kind == "postgresql" else 3.0
            with httpx.Client(base_url=c.url, timeout=10) as h:
                while time.monotonic() - began < hold:
                    time.sleep(0.5)
                    r = h.get("/api/v1/requests", params={"limit": 5})
                    if store.kind == "postgresql":  # no reads either: a clean 503, not a 500
                        one = traffic.answers[0].id
                        for read in (r, h.get(f"/api/v1/requests/{one}"), h.get("/api/v1/cluster")):
                            assert read.status_code == 503 and read.headers["retry-after"], read.text
                            err = read.json()["error"]
                            assert err["code"] == "store_unavailable" and store.cause in err["message"], err
                    else:  # a full disk still reads
                        assert r.status_code == 200, r.text
                        doc = h.get("/api/v1/cluster").json()["store"]
                        assert doc["up"] is False and store.cause in doc["error"] and doc["buffered_rows"] > 0
                held = gauges(c)["tetri_store_buffered_rows"]
            assert traffic.served() > before + 20, "serving stopped with the store"
            assert held > 0
            store.up()
            wait_for(lambda: not store_down(c), timeout=30)  # what was held is written (traffic goes on)
            after = traffic.served()
            wait_for(lambda: traffic.served() >= after + 20)
        finally:
            answers = traffic.stop()
        wait_for(lambda: all_written(c))  # the last answers' rows
        refused = [a for a in answers if a.status != 200]
        assert not refused, refused[:3]
        rows = assert_none_lost(c, answers)
        assert len(rows) == len(answers), "a row that no answer accounts for"


def test_past_the_buffer_new_requests_get_503_naming_the_cause(store: Store, tmp_path: Path):
    """`store_buffer_rows = 20`: with the store away, requests are served until 20 rows are held; the next
    is refused (503, `store_unavailable`, Retry-After, the cause named) and not recorded; a stream in
    flight finishes; with the store back, all rows land and new requests are served again."""
    with cluster(tmp_path, store, 1.0, TETRI_DAEMON_STORE_BUFFER_ROWS="20") as c:

        async def go() -> tuple[Answer, list[Answer], Answer]:
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
                assert (await ask(h, [1, 2], 5, stream=False)).status == 200
                long = asyncio.create_task(ask(h, [3, 4], LONG, stream=True))  # in flight across it all
                await asyncio.sleep(0.3)
                await asyncio.to_thread(store.down)
                await asyncio.to_thread(wait_for, lambda: store_down(c), 30)
                answers: list[Answer] = []
                while not answers or answers[-1].status == 200:
                    answers.append(await ask(h, [5, len(answers)], 4, stream=len(answers) % 2 == 0))
                    assert len(answers) <= 25, [a.status for a in answers]
                for k in range(3):  # refused again, streamed or not: the bound holds
                    again = await ask(h, [6, k], 4, stream=k % 2 == 0)
                    assert again.status == 503 and again.body["error"]["code"] == "store_unavailable", again
                assert not long.done(), "the long stream should still be in flight"
                ended = await long  # the request in flight finishes; its row is held past the bound
                await asyncio.to_thread(store.up)
                await asyncio.to_thread(wait_for, lambda: all_written(c), 30)
                answers.append(await ask(h, [8, 8], 6, stream=False))
                answers.append(await ask(h, [8, 9], 6, stream=True))
                return ended, answers, answers[-3]

        ended, answers, refused = asyncio.run(go())
        assert ended.status == 200 and ended.tokens == LONG
        assert [a.status for a in answers[-2:]] == [200, 200], answers[-2:]  # served again
        assert refused.status == 503 and refused.retry_after, refused
        err = refused.body["error"]
        assert (err["type"], err["code"]) == ("ServiceUnavailableError", "store_unavailable"), err
        assert "the status table is unavailable" in err["message"] and store.cause in err["message"], err
        assert "rows buffered" in err["message"], err
        assert sum(a.status == 200 for a in answers[:-3]) >= 15  # served until the buffer was full
        wait_for(lambda: all_written(c))
        rows = assert_none_lost(c, [*answers, ended])
        assert not [r for r in rows.values() if r["status"] == "rejected"]  # the 503s are not recorded
        assert len(rows) == 1 + 1 + sum(a.status == 200 for a in answers)  # the first, the long one, the rest
