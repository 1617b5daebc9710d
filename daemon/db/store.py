"""The status-table store: engine set-up, migrations at start-up, and every SQL statement the daemon runs.

The store is synchronous (one SQLAlchemy engine, plain methods); the async daemon calls it from a
thread with `asyncio.to_thread`, and the token-streaming path never calls it directly: it hands its
writes to `daemon.db.writer.BatchWriter`, which batches them into one transaction per flush.

Rules kept here:

- Rows come back as plain dicts (column name → value), never ORM objects.
- Column names are never spliced into SQL text; unknown field names raise `ValueError`.
- Status transitions are `UPDATE … WHERE <allowed-from-state>`: an illegal transition matches nothing
  and the method says so by its return value (it does not raise).

It must not import the planner, a web or RPC framework, or read a clock: timestamps are arguments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    Engine,
    Table,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    make_url,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import StaticPool

import daemon

from .models import Base, Phase, Status

logger = logging.getLogger(__name__)

REQUESTS: Table = Base.metadata.tables["requests"]
INSTANCES: Table = Base.metadata.tables["instances"]
LOAD_SAMPLES: Table = Base.metadata.tables["load_samples"]
FLIPS: Table = Base.metadata.tables["flips"]
POLICY_CHANGES: Table = Base.metadata.tables["policy_changes"]

REQUEST_COLUMNS = frozenset(REQUESTS.c.keys())
LOAD_SAMPLE_COLUMNS = frozenset(LOAD_SAMPLES.c.keys())
FLIP_COLUMNS = frozenset(FLIPS.c.keys())

# An update's `status` and `phase` apply only while the request is running, so a late update cannot
# resurrect a cancelled or interrupted request; its other fields are written whatever the status (see
# Store.write_batch). The guard is per field, not per update, so merging updates (daemon.db.writer) never
# changes what lands.
TRANSITION_FIELDS = frozenset({"status", "phase"})

INTERRUPTED_ERROR = "daemon restarted while in flight"


# --------------------------------------------------------------------------------------------------------
# engine and migrations


def migrations_dir() -> Path:
    """The Alembic script directory: `<repository>/migrations`, located from the `daemon` package.

    The setuptools package list holds only tetrictl/daemon/workers, so the migrations are found next to
    the source tree (editable install or a checkout on sys.path). Raises `FileNotFoundError` if absent.
    """
    path = Path(daemon.__file__).resolve().parent.parent / "migrations"
    if not (path / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic migrations not found at {path} (expected migrations/env.py next to the daemon "
            "package); run the daemon from a checkout or an editable install (pip install -e .)"
        )
    return path


def _is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def _is_sqlite_memory(url: URL) -> bool:
    database = url.database or ""
    if database in ("", ":memory:"):
        return True
    return database.startswith("file:") and "mode=memory" in database


def ensure_sqlite_parent_dir(url: str | URL) -> None:
    """For a SQLite file URL, create the directory that will hold the file; otherwise do nothing."""
    parsed = make_url(url)
    if not _is_sqlite(parsed) or _is_sqlite_memory(parsed):
        return
    database = parsed.database or ""
    if database.startswith("file:"):  # a URI filename (uri=true): leave it to SQLite
        return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str) -> Engine:
    """Create the engine for `url`.

    SQLite file (tested): the parent directory is created, and every new connection gets
    `PRAGMA journal_mode=WAL` (readers do not block the writer), `synchronous=NORMAL` (safe with WAL,
    an fsync per checkpoint instead of per commit) and `foreign_keys=ON`.

    SQLite in-memory (`sqlite://`, tested): one connection shared by all threads (StaticPool,
    `check_same_thread=False`), because each new connection would otherwise see a different, empty
    database; `synchronous=NORMAL` and `foreign_keys=ON` as above, no WAL. Meant for tests.

    Any other URL (e.g. PostgreSQL; not tested) is passed through to `create_engine` unchanged.
    """
    parsed = make_url(url)
    if not _is_sqlite(parsed):
        return create_engine(parsed)

    memory = _is_sqlite_memory(parsed)
    if memory:
        engine = create_engine(parsed, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        ensure_sqlite_parent_dir(parsed)
        engine = create_engine(parsed)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if not memory:
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    return engine


def alembic_config(url: str | None = None) -> Config:
    """An Alembic `Config` for the repository's migrations, without reading alembic.ini.

    `url`, when given, is handed to migrations/env.py through `config.attributes` (not through the ini
    parser, so a `%` in a password needs no escaping) and wins over `-x url`/`TETRI_DB_URL`.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    if url is not None:
        cfg.attributes["url"] = url
    return cfg


def migrate(target: str | Engine) -> None:
    """Bring the database to the newest revision (`alembic upgrade head`); a no-op if it is already there.

    Safe to call on every daemon start. `target` is a URL, or an engine (the only way to migrate an
    in-memory SQLite database, whose contents live in the engine's one connection). Fails loudly if the
    migrations are missing or have more than one head.
    """
    if isinstance(target, Engine):
        cfg = alembic_config()
        with target.connect() as connection:
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "head")
        return
    command.upgrade(alembic_config(target), "head")


# --------------------------------------------------------------------------------------------------------
# the store


def _check_fields(fields: Iterable[str], allowed: frozenset[str], table: str) -> None:
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"unknown {table} column(s): {', '.join(unknown)}")


def _rows(result: Iterable[Any]) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in result]


class Store:
    """Synchronous access to the status tables. Thread-safe as far as the engine's pool is (one
    connection per call); the daemon calls it via `asyncio.to_thread`.

    `Store(engine)` uses an engine from `make_engine`; `Store.open(url)` makes one and migrates it.
    `close()` disposes the engine.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, url: str, *, run_migrations: bool = True) -> Store:
        """Create the engine for `url` and (by default) migrate the database to the newest revision."""
        engine = make_engine(url)
        try:
            if run_migrations:
                migrate(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    def close(self) -> None:
        """Dispose the engine (closes pooled connections). The store must not be used afterwards."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def latest_timestamp(self) -> float | None:
        """The latest time recorded in any status table (None when they are empty). The daemon starts its
        cluster clock no earlier, so times stay monotonic across restarts on a scaled clock."""
        columns = (
            REQUESTS.c.arrival_ts,
            REQUESTS.c.finished_ts,
            INSTANCES.c.registered_ts,
            INSTANCES.c.last_report_ts,
            LOAD_SAMPLES.c.ts,
            FLIPS.c.started_ts,
            FLIPS.c.done_ts,
            POLICY_CHANGES.c.ts,
        )
        with self.engine.connect() as conn:
            found = [conn.execute(select(func.max(c))).scalar() for c in columns]
        return max((float(v) for v in found if v is not None), default=None)

    # ---- requests ------------------------------------------------------------------------------------

    def recover_interrupted(self, now: float) -> int:
        """At daemon start: every `running` request becomes `interrupted` (phase unchanged,
        `finished_ts=now`, `error="daemon restarted while in flight"`). Returns how many changed.

        One `UPDATE … WHERE status='running'`: finished, failed, cancelled … rows are untouched, and a
        second call changes nothing (returns 0).
        """
        return self._interrupt(REQUESTS.c.status == Status.RUNNING.value, now, INTERRUPTED_ERROR)

    def recover_own(self, now: float) -> int:
        """At a daemon's start: its own `running` rows (those of no front) become `interrupted`, as
        `recover_interrupted` does; the rows of fronts that followed it wait for `interrupt_orphans`."""
        where = (REQUESTS.c.status == Status.RUNNING.value) & REQUESTS.c.front.is_(None)
        return self._interrupt(where, now, INTERRUPTED_ERROR)

    def interrupt_front(self, front: str, now: float) -> int:
        """A front died (its stream to the controller ended and it did not come back): its `running`
        rows become `interrupted` (`error="front … died while in flight"`). Returns how many changed."""
        where = (REQUESTS.c.status == Status.RUNNING.value) & (REQUESTS.c.front == front)
        return self._interrupt(where, now, f"front {front} died while in flight")

    def interrupt_orphans(self, live_fronts: Iterable[str], now: float) -> int:
        """At a controller's (or daemon's) start, once its fronts had time to reconnect: the `running`
        rows of every other front become `interrupted` (rows of no front: `recover_own`)."""
        live = list(live_fronts)
        where = (REQUESTS.c.status == Status.RUNNING.value) & REQUESTS.c.front.is_not(None)
        if live:
            where = where & REQUESTS.c.front.not_in(live)
        return self._interrupt(where, now, INTERRUPTED_ERROR)

    def _interrupt(self, where: Any, now: float, error: str) -> int:
        stmt = update(REQUESTS).where(where).values(status=Status.INTERRUPTED.value, finished_ts=now, error=error)
        with self.engine.begin() as conn:
            return int(conn.execute(stmt).rowcount)

    def insert_request(self, **fields: Any) -> None:
        """Insert one request. `id`, `model` and `arrival_ts` are required; phase/status default to
        queued/running. MUST fail: an unknown field (`ValueError`), a missing required field or a
        duplicate id (`sqlalchemy.exc.IntegrityError`)."""
        _check_fields(fields, REQUEST_COLUMNS, "requests")
        with self.engine.begin() as conn:
            conn.execute(insert(REQUESTS).values(**fields))

    def get_request(self, request_id: str) -> dict[str, Any] | None:
        """The request as a dict, or None if there is no such id."""
        with self.engine.connect() as conn:
            row = conn.execute(select(REQUESTS).where(REQUESTS.c.id == request_id)).first()
        return None if row is None else dict(row._mapping)

    def get_requests(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The rows of these ids that exist, by id (one query)."""
        if not request_ids:
            return {}
        with self.engine.connect() as conn:
            rows = _rows(conn.execute(select(REQUESTS).where(REQUESTS.c.id.in_(request_ids))))
        return {r["id"]: r for r in rows}

    def list_requests(
        self,
        phase: str | None = None,
        status: str | None = None,
        limit: int = 100,
        offset: int = 0,
        id_prefix: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """One page of requests, newest arrival first (ties by id ascending), and the total count that
        matches the filters (for pagination). `None` filters are not applied. MUST fail with
        `ValueError` on a negative limit or offset."""
        if limit < 0 or offset < 0:
            raise ValueError(f"limit and offset must be >= 0 (got limit={limit}, offset={offset})")
        conditions = []
        if phase is not None:
            conditions.append(REQUESTS.c.phase == phase)
        if status is not None:
            conditions.append(REQUESTS.c.status == status)
        if id_prefix:
            conditions.append(REQUESTS.c.id.startswith(id_prefix, autoescape=True))
        page = (
            select(REQUESTS)
            .where(*conditions)
            .order_by(REQUESTS.c.arrival_ts.desc(), REQUESTS.c.id.asc())
            .limit(limit)
            .offset(offset)
        )
        total = select(func.count()).select_from(REQUESTS).where(*conditions)
        with self.engine.connect() as conn:
            rows = _rows(conn.execute(page))
            count = int(conn.execute(total).scalar_one())
        return rows, count

    def window_requests(self, since_ts: float, until_ts: float) -> list[dict[str, Any]]:
        """Running and finished requests that arrived in [since_ts, until_ts], oldest first: the window
        the `advise` flip policy replays (id, arrival_ts, prompt_tokens, max_tokens, output_tokens,
        status, predicted_hi)."""
        c = REQUESTS.c
        query = (
            select(c.id, c.arrival_ts, c.prompt_tokens, c.max_tokens, c.output_tokens, c.status, c.predicted_hi)
            .where(c.arrival_ts >= since_ts, c.arrival_ts <= until_ts, c.status.in_(("running", "finished")))
            .order_by(c.arrival_ts.asc(), c.id.asc())
        )
        with self.engine.connect() as conn:
            return _rows(conn.execute(query))

    def training_samples(self, limit: int = 5000) -> list[tuple[list[int], int]]:
        """(prompt sample, output tokens) of the newest finished requests that kept a prompt sample —
        what the learned length predictor trains on."""
        q = (
            select(REQUESTS.c.prompt_sample, REQUESTS.c.output_tokens)
            .where(REQUESTS.c.status == "finished", REQUESTS.c.prompt_sample.is_not(None))
            .order_by(REQUESTS.c.arrival_ts.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [(json.loads(p), int(o)) for p, o in conn.execute(q)]

    def count_by_status(self) -> dict[str, int]:
        """Number of requests per status; every `Status` value is present (0 when none)."""
        counts = {s.value: 0 for s in Status}
        stmt = select(REQUESTS.c.status, func.count()).group_by(REQUESTS.c.status)
        with self.engine.connect() as conn:
            for status, n in conn.execute(stmt):
                counts[str(status)] = int(n)
        return counts

    def cancel_request(self, request_id: str, now: float) -> bool:
        """Cancel a running request: status `cancelled`, phase `done`, `finished_ts=now`.

        Returns whether a row changed. A no-op returning False (never an error) for an unknown id or a
        request that is not running — already finished, failed, cancelled, interrupted …
        """
        stmt = (
            update(REQUESTS)
            .where(REQUESTS.c.id == request_id, REQUESTS.c.status == Status.RUNNING.value)
            .values(status=Status.CANCELLED.value, phase=Phase.DONE.value, finished_ts=now)
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    def update_request(self, request_id: str, **fields: Any) -> bool:
        """Set fields of one request (same rule as a batched update, see `write_batch`: `status` and
        `phase` change only while the request is running, the other fields whatever its status). Returns
        whether a row changed. MUST fail with `ValueError` on an unknown field, `id`, or no fields."""
        _check_update_fields(fields)
        with self.engine.begin() as conn:
            return any(conn.execute(stmt).rowcount > 0 for stmt in _guarded_updates(request_id, fields))

    def write_batch(
        self,
        inserts: Iterable[Mapping[str, Any]] = (),
        updates: Mapping[str, Mapping[str, Any]] | None = None,
        load_samples: Iterable[Mapping[str, Any]] = (),
    ) -> int:
        """Write one batch in ONE transaction: request inserts, then request updates, then load samples.

        Rows with the same set of fields go in one executemany statement. `updates` maps request id →
        fields; an update's `status` and `phase` apply only while the request is `running`
        (UPDATE … WHERE id = ? AND status = 'running'), so a late update does not undo a cancel or a
        recovery; its other fields are written whatever the status (a separate UPDATE … WHERE id = ?).
        An update for a missing id matches nothing. A load sample of an instance that has no `instances`
        row (not registered yet, or gone) is skipped with a warning instead of failing the batch, so
        telemetry cannot make request rows be dropped. Returns the number of rows handed to the database.
        MUST fail (and roll back the whole batch) on any other database error, e.g. a duplicate insert or
        a missing table.
        """
        insert_rows = [dict(r) for r in inserts]
        sample_rows = [dict(r) for r in load_samples]
        update_items = list((updates or {}).items())
        for row in insert_rows:
            _check_fields(row, REQUEST_COLUMNS, "requests")
        for _, fields in update_items:
            _check_update_fields(fields)
        for row in sample_rows:
            _check_fields(row, LOAD_SAMPLE_COLUMNS, "load_samples")
        if not (insert_rows or update_items or sample_rows):
            return 0

        with self.engine.begin() as conn:
            _insert_grouped(conn, REQUESTS, insert_rows)
            _update_requests_grouped(conn, update_items)
            sample_rows = _samples_of_known_instances(conn, sample_rows)
            _insert_grouped(conn, LOAD_SAMPLES, sample_rows)
        return len(insert_rows) + len(update_items) + len(sample_rows)

    # ---- instances -----------------------------------------------------------------------------------

    def upsert_instance(
        self,
        id: str,
        role: str,
        state: str,
        address: str,
        model: str,
        kv_capacity_tokens: int,
        registered_ts: float,
    ) -> None:
        """Register an instance, or overwrite these fields of an existing one (re-registration);
        `last_report_ts` of an existing row is kept. Atomic on SQLite and PostgreSQL (ON CONFLICT)."""
        values = {
            "id": id,
            "role": role,
            "state": state,
            "address": address,
            "model": model,
            "kv_capacity_tokens": kv_capacity_tokens,
            "registered_ts": registered_ts,
        }
        changed = {k: v for k, v in values.items() if k != "id"}
        with self.engine.begin() as conn:
            dialect = conn.dialect.name
            if dialect == "sqlite":
                sqlite_stmt = sqlite_insert(INSTANCES).values(**values)
                conn.execute(sqlite_stmt.on_conflict_do_update(index_elements=[INSTANCES.c.id], set_=changed))
                return
            if dialect == "postgresql":
                pg_stmt = pg_insert(INSTANCES).values(**values)
                conn.execute(pg_stmt.on_conflict_do_update(index_elements=[INSTANCES.c.id], set_=changed))
                return
            # Other backends (untested): update, else insert, in one transaction.
            result = conn.execute(update(INSTANCES).where(INSTANCES.c.id == id).values(**changed))
            if result.rowcount == 0:
                conn.execute(insert(INSTANCES).values(**values))

    def set_instance_state(self, instance_id: str, state: str) -> bool:
        """Set an instance's state; returns False (no error) for an unknown id."""
        stmt = update(INSTANCES).where(INSTANCES.c.id == instance_id).values(state=state)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    def touch_instance(self, instance_id: str, ts: float) -> bool:
        """Record a load report's time (`last_report_ts`); returns False (no error) for an unknown id."""
        stmt = update(INSTANCES).where(INSTANCES.c.id == instance_id).values(last_report_ts=ts)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    def list_instances(self) -> list[dict[str, Any]]:
        """All instances, by id."""
        with self.engine.connect() as conn:
            return _rows(conn.execute(select(INSTANCES).order_by(INSTANCES.c.id)))

    # ---- load samples --------------------------------------------------------------------------------

    def add_load_samples(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Insert load samples (one transaction); an empty list is a no-op. Returns how many. MUST fail
        on an unknown field (`ValueError`) or, on SQLite with foreign keys on, an unknown
        `instance_id` (`IntegrityError`)."""
        sample_rows = [dict(r) for r in rows]
        for row in sample_rows:
            _check_fields(row, LOAD_SAMPLE_COLUMNS, "load_samples")
        if not sample_rows:
            return 0
        with self.engine.begin() as conn:
            _insert_grouped(conn, LOAD_SAMPLES, sample_rows)
        return len(sample_rows)

    def prune_load_samples(self, older_than_ts: float) -> int:
        """Retention: delete samples with `ts < older_than_ts` (a sample at exactly that time is kept).
        Returns how many were deleted."""
        stmt = delete(LOAD_SAMPLES).where(LOAD_SAMPLES.c.ts < older_than_ts)
        with self.engine.begin() as conn:
            return int(conn.execute(stmt).rowcount)

    def list_load_samples(self, instance_id: str | None = None) -> list[dict[str, Any]]:
        """Samples, oldest first (optionally of one instance)."""
        stmt = select(LOAD_SAMPLES).order_by(LOAD_SAMPLES.c.ts, LOAD_SAMPLES.c.id)
        if instance_id is not None:
            stmt = stmt.where(LOAD_SAMPLES.c.instance_id == instance_id)
        with self.engine.connect() as conn:
            return _rows(conn.execute(stmt))

    # ---- flips and policy changes --------------------------------------------------------------------

    def record_flip(
        self,
        instance_id: str,
        from_role: str,
        to_role: str,
        reason: str,
        requested_by: str,
        started_ts: float,
    ) -> int:
        """Record the start of an instance flip; returns the flip's id."""
        stmt = insert(FLIPS).values(
            instance_id=instance_id,
            from_role=from_role,
            to_role=to_role,
            reason=reason,
            requested_by=requested_by,
            started_ts=started_ts,
        )
        with self.engine.begin() as conn:
            key = conn.execute(stmt).inserted_primary_key
        assert key is not None
        return int(key[0])

    def update_flip(self, flip_id: int, **fields: Any) -> bool:
        """Set fields of a flip (e.g. `drained_ts`, `done_ts`, `outcome`); returns False for an unknown
        id. MUST fail with `ValueError` on an unknown field, `id`, or no fields."""
        _check_fields(fields, FLIP_COLUMNS - {"id"}, "flips")
        if not fields:
            raise ValueError("update_flip needs at least one field")
        with self.engine.begin() as conn:
            return conn.execute(update(FLIPS).where(FLIPS.c.id == flip_id).values(**fields)).rowcount > 0

    def list_flips(self, instance_id: str | None = None) -> list[dict[str, Any]]:
        """Flips, oldest first (optionally of one instance)."""
        stmt = select(FLIPS).order_by(FLIPS.c.started_ts, FLIPS.c.id)
        if instance_id is not None:
            stmt = stmt.where(FLIPS.c.instance_id == instance_id)
        with self.engine.connect() as conn:
            return _rows(conn.execute(stmt))

    def record_policy_change(
        self,
        ts: float,
        field: str,
        old_value: str | None,
        new_value: str,
        requested_by: str,
    ) -> int:
        """Append to the policy audit trail; returns the entry's id."""
        stmt = insert(POLICY_CHANGES).values(
            ts=ts, field=field, old_value=old_value, new_value=new_value, requested_by=requested_by
        )
        with self.engine.begin() as conn:
            key = conn.execute(stmt).inserted_primary_key
        assert key is not None
        return int(key[0])

    def latest_policies(self) -> dict[str, Any]:
        """Each audited policy field's latest value (decoded JSON): the policies last in force, as the
        audit trail ends in the cluster's state (every change, and a start's own, is recorded)."""
        stmt = select(POLICY_CHANGES.c.field, POLICY_CHANGES.c.new_value).order_by(POLICY_CHANGES.c.id)
        with self.engine.connect() as conn:
            return {field: json.loads(value) for field, value in conn.execute(stmt)}

    def policy_changes_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(POLICY_CHANGES)).scalar() or 0)

    def list_policy_changes(self) -> list[dict[str, Any]]:
        """The policy audit trail, oldest first."""
        stmt = select(POLICY_CHANGES).order_by(POLICY_CHANGES.c.ts, POLICY_CHANGES.c.id)
        with self.engine.connect() as conn:
            return _rows(conn.execute(stmt))


# --------------------------------------------------------------------------------------------------------
# batching helpers


def _check_update_fields(fields: Mapping[str, Any]) -> None:
    if not fields:
        raise ValueError("a request update needs at least one field")
    _check_fields(fields, REQUEST_COLUMNS - {"id"}, "requests (updatable)")


def _samples_of_known_instances(conn: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not rows:
        return rows
    wanted = {r.get("instance_id") for r in rows}
    known = set(conn.execute(select(INSTANCES.c.id).where(INSTANCES.c.id.in_(wanted))).scalars())
    kept = [r for r in rows if r.get("instance_id") in known]
    if len(kept) < len(rows):
        logger.warning(
            "skipping %d load sample(s) of unregistered instance(s): %s",
            len(rows) - len(kept),
            ", ".join(sorted(str(i) for i in wanted - known)),
        )
    return kept


def _insert_grouped(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """executemany per distinct set of keys (an executemany needs the same keys in every row)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    for group in groups.values():
        conn.execute(insert(table), group)


def _split(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An update's fields: (written whatever the status, written only while running)."""
    free = {k: v for k, v in fields.items() if k not in TRANSITION_FIELDS}
    return free, {k: v for k, v in fields.items() if k in TRANSITION_FIELDS}


def _guarded_updates(request_id: str, fields: Mapping[str, Any]) -> list[Any]:
    """One request's update as statements: its free fields, then its transition fields (while running)."""
    free, transition = _split(fields)
    stmts = [update(REQUESTS).where(REQUESTS.c.id == request_id).values(**free)] if free else []
    if transition:
        stmts.append(
            update(REQUESTS)
            .where(REQUESTS.c.id == request_id, REQUESTS.c.status == Status.RUNNING.value)
            .values(**transition)
        )
    return stmts


def _update_requests_grouped(conn: Connection, items: list[tuple[str, Mapping[str, Any]]]) -> None:
    """One executemany UPDATE per distinct set of fields: the free fields of every update first, then the
    transition fields (while running). Bind names are prefixed so they never clash with the column names
    SQLAlchemy reserves for the SET clause."""
    for guarded in (False, True):
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for request_id, fields in items:
            part = _split(fields)[guarded]
            if not part:
                continue
            params = {f"v_{k}": v for k, v in part.items()}
            params["k_id"] = request_id
            groups.setdefault(tuple(sorted(part)), []).append(params)
        for keys, params_list in groups.items():
            stmt = update(REQUESTS).where(REQUESTS.c.id == bindparam("k_id"))
            stmt = stmt.values({k: bindparam(f"v_{k}") for k in keys})
            if guarded:
                stmt = stmt.where(REQUESTS.c.status == Status.RUNNING.value)
            conn.execute(stmt, params_list)
