"""A real PostgreSQL server for the tests: its own data directory in a temp dir, on a free loopback port,
started once per test session and stopped at its end; a fresh database per test.

The server binaries come from Debian's `postgresql` package (`/usr/lib/postgresql/<major>/bin`, or
`TETRI_PG_BIN`). Without them the PostgreSQL tests skip with that reason, unless `TETRI_REQUIRE_POSTGRES=1`
(CI sets it): then they fail. As root (CI), the server runs as the `postgres` user: initdb refuses root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest


def bin_dir() -> Path | None:
    env = os.environ.get("TETRI_PG_BIN")
    if env:
        return Path(env)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


def require() -> Path:
    """The server's bin directory, or skip (fail under TETRI_REQUIRE_POSTGRES=1) when there is none."""
    where = bin_dir()
    if where is None or not (where / "postgres").exists():
        why = "PostgreSQL's server binaries are not installed (apt-get install postgresql)"
        if os.environ.get("TETRI_REQUIRE_POSTGRES") == "1":
            raise RuntimeError(f"TETRI_REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)
    return where


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self) -> None:
        self.bin = require()
        # its own directory right under /tmp: as the postgres user it cannot enter pytest's (root's, 0700)
        root = self.root = Path(tempfile.mkdtemp(prefix="tetri-pg-"))
        self.port = _free_port()
        self.data = root / "data"
        self.user: pwd.struct_passwd | None = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        if self.user is not None:
            os.chown(root, self.user.pw_uid, self.user.pw_gid)
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                   "--no-instructions"])  # fmt: skip
        self.start()

    def start(self) -> None:
        """Start the server on its data directory and port; return once it accepts connections."""
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
             "-k", str(self.root), "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **self._demote(),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                             capture_output=True).returncode != 0:  # fmt: skip
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.stderr else ""  # type: ignore[union-attr]
                raise RuntimeError(f"postgres did not start: {err[-2000:]}")
            time.sleep(0.1)

    def halt(self) -> None:
        """Stop the server as an operator would, keeping its data (`pg_ctl stop -m fast`: connections are
        cut, the port refuses); `start()` brings it back on the same port and data."""
        self._run([str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w"])
        self.proc.wait(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def _demote(self) -> dict[str, int]:
        """Popen's `user` and `group` (set in C between fork and exec: no Python code runs in the forked
        copy of a process that may hold gRPC threads, tetri/children.py)."""
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid}

    def _run(self, argv: list[str]) -> None:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, **self._demote())
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: smart shutdown; connections are the tests' and closed
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)
