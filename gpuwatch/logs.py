"""structlog set-up: JSON lines when stderr is not a TTY (journald), console output on a TTY.

Event names are stable snake_case strings (``poll_failed``, ``gpu_lost``, ``backend_down``...);
context goes in keys (``gpu``, ``uuid``, ``tier``, ``reason``, ``hint``), never in the event text.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")


def _event_first(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """timestamp, level and event lead every line; the context keys follow."""
    head = {k: event_dict.pop(k) for k in ("timestamp", "level", "event") if k in event_dict}
    return {**head, **event_dict}


class _Stderr:
    """Whatever sys.stderr is at the time of writing (tests and daemons may swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str = "info", fmt: str | None = None, stream: TextIO | None = None) -> None:
    stream = stream or _Stderr()  # type: ignore[assignment]
    if fmt is None:
        fmt = "console" if stream.isatty() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, _event_first]
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries log through stdlib logging; keep their noise out (APScheduler's "skipped: maximum
    # number of running instances reached" is reported by gpuwatch itself as poll_overrun).
    logging.getLogger("apscheduler").setLevel(logging.ERROR)


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("gpuwatch").bind(**context)
