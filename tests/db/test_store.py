"""The store and the batched writer, against real SQLite files (and in-memory SQLite where noted)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError, OperationalError

from daemon.db.models import Phase, Status
from daemon.db.store import INTERRUPTED_ERROR, LOAD_SAMPLES, Store
from daemon.db.writer import MAX_TRIES, BatchWriter, WriterClosedError


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store.open(db_url)
    try:
        yield s
    finally:
        s.close()


def _req(request_id: str, arrival_ts: float, **fields: Any) -> dict[str, Any]:
    return {"id": request_id, "model": "llama", "arrival_ts": arrival_ts, **fields}


def _instance(store: Store, instance_id: str = "p0") -> None:
    store.upsert_instance(instance_id, "prefill", "active", "127.0.0.1:1", "llama", 1000, 1.0)


def _sample(ts: float, instance_id: str = "p0") -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "ts": ts,
        "queued": 1,
        "running": 2,
        "kv_used_tokens": 10,
        "kv_capacity_tokens": 1000,
        "tokens_per_s": 5.0,
    }


# ---- engine ------------------------------------------------------------------------------------------


def test_file_database_uses_wal_and_pragmas(tmp_path: Path) -> None:
    """SQLite's own settings (the other tests here run on SQLite and PostgreSQL)."""
    with Store.open(f"sqlite:///{tmp_path}/state/tetri.db") as store, store.engine.connect() as conn:
        assert (tmp_path / "state" / "tetri.db").is_file()  # parent directory created
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_in_memory_store_is_shared_across_threads() -> None:
    with Store.open("sqlite://") as store:
        store.insert_request(**_req("r1", 1.0))

        async def read_from_thread() -> dict[str, Any] | None:
            return await asyncio.to_thread(store.get_request, "r1")

        row = asyncio.run(read_from_thread())
        assert row is not None and row["id"] == "r1"
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


# ---- requests ----------------------------------------------------------------------------------------


def test_insert_and_get(store: Store) -> None:
    store.insert_request(**_req("r1", 10.0, prompt_tokens=7, max_tokens=20))
    row = store.get_request("r1")
    assert row is not None
    assert row["phase"] == Phase.QUEUED and row["status"] == Status.RUNNING
    assert row["prompt_tokens"] == 7 and row["output_tokens"] == 0 and row["finished_ts"] is None
    assert isinstance(row, dict) and "arrival_ts" in row
    assert store.get_request("missing") is None


def test_insert_must_fail(store: Store) -> None:
    store.insert_request(**_req("r1", 1.0))
    with pytest.raises(IntegrityError):
        store.insert_request(**_req("r1", 2.0))
    with pytest.raises(ValueError, match="bogus"):
        store.insert_request(**_req("r2", 1.0), bogus=1)
    with pytest.raises(IntegrityError):
        store.insert_request(id="r3", model="m")  # arrival_ts is NOT NULL


def test_list_requests_filters_order_and_pagination(store: Store) -> None:
    store.insert_request(**_req("a", 1.0))
    store.insert_request(**_req("b", 3.0, phase=Phase.DECODE))
    store.insert_request(**_req("c", 2.0, phase=Phase.DONE, status=Status.FINISHED))
    store.insert_request(**_req("d", 3.0, phase=Phase.DECODE))  # same arrival as b: id breaks the tie
    store.insert_request(**_req("e", 5.0, phase=Phase.DONE, status=Status.FAILED))

    rows, total = store.list_requests(limit=100)
    assert [r["id"] for r in rows] == ["e", "b", "d", "c", "a"] and total == 5

    page1, total1 = store.list_requests(limit=2, offset=0)
    page2, _ = store.list_requests(limit=2, offset=2)
    page3, _ = store.list_requests(limit=2, offset=4)
    assert [r["id"] for r in page1 + page2 + page3] == ["e", "b", "d", "c", "a"] and total1 == 5
    assert store.list_requests(limit=2, offset=10) == ([], 5)

    rows, total = store.list_requests(phase="decode")
    assert [r["id"] for r in rows] == ["b", "d"] and total == 2
    rows, total = store.list_requests(status="running", limit=1)
    assert [r["id"] for r in rows] == ["b"] and total == 3  # total counts all matches, not the page
    rows, total = store.list_requests(phase="done", status="finished")
    assert [r["id"] for r in rows] == ["c"] and total == 1
    store.insert_request(**_req("rp1.x", 6.0))
    store.insert_request(**_req("rp1_x", 6.0))  # '_' is not a wildcard in the prefix
    rows, total = store.list_requests(id_prefix="rp1.")
    assert [r["id"] for r in rows] == ["rp1.x"] and total == 1

    with pytest.raises(ValueError):
        store.list_requests(limit=-1)


def test_count_by_status(store: Store) -> None:
    assert store.count_by_status() == {s.value: 0 for s in Status}
    store.insert_request(**_req("a", 1.0))
    store.insert_request(**_req("b", 1.0))
    store.insert_request(**_req("c", 1.0, status=Status.FAILED, phase=Phase.DONE))
    counts = store.count_by_status()
    assert counts["running"] == 2 and counts["failed"] == 1 and counts["finished"] == 0


def test_training_samples_are_the_newest_finished_with_a_prompt_sample(store: Store) -> None:
    """What the learned length predictor trains on (daemon/predictor_service.py)."""
    done = {"status": Status.FINISHED, "phase": Phase.DONE}
    store.insert_request(**_req("old", 1.0, prompt_sample="[1, 2]", output_tokens=10, **done))
    store.insert_request(**_req("new", 2.0, prompt_sample="[3]", output_tokens=20, **done))
    store.insert_request(**_req("nosample", 3.0, output_tokens=30, **done))
    store.insert_request(**_req("running", 4.0, prompt_sample="[4]"))
    assert store.training_samples() == [([3], 20), ([1, 2], 10)]
    assert store.training_samples(limit=1) == [([3], 20)]


def test_cancel_only_from_running(store: Store) -> None:
    store.insert_request(**_req("r", 1.0, phase=Phase.DECODE))
    store.insert_request(**_req("f", 1.0, phase=Phase.DONE, status=Status.FINISHED, finished_ts=5.0))

    assert store.cancel_request("r", now=9.0) is True
    row = store.get_request("r")
    assert row is not None
    assert (row["status"], row["phase"], row["finished_ts"]) == ("cancelled", "done", 9.0)
    assert store.cancel_request("r", now=10.0) is False  # second cancel: no-op
    assert store.get_request("r")["finished_ts"] == 9.0  # type: ignore[index]

    assert store.cancel_request("f", now=9.0) is False  # finished: can't be cancelled
    assert store.get_request("f")["status"] == "finished"  # type: ignore[index]
    assert store.cancel_request("nope", now=9.0) is False


def test_update_request_transition_guard(store: Store) -> None:
    store.insert_request(**_req("r", 1.0))
    assert store.update_request("r", output_tokens=3, phase=Phase.DECODE) is True
    assert store.cancel_request("r", now=2.0)
    # status/phase changes only from running; other fields are still written
    assert store.update_request("r", status=Status.FINISHED, phase=Phase.DONE) is False
    assert store.update_request("r", output_tokens=4) is True
    row = store.get_request("r")
    assert row is not None and (row["status"], row["phase"], row["output_tokens"]) == ("cancelled", "done", 4)
    with pytest.raises(ValueError):
        store.update_request("r", id="x")
    with pytest.raises(ValueError):
        store.update_request("r")


def test_recover_interrupted_survives_restart(db_url: str) -> None:
    with Store.open(db_url) as store:
        store.insert_request(**_req("q", 1.0))  # queued, running
        store.insert_request(**_req("d", 2.0, phase=Phase.DECODE))
        store.insert_request(**_req("f", 3.0, phase=Phase.DONE, status=Status.FINISHED, finished_ts=4.0))
        store.insert_request(**_req("c", 4.0, phase=Phase.DONE, status=Status.CANCELLED, finished_ts=5.0))

    # "restart": a new engine and Store on the same file
    with Store.open(db_url) as store:
        assert store.recover_interrupted(now=100.0) == 2
        q, d, f, c = (store.get_request(i) for i in "qdfc")
        assert q is not None and d is not None and f is not None and c is not None
        assert (q["status"], q["phase"], q["finished_ts"], q["error"]) == (
            "interrupted",
            "queued",
            100.0,
            INTERRUPTED_ERROR,
        )
        assert (d["status"], d["phase"]) == ("interrupted", "decode")
        assert (f["status"], f["finished_ts"], f["error"]) == ("finished", 4.0, None)
        assert (c["status"], c["finished_ts"]) == ("cancelled", 5.0)
        assert store.recover_interrupted(now=200.0) == 0

    with Store.open(db_url) as store:
        assert store.count_by_status()["interrupted"] == 2
        assert store.get_request("q")["finished_ts"] == 100.0  # type: ignore[index]


# ---- instances, samples, flips, policy changes ---------------------------------------------------------


def test_instances(store: Store) -> None:
    _instance(store, "p0")
    store.upsert_instance("d0", "decode", "active", "127.0.0.1:2", "llama", 500, 2.0)
    assert store.touch_instance("p0", 7.0) is True
    store.upsert_instance("p0", "prefill", "draining", "127.0.0.1:9", "llama", 2000, 3.0)  # re-register
    rows = store.list_instances()
    assert [r["id"] for r in rows] == ["d0", "p0"]
    p0 = rows[1]
    assert (p0["state"], p0["address"], p0["kv_capacity_tokens"], p0["last_report_ts"]) == (
        "draining",
        "127.0.0.1:9",
        2000,
        7.0,
    )
    assert store.set_instance_state("d0", "flipping") is True
    assert store.list_instances()[0]["state"] == "flipping"
    assert store.set_instance_state("nope", "gone") is False
    assert store.touch_instance("nope", 1.0) is False


def test_load_samples_and_retention(store: Store) -> None:
    _instance(store)
    assert store.add_load_samples([]) == 0
    assert store.add_load_samples([_sample(float(t)) for t in range(1, 11)]) == 10
    assert store.prune_load_samples(older_than_ts=5.0) == 4  # ts 1..4 go, ts 5 stays
    assert [s["ts"] for s in store.list_load_samples()] == [float(t) for t in range(5, 11)]
    assert store.prune_load_samples(older_than_ts=5.0) == 0
    with pytest.raises(IntegrityError):  # foreign keys are on
        store.add_load_samples([_sample(1.0, instance_id="unknown")])


def test_flips_and_policy_changes(store: Store) -> None:
    flip_id = store.record_flip("p0", "prefill", "decode", "decode backlog", "auto", 10.0)
    assert store.update_flip(flip_id, drained_ts=11.0, done_ts=12.0, outcome="ok") is True
    assert store.update_flip(9999, outcome="ok") is False
    with pytest.raises(ValueError):
        store.update_flip(flip_id, bogus=1)
    (flip,) = store.list_flips()
    assert (flip["id"], flip["to_role"], flip["outcome"], flip["done_ts"]) == (flip_id, "decode", "ok", 12.0)
    assert store.list_flips(instance_id="other") == []

    first = store.record_policy_change(1.0, "prefill_policy", None, "sjf", "cli")
    second = store.record_policy_change(2.0, "prefill_policy", "sjf", "fcfs", "cli")
    assert second > first
    changes = store.list_policy_changes()
    assert [(c["old_value"], c["new_value"]) for c in changes] == [(None, "sjf"), ("sjf", "fcfs")]


def test_latest_timestamp_over_every_table(store: Store) -> None:
    assert store.latest_timestamp() is None  # the daemon then starts its clock at the wall time
    _instance(store)  # registered at 1.0
    assert store.latest_timestamp() == 1.0
    store.insert_request(**_req("r1", 5.0, finished_ts=40.0))
    store.insert_request(**_req("r2", 30.0))
    assert store.latest_timestamp() == 40.0
    store.add_load_samples([_sample(45.0)])
    assert store.latest_timestamp() == 45.0
    flip_id = store.record_flip("p0", "prefill", "decode", "test", "auto", 46.0)
    store.update_flip(flip_id, done_ts=50.0)
    assert store.latest_timestamp() == 50.0
    store.record_policy_change(60.0, "prefill_policy", None, "sjf", "cli")
    assert store.latest_timestamp() == 60.0


# ---- BatchWriter -------------------------------------------------------------------------------------


def _count_commits(store: Store) -> list[int]:
    commits = [0]

    @event.listens_for(store.engine, "commit")
    def _on_commit(_conn: Any) -> None:
        commits[0] += 1

    return commits


async def _wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def test_writer_merges_updates_to_one_row_write(store: Store) -> None:
    store.insert_request(**_req("r", 1.0))

    async def main() -> None:
        writer = BatchWriter(store, flush_interval_s=10.0)
        await writer.start()
        try:
            for i in range(100):
                writer.submit_request_update("r", output_tokens=i)
            writer.submit_request_update("r", phase=Phase.DECODE, decode_instance="d0")
            assert writer.pending == 1
            await writer.flush()
            assert (writer.flushes, writer.rows_written, writer.pending) == (1, 1, 0)
        finally:
            await writer.stop()

    asyncio.run(main())
    row = store.get_request("r")
    assert row is not None and (row["output_tokens"], row["phase"], row["decode_instance"]) == (99, "decode", "d0")


def test_writer_inserts_and_updates_in_one_transaction(store: Store) -> None:
    _instance(store)
    store.insert_request(**_req("old", 1.0))
    commits = _count_commits(store)

    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=10.0)
        await writer.start()
        try:
            writer.submit_request_insert(**_req("new", 2.0))
            writer.submit_request_update("new", phase=Phase.PREFILL, prefill_instance="p0")  # merges into insert
            writer.submit_request_update("new", prefill_start_ts=2.5)
            writer.submit_request_update("old", output_tokens=5)
            writer.submit_request_update("old", first_token_ts=1.5)
            writer.submit_load_samples([_sample(1.0), _sample(2.0)])
            await writer.flush()
        finally:
            await writer.stop()
        return writer

    writer = asyncio.run(main())
    assert commits[0] == 1  # one transaction
    assert (writer.flushes, writer.rows_written) == (1, 4)  # 1 insert + 1 merged update + 2 samples
    new = store.get_request("new")
    old = store.get_request("old")
    assert new is not None and old is not None
    assert (new["phase"], new["prefill_instance"], new["prefill_start_ts"]) == ("prefill", "p0", 2.5)
    assert (old["output_tokens"], old["first_token_ts"]) == (5, 1.5)
    assert len(store.list_load_samples()) == 2


def test_writer_flush_is_visible_to_a_fresh_store(store: Store, db_url: str) -> None:
    async def main() -> None:
        writer = BatchWriter(store, flush_interval_s=10.0)
        await writer.start()
        try:
            writer.submit_request_insert(**_req("r", 1.0))
            await writer.flush()
            with Store.open(db_url, run_migrations=False) as other:
                assert other.get_request("r") is not None
        finally:
            await writer.stop()

    asyncio.run(main())


def test_writer_flushes_on_its_own(store: Store) -> None:
    async def main() -> None:
        by_interval = BatchWriter(store, flush_interval_s=0.01)
        by_size = BatchWriter(store, flush_interval_s=60.0, max_batch=5)
        await by_interval.start()
        await by_size.start()
        try:
            by_interval.submit_request_insert(**_req("r", 1.0))
            await _wait_until(lambda: by_interval.rows_written == 1)
            for i in range(5):
                by_size.submit_request_insert(**_req(f"s{i}", 1.0))
            await _wait_until(lambda: by_size.rows_written == 5)
            assert by_size.flushes == 1
        finally:
            await by_interval.stop()
            await by_size.stop()

    asyncio.run(main())
    assert store.list_requests()[1] == 6


def test_writer_late_update_does_not_undo_cancel(store: Store) -> None:
    store.insert_request(**_req("r", 1.0, phase=Phase.DECODE))

    async def main() -> None:
        writer = BatchWriter(store)
        writer.submit_request_update("r", status=Status.FINISHED, phase=Phase.DONE, output_tokens=9)
        assert store.cancel_request("r", now=2.0)
        await writer.stop()

    asyncio.run(main())
    row = store.get_request("r")
    assert row is not None and (row["status"], row["phase"]) == ("cancelled", "done")


def test_writer_after_stop_raises_and_stop_writes_pending(store: Store) -> None:
    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=60.0)
        await writer.start()
        writer.submit_request_insert(**_req("r", 1.0))
        await writer.stop()  # flushes what is pending
        assert not writer.running
        with pytest.raises(WriterClosedError):
            writer.submit_request_update("r", output_tokens=1)
        with pytest.raises(WriterClosedError):
            writer.submit_request_insert(**_req("s", 1.0))
        with pytest.raises(WriterClosedError):
            writer.submit_load_samples([])
        await writer.stop()  # idempotent
        return writer

    writer = asyncio.run(main())
    assert store.get_request("r") is not None and writer.rows_written == 1


def test_writer_submit_must_fail(store: Store) -> None:
    writer = BatchWriter(store)
    writer.submit_request_insert(**_req("r", 1.0))
    with pytest.raises(ValueError):
        writer.submit_request_insert(**_req("r", 2.0))  # already pending
    with pytest.raises(ValueError):
        writer.submit_request_insert(model="m", arrival_ts=1.0)  # no id
    with pytest.raises(ValueError):
        writer.submit_request_update("r", bogus=1)
    with pytest.raises(ValueError):
        writer.submit_request_update("r", id="x")
    with pytest.raises(ValueError):
        writer.submit_request_update("r")
    with pytest.raises(ValueError):
        writer.submit_load_samples([{"bogus": 1}])
    asyncio.run(writer.stop())


def test_failed_flush_keeps_the_batch_for_the_next_try(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = store.write_batch
    calls = [0]

    def flaky_write(*args: Any, **kwargs: Any) -> int:
        calls[0] += 1
        if calls[0] == 1:
            raise OperationalError("INSERT", {}, Exception("disk I/O error"))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write_batch", flaky_write)

    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=60.0)
        writer.submit_request_insert(**_req("r", 1.0))
        with pytest.raises(OperationalError):
            await writer.flush()
        assert writer.pending == 1 and writer.failed_flushes == 1
        writer.submit_request_update("r", output_tokens=3)  # waits behind the kept insert
        await writer.flush()
        await writer.stop()
        return writer

    writer = asyncio.run(main())
    assert (writer.flushes, writer.rows_written, writer.rows_dropped) == (2, 2, 0)
    row = store.get_request("r")
    assert row is not None and row["output_tokens"] == 3


def test_flush_error_does_not_kill_the_writer(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """A table gone is the database failing, not a row: the writer lives on, holds the batch (and what comes
    behind it) however many tries it takes, and writes it all once the table is back (issue 31, item 4)."""
    _instance(store)
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE load_samples"))

    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=0.01)
        await writer.start()
        try:
            writer.submit_load_samples([_sample(1.0)])
            await _wait_until(lambda: writer.failed_flushes >= MAX_TRIES + 1)  # more than stop() would make
            assert writer.running and writer.outage is not None and "load_samples" in writer.outage
            assert writer.rows_dropped == 0 and writer.pending == 1
            writer.submit_request_insert(**_req("r", 1.0))  # held behind the sample: written in order
            await asyncio.sleep(0.05)
            assert writer.pending == 2 and store.get_request("r") is None
            await asyncio.to_thread(LOAD_SAMPLES.create, store.engine)
            await _wait_until(lambda: writer.rows_written == 2)
            assert writer.running and writer.outage is None
        finally:
            await writer.stop()
        return writer

    with caplog.at_level(logging.WARNING, logger="daemon.db.writer"):
        asyncio.run(main())
    assert store.get_request("r") is not None and len(store.list_load_samples()) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "daemon.db.writer"]
    assert len(said) == 2 and "unavailable" in said[0] and "back after" in said[1], said  # not one per try


def test_stop_with_a_broken_database_drops_with_an_error_log(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE requests"))

    async def main() -> BatchWriter:
        writer = BatchWriter(store, flush_interval_s=60.0)
        await writer.start()
        writer.submit_request_insert(**_req("r", 1.0))
        await writer.stop()  # does not raise
        return writer

    with caplog.at_level(logging.ERROR, logger="daemon.db.writer"):
        writer = asyncio.run(main())
    assert (writer.rows_dropped, writer.failed_flushes, writer.pending) == (1, MAX_TRIES, 0)
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_sample_of_unregistered_instance_does_not_sink_the_batch(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    _instance(store, "p0")

    async def main() -> BatchWriter:
        writer = BatchWriter(store)
        writer.submit_request_insert(**_req("r", 1.0))
        writer.submit_load_samples([_sample(1.0, "p0"), _sample(1.0, "not-registered-yet")])
        await writer.flush()
        await writer.stop()
        return writer

    with caplog.at_level(logging.WARNING, logger="daemon.db.store"):
        writer = asyncio.run(main())
    assert (writer.rows_written, writer.failed_flushes) == (2, 0)
    assert store.get_request("r") is not None
    assert [s["instance_id"] for s in store.list_load_samples()] == ["p0"]
    assert any("not-registered-yet" in r.getMessage() for r in caplog.records)
