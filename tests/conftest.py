"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pgserver import PgServer

# pytester: tests of tests/isolation.py; tests.isolation: the `isolated` marker (a test in its own process)
pytest_plugins = ("pytester", "tests.isolation")


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    """A real PostgreSQL server for the session (tests/pgserver.py); `pg.new_database()` per test."""
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()
