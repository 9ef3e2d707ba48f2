"""Log set-up: text for people, JSON lines for machines, stable fields on every line."""

from __future__ import annotations

import json
import logging
import sys
import time

# Fields a log line may carry besides its message (procrastinate-style ``extra``).
FIELDS = (
    "action",
    "event_id",
    "event_type",
    "aggregate_id",
    "attempt",
    "lsn",
    "slot",
    "error",
)


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in FIELDS if hasattr(record, name)}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v}" for k, v in _fields(record).items() if k != "action")
        line = f"{stamp} {record.levelname:<7} {record.getMessage()}"
        if extras:
            line += f"  [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def configure(fmt: str = "text", level: str = "INFO") -> None:
    """Send cdc_relay's logs to stderr in ``fmt`` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("cdc_relay")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
