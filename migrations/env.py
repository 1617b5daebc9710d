"""Alembic environment for Tetri's status tables.

Used by both paths that run migrations:

- the daemon, through `daemon.db.store.migrate()`, which passes the URL (or an open connection, for
  in-memory SQLite) in `config.attributes`;
- operators and CI, through `python -m alembic -c alembic.ini ...`, where the URL comes from
  `-x url=...`, else the TETRI_DB_URL environment variable, else `sqlalchemy.url` in alembic.ini.

`render_as_batch=True` so that ALTERs work on SQLite (Alembic recreates the table). While migrating
SQLite, foreign keys are switched off: with them on, the DROP TABLE inside a batch recreation of
`instances` would cascade-delete every row of `load_samples`.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from daemon.db.models import Base
from daemon.db.store import ensure_sqlite_parent_dir

config = context.config

# Only the CLI has an ini file; keep the daemon's own loggers alive when it does.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _database_url() -> str:
    """The URL to migrate: migrate()'s argument, else -x url=..., else $TETRI_DB_URL, else the ini."""
    url = config.attributes.get("url")
    if url:
        return str(url)
    x_url = context.get_x_argument(as_dictionary=True).get("url")
    if x_url:
        return x_url
    env_url = os.environ.get("TETRI_DB_URL")
    if env_url:
        return env_url
    ini_url = config.get_main_option("sqlalchemy.url")
    if not ini_url:
        raise RuntimeError("no database URL: pass -x url=..., set TETRI_DB_URL, or set sqlalchemy.url")
    return ini_url


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) instead of touching a database."""
    context.configure(
        url=_database_url(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    fk_was_on = False
    if connection.dialect.name == "sqlite":
        # PRAGMA foreign_keys is ignored inside a transaction: end the one SQLAlchemy auto-began.
        fk_was_on = bool(connection.exec_driver_sql("PRAGMA foreign_keys").scalar())
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    try:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=True,
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        if connection.in_transaction():
            connection.commit()
    finally:
        if fk_was_on:
            if connection.in_transaction():
                connection.rollback()
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def run_migrations_online() -> None:
    shared = config.attributes.get("connection")
    if shared is not None:
        # migrate(engine) hands over a connection (the only way to reach an in-memory SQLite database).
        _run_on(shared)
        return
    url = _database_url()
    ensure_sqlite_parent_dir(url)
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
