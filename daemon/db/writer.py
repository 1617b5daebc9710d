"""The batched writer: keeps status-table writes off the token-streaming path.

The event loop calls `submit_*` (plain, non-blocking methods that only touch in-memory dicts); a
background task hands what is pending to a thread every `flush_interval_s` (sooner once `max_batch`
rows are pending), and the thread writes it in ONE transaction with `Store.write_batch`.

Merging: many updates to one request become one row write (later fields win), and an update for a
request whose insert is still pending is merged into the insert.

Failures are isolated. A batch the database refuses for a row's content (a value out of range, a
duplicate id…) is split and every row written in its own transaction: the refused row affects that
request alone — logged with its id and dropped, an update first retried with only its ending fields
(status, phase, finish times, counts) so a row never stays `running` for a bad value — and every other
row is written. The background task never dies of a database error.

The store going away. A batch (or row) that fails for the database's own reasons — a full disk, a
server stopped or unreachable, a dropped connection, a lock, a missing table: any error but a row's
content, `store_unavailable` — is kept, in order, before anything submitted since (its requests' later
updates queue behind it, so each row ends as it would have), and tried again with backoff (0.1 s,
doubling to 2 s; not sooner for a full batch) until the database takes it: while the daemon runs, no row
is dropped for the database's failure. One warning when the outage begins (`outage` names its cause) and
one when it ends. The rows held meanwhile (`buffered`) are bounded by admission, not here: past
`max_buffered` rows, `refusal()` says why new requests are refused (the daemon answers 503); requests in
flight still end and their rows are held. Load samples past the bound are dropped (telemetry; counted in
`samples_dropped`, one warning). Only `stop()` gives up: it tries what is held `MAX_TRIES` more times
(with backoff) and drops the rest with an error log.

After `stop()` the writer is closed: every `submit_*` raises `WriterClosedError` (nothing is dropped
silently). The `submit_*` methods are not thread-safe: call them from the event loop's thread.

It must not read a clock for timestamps (they come in with the fields) or run SQL itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .store import LOAD_SAMPLE_COLUMNS, REQUEST_COLUMNS, Store

logger = logging.getLogger(__name__)

MAX_TRIES = 3  # at stop(): tries of what is held before it is dropped
BACKOFF_FIRST_S = 0.1  # the store unavailable: the first retry after this, doubling …
BACKOFF_MAX_S = 2.0  # … to at most this
BUFFER_ROWS = 100_000  # rows held before new requests are refused (`[daemon] store_buffer_rows`)
T = TypeVar("T")


class WriterClosedError(RuntimeError):
    """A write was submitted after `BatchWriter.stop()`."""


@dataclass
class _Batch:
    inserts: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id → fields, in order
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id → merged fields
    # request id → the insert as submitted, before updates merged into it (to split them apart again)
    original: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    tries: int = 0

    def __len__(self) -> int:
        return len(self.inserts) + len(self.updates) + len(self.samples)


class BatchWriter:
    """Batches request inserts/updates and load samples into one transaction per flush.

    Attributes for tests and metrics: `flushes` (successful flush transactions), `rows_written` (rows
    in them: one per insert, per merged request update, per load sample; load samples of unregistered
    instances are skipped, see `Store.write_batch`), `failed_flushes` (failed
    tries), `rows_dropped` (rows refused for their content, or given up at stop()), `outage` (None while
    the store takes writes; else the cause, one line), `outages` (how many began), `samples_dropped`
    (load samples not held past `max_buffered`), `buffered` (rows held, not written yet).
    """

    def __init__(
        self, store: Store, flush_interval_s: float = 0.05, max_batch: int = 1000, max_buffered: int = BUFFER_ROWS
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError("flush_interval_s must be > 0")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        self.store = store
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.max_buffered = max_buffered
        self.flushes = 0
        self.rows_written = 0
        self.failed_flushes = 0
        self.rows_dropped = 0
        self.samples_dropped = 0
        self.outage: str | None = None
        self.outages = 0
        self._outage_began = 0.0  # the loop's time when it began
        self._written_before = 0  # `rows_written` when it began
        self._backoff_s = BACKOFF_FIRST_S
        self._again: BaseException | None = None  # why the last row of a split batch was kept for later
        self._dropping_samples = False
        self._pending = _Batch()
        self._retry: _Batch | None = None  # a batch whose last try failed; written before _pending
        self._writing: _Batch | None = None  # the batch a flush is writing now
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._stopping = False

    # ---- submitting (event loop, non-blocking) --------------------------------------------------------

    def submit_request_insert(self, **fields: Any) -> None:
        """Queue a new request row (needs `id`). MUST fail with `ValueError` on an unknown field, a
        missing id, or a second insert of an id still pending; `WriterClosedError` after stop()."""
        self._check_open()
        _check_columns(fields, REQUEST_COLUMNS)
        request_id = fields.get("id")
        if not request_id:
            raise ValueError("submit_request_insert needs an id")
        if request_id in self._pending.inserts:
            raise ValueError(f"request {request_id!r} is already pending insertion")
        row = dict(fields)
        self._pending.original[request_id] = dict(fields)
        # An update submitted before its insert (unusual) still lands after it.
        early = self._pending.updates.pop(request_id, None)
        if early:
            row.update(early)
        self._pending.inserts[request_id] = row
        self._maybe_wake()

    def submit_request_update(self, request_id: str, **fields: Any) -> None:
        """Queue field changes for one request, merged with any pending change to it (later values win;
        into its pending insert if there is one). A change of `status`/`phase` applies only while the
        request is running (see `Store.write_batch`). MUST fail with `ValueError` on an unknown field,
        `id`, or no fields; `WriterClosedError` after stop()."""
        self._check_open()
        if not fields:
            raise ValueError("submit_request_update needs at least one field")
        _check_columns(fields, REQUEST_COLUMNS - {"id"})
        pending_insert = self._pending.inserts.get(request_id)
        if pending_insert is not None:
            pending_insert.update(fields)
        else:
            self._pending.updates.setdefault(request_id, {}).update(fields)
        self._maybe_wake()

    def submit_load_samples(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Queue load-sample rows. MUST fail with `ValueError` on an unknown field; `WriterClosedError`
        after stop()."""
        self._check_open()
        new_rows = [dict(r) for r in rows]
        for row in new_rows:
            _check_columns(row, LOAD_SAMPLE_COLUMNS)
        if new_rows and self.buffered >= self.max_buffered:  # telemetry does not grow a full buffer
            self.samples_dropped += len(new_rows)
            if not self._dropping_samples:
                self._dropping_samples = True
                logger.warning("%d status-table rows held: dropping load samples until they are written", self.buffered)
            return
        self._pending.samples.extend(new_rows)
        self._maybe_wake()

    def pending_fields(self, request_id: str) -> dict[str, Any] | None:
        """The fields of this request queued and not yet committed (its insert and updates, oldest batch
        first, later values winning), or None: what a read of its row must lay over the table's to see
        the request as the daemon knows it (a request that just finished may not be flushed yet)."""
        out: dict[str, Any] | None = None
        for batch in (self._writing, self._retry, self._pending):
            if batch is None:
                continue
            for fields in (batch.inserts.get(request_id), batch.updates.get(request_id)):
                if fields:
                    out = (out or {}) | fields
        return out

    async def read_with_pending(
        self, read: Callable[[], T], request_ids: Iterable[str]
    ) -> tuple[T, dict[str, dict[str, Any]]]:
        """`read()` (a status-table query, run in a thread) with no flush in progress, and the fields still
        queued for `request_ids` (`pending_fields`), taken under the same lock. Laid over what `read`
        returned they show each request as the daemon knows it; a row read before a flush commits, with
        the queue looked at after it, would show a request that had finished as running again."""
        self._ensure_primitives()
        assert self._lock is not None
        async with self._lock:
            out = await asyncio.to_thread(read)
            return out, {rid: f for rid in request_ids if (f := self.pending_fields(rid))}

    async def read_settled(self, read: Callable[[], T]) -> tuple[T, dict[str, int]]:
        """`read()` (a status-table query, run in a thread) with no flush in progress, and the status
        counts still queued behind what it read: {status: change}; an insert is +1 to its status, an update
        that ends a running request -1 `running` and +1 its status. Laid over the table's counts they count
        every request as the daemon knows it now (one that just finished is not `running` any more)."""
        self._ensure_primitives()
        assert self._lock is not None
        async with self._lock:  # no batch is half-written: the table and what is queued do not overlap
            out = await asyncio.to_thread(read)
            return out, self._queued_status_changes()

    def _queued_status_changes(self) -> dict[str, int]:
        latest: dict[str, tuple[bool, str]] = {}  # request id → (its insert is queued, its latest status)
        for batch in (self._retry, self._pending):  # oldest first; `_writing` is None under the lock
            if batch is None:
                continue
            for rid, fields in batch.inserts.items():  # updates to a queued insert are merged into it
                latest[rid] = (True, fields.get("status", "running"))
            for rid, fields in batch.updates.items():
                if "status" in fields:
                    latest[rid] = (latest.get(rid, (False, ""))[0], fields["status"])
        out: dict[str, int] = {}
        for inserted, status in latest.values():
            if not inserted:
                if status == "running":
                    continue
                out["running"] = out.get("running", 0) - 1
            out[status] = out.get(status, 0) + 1
        return out

    def inserting(self, request_id: str) -> bool:
        """Whether an insert of this request id is queued (submitted, not yet written)."""
        return any(b is not None and request_id in b.inserts for b in (self._pending, self._retry, self._writing))

    @property
    def pending(self) -> int:
        """Rows waiting to be written (including a batch kept for another try)."""
        return len(self._pending) + (len(self._retry) if self._retry is not None else 0)

    @property
    def buffered(self) -> int:
        """Rows held in memory and not written yet: pending, kept for another try, or being written now."""
        n = len(self._pending)
        if self._retry is not None:
            n += len(self._retry)
        if self._writing is not None and self._writing is not self._retry:
            n += len(self._writing)
        return n

    def refusal(self) -> str | None:
        """Why a new request must be refused now (past `max_buffered` held rows), or None: `store_refusal`."""
        return store_refusal(self.buffered, self.max_buffered, self.outage)

    @property
    def running(self) -> bool:
        """Whether the background flush task is alive."""
        return self._task is not None and not self._task.done()

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background flush task (on the running loop). MUST fail if started twice or after
        stop()."""
        self._check_open()
        if self._task is not None:
            raise RuntimeError("BatchWriter already started")
        self._ensure_primitives()
        self._task = asyncio.create_task(self._run(), name="tetri-batch-writer")

    async def flush(self) -> None:
        """Write whatever is pending now and wait until it is committed.

        If the write fails, the batch is kept for the next try (after stop(): dropped after `MAX_TRIES`,
        with an error log) and the database error is raised to the caller. Works without start().
        """
        await self._flush()

    async def stop(self) -> None:
        """Close the writer: later `submit_*` calls raise `WriterClosedError`; end the background task;
        then flush what is pending, trying each batch up to `MAX_TRIES` more times (with backoff between
        tries). Does not raise for a failing database — what cannot be written is dropped with an error
        log. Idempotent."""
        self._closed = True
        self._stopping = True
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task
        if self._retry is not None:
            self._retry.tries = 0  # the tries of an outage were not given up on: these are the last
        delay = BACKOFF_FIRST_S
        while self.pending:
            try:
                await self._flush()
            except Exception:  # already logged by _flush
                if self.pending:
                    await asyncio.sleep(delay)
                    delay = next_backoff(delay)

    # ---- internals -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError("BatchWriter is stopped; the write was not accepted")

    def _ensure_primitives(self) -> None:
        # Created lazily so a BatchWriter can be constructed outside a running loop.
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._wake is None:
            self._wake = asyncio.Event()

    def _maybe_wake(self) -> None:
        # not while the store is unavailable: the next try waits out its backoff, however much is pending
        if self._wake is not None and self.outage is None and len(self._pending) >= self.max_batch:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            wait = self.flush_interval_s if self.outage is None else self._backoff_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                break
            # A failure is logged by _flush, and its batch kept for the next try.
            with contextlib.suppress(Exception):
                await self._flush()

    async def _flush(self) -> None:
        self._ensure_primitives()
        assert self._lock is not None
        async with self._lock:
            tried = self._retry is not None or len(self._pending) > 0
            if self._retry is not None:
                await self._write(self._retry)  # raises if it fails again: _pending waits behind it
                self._retry = None
            if len(self._pending):
                batch, self._pending = self._pending, _Batch()
                await self._write(batch)
            if tried:  # the store took all it was given (a failed try raises)
                self._dropping_samples = False
                if self.outage is not None:
                    self._store_back()

    def _unavailable(self, e: BaseException) -> None:
        """A try failed for the store's own reasons (not while stopping): the outage begins (one warning)
        or goes on (its cause kept up to date, the next try later)."""
        cause = describe(e)
        if self.outage is None:
            self.outages += 1
            self._outage_began = asyncio.get_running_loop().time()
            self._written_before = self.rows_written
            self._backoff_s = BACKOFF_FIRST_S
            logger.warning(
                "the status table is unavailable (%s): holding its rows and retrying until it is back "
                "(%d held; new requests are refused past %d)",
                cause,
                self.buffered,
                self.max_buffered,
            )
        else:
            self._backoff_s = next_backoff(self._backoff_s)
        self.outage = cause

    def _store_back(self) -> None:
        took = asyncio.get_running_loop().time() - self._outage_began
        held = self.rows_written - self._written_before
        logger.warning("the status table is back after %.1f s: the %d rows held for it are written", took, held)
        self.outage = None
        self._backoff_s = BACKOFF_FIRST_S

    async def _write(self, batch: _Batch) -> None:
        """One try at one batch in a worker thread; if the database refuses it, row by row (module doc).
        Rows kept for another try become `_retry` (while stopping, dropped after `MAX_TRIES`), and the
        error is raised."""
        self._writing = batch
        try:
            await self._write_once(batch)
        finally:
            self._writing = None

    async def _write_once(self, batch: _Batch) -> None:
        try:
            written = await asyncio.to_thread(
                self.store.write_batch,
                inserts=list(batch.inserts.values()),
                updates=batch.updates,
                load_samples=batch.samples,
            )
        except Exception as e:
            cause: BaseException = e
            if _content_error(e):  # a row's content: find it, write the others
                self._again = None
                written, batch = await asyncio.to_thread(self._write_rows, batch)
                self.rows_written += written
                if not len(batch):
                    self.flushes += 1
                    return
                cause = self._again or e  # why the rows left failed
            batch.tries += 1
            self.failed_flushes += 1
            if not self._stopping:  # held until the store takes it (module doc)
                self._retry = batch
                self._unavailable(cause)
            elif batch.tries >= MAX_TRIES:
                self._retry = None
                self.rows_dropped += len(batch)
                logger.error(
                    "stopping: dropping %d status-table rows after %d failed tries (%d inserts, %d updates, "
                    "%d load samples): %s",
                    len(batch),
                    batch.tries,
                    len(batch.inserts),
                    len(batch.updates),
                    len(batch.samples),
                    describe(cause),
                )
            else:
                self._retry = batch
                logger.warning(
                    "stopping: status-table flush failed (try %d of %d; %s); keeping %d rows for the next try",
                    batch.tries,
                    MAX_TRIES,
                    describe(cause),
                    len(batch),
                )
            raise
        self.flushes += 1
        self.rows_written += written

    def _write_rows(self, batch: _Batch) -> tuple[int, _Batch]:
        """(In a worker thread.) Each row of a refused batch in its own transaction. Returns the rows
        written and a batch of those that failed for the database's own reasons (to try again)."""
        again = _Batch(tries=batch.tries)
        written = 0
        updates = dict(batch.updates)
        for rid, row in batch.inserts.items():
            original = batch.original.get(rid, row)
            outcome = self._one(rid, partial(self.store.write_batch, inserts=[row]), quiet=row != original)
            if outcome == "bad" and row != original:  # perhaps an update merged into it: split them again
                later = {k: v for k, v in row.items() if k not in original or original[k] != v}
                outcome = self._one(rid, partial(self.store.write_batch, inserts=[original]))
                if outcome == "ok":
                    updates[rid] = later | updates.get(rid, {})
            if outcome == "bad":  # its updates belong to the refused row: never to another row with its id
                updates.pop(rid, None)
            written += outcome == "ok"
            if outcome == "again":
                again.inserts[rid] = row
                again.original[rid] = original
        for rid, fields in updates.items():
            if rid in again.inserts:  # its insert waits: the update lands with it
                again.inserts[rid].update(fields)
                continue
            outcome = self._one(rid, partial(self.store.write_batch, updates={rid: fields}))
            if outcome == "bad":  # do not leave the row `running`: write how it ended, without the bad value
                ending = {k: v for k, v in fields.items() if k in ENDING_FIELDS}
                if ending and ending != fields:
                    outcome = self._one(rid, partial(self.store.write_batch, updates={rid: ending}))
                last = {k: v for k, v in fields.items() if k in ("status", "phase", "finished_ts")}
                if outcome == "bad" and "status" in last and last != ending:  # values the daemon made itself
                    outcome = self._one(rid, partial(self.store.write_batch, updates={rid: last}))
            written += outcome == "ok"
            if outcome == "again":
                again.updates[rid] = fields
        for sample in batch.samples:
            outcome = self._one(str(sample.get("instance_id")), partial(self.store.write_batch, load_samples=[sample]))
            written += outcome == "ok"
            if outcome == "again":
                again.samples.append(sample)
        return written, again

    def _one(self, rid: str, write: Callable[[], int], quiet: bool = False) -> str:
        """Write one row: "ok"; "again" (the database's own failure: try it later); "bad" (its content:
        logged and dropped, unless `quiet` — the caller tries it another way)."""
        try:
            write()
        except Exception as e:
            if not _content_error(e):
                self._again = e
                return "again"
            if not quiet:
                self.rows_dropped += 1
                logger.error("status table refused the row of %s; dropped: %s", rid, _one_line(e))
            return "bad"
        return "ok"


def store_unavailable(e: BaseException) -> bool:
    """Whether an error says the store itself failed — a full disk, a server stopped or unreachable, a
    dropped connection, a lock, a missing table, no connection free in the pool: any database error but a
    row's content (`IntegrityError`, `DataError`), and any `OSError` — so what was to be written waits for
    it. Reads that fail so are answered 503 (`store_unavailable`)."""
    if isinstance(e, OSError | PoolTimeoutError | DisconnectionError):
        return True
    return isinstance(e, DBAPIError) and not isinstance(e, IntegrityError | DataError)


def _content_error(e: BaseException) -> bool:
    """Whether the database refused a row for what it holds (a duplicate key, a value out of range or not
    encodable) rather than failing itself (`store_unavailable`: try again). Raised before the statement
    reached the database (encoding, integer range), SQLAlchemy wraps it in a StatementError that is not a
    DBAPIError, or it arrives bare."""
    return not store_unavailable(e)


def describe(e: BaseException) -> str:
    """An error in one line, its driver's class named: `sqlite3.OperationalError: database or disk is
    full`, `psycopg.OperationalError: connection failed: … Connection refused`."""
    orig = e.orig if isinstance(e, DBAPIError) and e.orig is not None else e
    kind = type(orig)
    package = kind.__module__.split(".")[0]
    return f"{kind.__qualname__ if package == 'builtins' else f'{package}.{kind.__qualname__}'}: {_one_line(orig)}"


def next_backoff(delay_s: float) -> float:
    """The wait before the next try of an unavailable store: double the last, within [0.1 s, 2 s]."""
    return min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, delay_s * 2))


def store_refusal(buffered: int, limit: int, outage: str | None) -> str | None:
    """Why a new request is refused for the status table, or None: only once `buffered` rows (held, not
    written) reach `limit`; the message names the cause."""
    if buffered < limit:
        return None
    if outage is not None:
        return (
            f"the status table is unavailable ({outage}); {buffered} rows buffered (store_buffer_rows "
            f"{limit}): new requests are refused until it is back"
        )
    return (
        f"the status table is behind: {buffered} rows buffered (store_buffer_rows {limit}): new requests are "
        "refused until they are written"
    )


def _one_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


# an update's fields that say how a request ended (kept when the rest of the update is refused)
ENDING_FIELDS = frozenset(
    {"phase", "status", "finished_ts", "jct_ms", "finish_reason", "error", "output_tokens", "migrations"}
)


def _check_columns(fields: Iterable[str], allowed: frozenset[str]) -> None:
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"unknown column(s): {', '.join(unknown)}")
