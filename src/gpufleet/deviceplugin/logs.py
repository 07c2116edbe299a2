"""Structured logs: one event per line, `key=value` (or JSON), so operators can grep and ship them."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = logging.getLogger("gpufleet.deviceplugin")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def log_event(event: str, level: str = "info", **fields: Any) -> None:
    """Log one event with its fields; None-valued fields are left out."""
    numeric = _LEVELS[level]
    if LOGGER.isEnabledFor(numeric):
        LOGGER.log(numeric, event, extra={"fields": {k: v for k, v in fields.items() if v is not None}})


def _kv_value(value: Any) -> str:
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value)
        if isinstance(value, list | dict)
        else str(value)
    )
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """`ts=… level=… event=… k=v …` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record."""
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"event={_kv_value(record.getMessage())}"]
        parts += [f"{k}={_kv_value(v)}" for k, v in getattr(record, "fields", {}).items()]
        if record.exc_info:
            parts.append(f"exc={_kv_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record."""
        doc = {"ts": record.created, "level": record.levelname.lower(), "event": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "kv") -> None:
    """Send the plugin's logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(_LEVELS[level])
    LOGGER.propagate = False
