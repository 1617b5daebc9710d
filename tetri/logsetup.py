"""Where the daemon's and the workers' logs go, and in what form: `--log-level`, `--log-file`,
`--log-format text|json` (the settings `log_level`, `log_file`, `log_format`).

Text lines are for people (`time level logger: message`); JSON lines are for log shippers: one object a
line with `ts` (epoch seconds), `time` (ISO 8601 UTC), `level`, `logger`, `process` (daemon, or the
worker's role), `pid`, `message` and, for an exception, `exc` (its traceback as one string). uvicorn's
and gRPC's loggers go the same way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": self.process,
            "pid": os.getpid(),
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure_logging(level: str = "warning", file: str | None = None, fmt: str = "text", process: str = "") -> None:
    """Send every logger's records at `level` and above to `file` (appended; several processes may share
    it) or to stderr, as text or JSON lines. Replaces what was configured before."""
    handler: logging.Handler = (
        logging.FileHandler(file, encoding="utf-8") if file else logging.StreamHandler(sys.stderr)
    )
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        tag = f" {process}" if process else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s{tag} %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
