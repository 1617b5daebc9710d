"""The store suite runs on both databases the daemon supports: SQLite files and a real PostgreSQL server
(tests/pgserver.py: one per session, a fresh database per test)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state/tetri.db"
    return request.getfixturevalue("pg").new_database()
