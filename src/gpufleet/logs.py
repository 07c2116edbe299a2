"""Structured logs for gpufleet's long-running programs: one event per line, `key=value` or JSON.

The device plugin and the extender log through here, so one log pipeline parses both.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = logging.getLogger("gpufleet")


def log_event(event: str, level: int | str = logging.INFO, exc: BaseException | None = None,
              **fields: Any) -> None:
    """Log one event with its fields (None-valued ones are left out), and a traceback when given `exc`."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if LOGGER.isEnabledFor(numeric):
        LOGGER.log(numeric, event, exc_info=exc,
                   extra={"fields": {k: v for k, v in fields.items() if v is not None}})


def _kv(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class KeyValueFormatter(logging.Formatter):
    """`ts=… level=… event=… k=v …`."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record."""
        parts = [f"ts={_timestamp(record)}", f"level={record.levelname.lower()}",
                 f"event={_kv(record.getMessage())}"]
        parts += [f"{k}={_kv(v)}" for k, v in getattr(record, "fields", {}).items()]
        if record.exc_info:
            parts.append(f"exc={_kv(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record."""
        doc: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(),
                               "event": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "kv") -> None:
    """Send gpufleet's logs to stderr in the chosen format (replacing earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level.upper())
    LOGGER.propagate = False
