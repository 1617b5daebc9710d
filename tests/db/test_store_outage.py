"""The store goes away under the batched writer (issue 31, item 4): rows are held, in order, and written
when it is back, nothing lost; tries back off; one warning as the outage begins and one as it ends; past
`max_buffered` held rows the writer says why new requests are refused.

SQLite's full disk is simulated here with `PRAGMA max_page_count` set to the database's size on every
connection the writer checks out (SQLite then fails writes that need a page with SQLITE_FULL, "database or
disk is full", exactly as on a full disk), so this runs anywhere; tests/cluster/test_store_outage.py fills a
real tmpfs under a live daemon. PostgreSQL: a server of this module's own (tests/pgserver.py), stopped with
`pg_ctl stop -m fast` and started again on the same port and data."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError, StatementError

from daemon.db.store import Store
from daemon.db.writer import (
    BACKOFF_MAX_S,
    BatchWriter,
    describe,
    next_backoff,
    store_refusal,
    store_unavailable,
)
from tests.pgserver import PgServer

BIG = "x" * 4000  # a row that needs pages of its own: a full database refuses it


def test_the_rules_are_pure_functions() -> None:
    assert store_refusal(9, 10, "sqlite3.OperationalError: database or disk is full") is None
    why = store_refusal(10, 10, "sqlite3.OperationalError: database or disk is full")
    assert why is not None and "unavailable (sqlite3.OperationalError: database or disk is full)" in why
    assert "10 rows buffered" in why
    behind = store_refusal(12, 10, None)
    assert behind is not None and "behind" in behind and "12 rows buffered" in behind
    delays = [0.0]
    for _ in range(8):
        delays.append(next_backoff(delays[-1]))
    assert delays[1:] == [0.1, 0.2, 0.4, 0.8, 1.6, BACKOFF_MAX_S, BACKOFF_MAX_S, BACKOFF_MAX_S]
    full = OperationalError("INSERT", {}, Exception("database or disk is full"))
    assert store_unavailable(full) and store_unavailable(OSError(28, "No space left on device"))
    assert store_unavailable(ProgrammingError("INSERT", {}, Exception("relation does not exist")))
    assert not store_unavailable(IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed")))
    assert not store_unavailable(DataError("INSERT", {}, Exception("integer out of range")))
    assert not store_unavailable(StatementError("bad value", "INSERT", {}, UnicodeEncodeError("utf-8", "", 0, 1, "x")))
    assert describe(full) == "Exception: database or disk is full"
    assert describe(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"


def _row(rid: str) -> dict[str, Any]:
    return {"id": rid, "model": "m", "arrival_ts": 1.0, "max_tokens": 50, "error": BIG}


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _outage(writer: BatchWriter, down: Callable[[], Any], up: Callable[[], Any], hold_s: float) -> None:
    """Traffic across an outage: 10 requests written, the store taken `down`; 10 of theirs end and 10 more
    start and end while it is down (in several flushes, `max_batch` small); held, refused past the bound,
    and no try faster than the backoff; then `up`, and every row lands."""
    await writer.start()
    for i in range(10):
        writer.submit_request_insert(**_row(f"a{i}"))
    await _until(lambda: writer.rows_written == 10)
    await asyncio.to_thread(down)
    for i in range(10):  # the first write to fail starts the outage
        writer.submit_request_insert(**_row(f"b{i}"))
    await _until(lambda: writer.outage is not None)
    tries = writer.failed_flushes
    for i in range(10):
        writer.submit_request_update(f"a{i}", status="finished", phase="done", output_tokens=i + 1)
        await asyncio.sleep(0.02)
        writer.submit_request_update(f"b{i}", status="finished", phase="done", output_tokens=100 + i)
    writer.submit_load_samples([])  # nothing to drop
    await asyncio.sleep(hold_s)
    # 0.1, 0.2, 0.4, 0.8, 1.6, then every 2 s: not a try per flush interval, nor per full batch
    assert writer.failed_flushes - tries <= 5 + hold_s / BACKOFF_MAX_S, writer.failed_flushes
    assert writer.buffered == 30 and writer.pending == 30  # b's inserts; a's and b's updates
    refusal = writer.refusal()
    assert refusal is not None and writer.outage is not None and writer.outage in refusal
    assert "30 rows buffered" in refusal
    writer.submit_load_samples([{"instance_id": "p0", "ts": 1.0}])  # past the bound: telemetry is dropped
    assert writer.samples_dropped == 1 and writer.buffered == 30
    writer.submit_request_update("a0", kv_loaded_tokens=7)  # a request in flight still ends: its row is held
    assert writer.buffered == 30 and (writer.pending_fields("a0") or {})["kv_loaded_tokens"] == 7  # merged
    await asyncio.to_thread(up)
    await _until(lambda: writer.outage is None and writer.buffered == 0)
    assert writer.refusal() is None
    await writer.stop()


def _check(store: Store, writer: BatchWriter, caplog: pytest.LogCaptureFixture, cause: str) -> None:
    rows = {r["id"]: r for r in store.list_requests(None, None, 1000, 0)[0]}
    assert sorted(rows) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])
    for i in range(10):
        assert (rows[f"a{i}"]["status"], rows[f"a{i}"]["output_tokens"]) == ("finished", i + 1)
        assert (rows[f"b{i}"]["status"], rows[f"b{i}"]["output_tokens"]) == ("finished", 100 + i)
    assert rows["a0"]["kv_loaded_tokens"] == 7
    assert writer.rows_dropped == 0 and writer.outages == 1
    said = [r.getMessage() for r in caplog.records if r.name == "daemon.db.writer"]
    began = [m for m in said if "is unavailable" in m]
    assert len(began) == 1 and cause in began[0], said
    back = [m for m in said if "is back after" in m]
    assert len(back) == 1 and "the 30 rows held for it are written" in back[0], said
    assert len([m for m in said if "dropping load samples" in m]) == 1, said
    assert len(said) == 3, said  # not a line per try


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[tuple[Store, dict[str, bool]]]:
    store = Store.open(f"sqlite:///{tmp_path / 'tetri.db'}")
    full = {"on": False}

    @event.listens_for(store.engine, "checkout")
    def _size_limit(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            pages = cursor.execute("PRAGMA page_count").fetchone()[0] if full["on"] else 1073741823
            cursor.execute(f"PRAGMA max_page_count = {int(pages)}")
        finally:
            cursor.close()

    try:
        yield store, full
    finally:
        store.close()


def test_sqlite_disk_full_holds_the_rows_until_there_is_room(
    sqlite_store: tuple[Store, dict[str, bool]], caplog: pytest.LogCaptureFixture
) -> None:
    store, full = sqlite_store
    writer = BatchWriter(store, flush_interval_s=0.01, max_batch=5, max_buffered=25)

    def down() -> None:
        full["on"] = True

    def up() -> None:
        full["on"] = False

    with caplog.at_level(logging.WARNING, logger="daemon.db.writer"):
        asyncio.run(_outage(writer, down, up, hold_s=1.0))
    _check(store, writer, caplog, "sqlite3.OperationalError: database or disk is full")


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgServer]:
    """A PostgreSQL server these tests may stop (the session's is shared)."""
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()


def test_postgres_stopped_holds_the_rows_until_it_is_back(own_pg: PgServer, caplog: pytest.LogCaptureFixture) -> None:
    store = Store.open(own_pg.new_database())
    writer = BatchWriter(store, flush_interval_s=0.01, max_batch=5, max_buffered=25)
    try:
        with caplog.at_level(logging.WARNING, logger="daemon.db.writer"):
            asyncio.run(_outage(writer, own_pg.halt, own_pg.start, hold_s=2.0))
        _check(store, writer, caplog, "psycopg.")
    finally:
        store.close()


def test_stop_during_an_outage_tries_again_then_drops_with_an_error(
    sqlite_store: tuple[Store, dict[str, bool]], caplog: pytest.LogCaptureFixture
) -> None:
    """Only stop() gives up: a few more tries (with backoff), then what is held is dropped, logged."""
    store, full = sqlite_store

    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=0.01)
        await writer.start()
        for i in range(10):  # the free pages a new database has are used: the next row needs a page
            writer.submit_request_insert(**_row(f"a{i}"))
        await _until(lambda: writer.rows_written == 10)
        full["on"] = True
        writer.submit_request_insert(**_row("r"))
        await _until(lambda: writer.failed_flushes >= 3)  # more tries than stop() makes: not given up on
        assert writer.pending == 1 and writer.rows_dropped == 0
        await writer.stop()
        return writer

    with caplog.at_level(logging.WARNING, logger="daemon.db.writer"):
        writer = asyncio.run(main())
    assert writer.rows_dropped == 1 and writer.pending == 0
    assert any(r.levelno == logging.ERROR and "database or disk is full" in r.getMessage() for r in caplog.records)
