"""structlog set-up, in one place: JSON lines when stderr is not a TTY (journald), console output on a TTY.

Event names are stable snake_case strings (``poll_failed``, ``gpu_lost``, ``backend_down``...);
context goes in keys (``gpu``, ``uuid``, ``tier``, ``reason``, ``hint``), never in the event text.

Logging never raises into the code that logs. When the reader of stderr is gone (journald
restarted, a closed pipe: EPIPE), the disk is full (ENOSPC) or a processor fails on an odd value,
the line is dropped and counted (``dropped_lines()``, exported as ``gpuwatch_log_dropped_total``);
the XID thread, a poll or a reload carries on. A line is written with one ``write(2)`` of its own,
so nothing is left in a buffer that could fail again at exit.

``Repeats`` keeps repeated events of one key (an XID storm on one GPU, a poll that fails on the
same GPU every 2 s) from flooding the log: the first few lines, then one summary line per interval
with the count (``repeated``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TextIO

from gpuwatch.deferred import load

# structlog.dev imports rich, better_exceptions and colorama at import time where they are installed
# (most ML nodes have rich and colorama), for pretty tracebacks and Windows colours in its
# ConsoleRenderer: about 5 MB of RSS and 90 modules in a daemon that writes JSON lines. They are
# hidden while structlog loads (the console format then prints plain tracebacks) and visible again
# afterwards to anything else in the process.
_HIDDEN = [name for name in ("rich", "better_exceptions", "colorama") if name not in sys.modules]
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]  # None: "import rich" raises ImportError
try:
    load("structlog", "asyncio")  # structlog uses asyncio only in its async methods: gpuwatch.deferred
    import structlog
finally:
    for _name in _HIDDEN:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")

_dropped = 0
_dropped_lock = threading.Lock()
_write_lock = threading.Lock()
_current: dict[str, Any] = {"stream": None}


def dropped_lines() -> int:
    """Log lines lost since start: the sink could not be written, or the line could not be made."""
    return _dropped


def _drop() -> None:
    global _dropped
    with _dropped_lock:
        _dropped += 1


def _event_first(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """timestamp, level and event lead every line; the context keys follow."""
    head: dict[str, Any] = {k: event_dict.pop(k) for k in ("timestamp", "level", "event") if k in event_dict}
    return {**head, **event_dict}


def _file_descriptor(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: an in-memory stream
        return None


class _Sink:
    """structlog's final logger: writes one rendered line, whole, and never raises.

    ``stream`` None means whatever ``sys.stderr`` is at the time of writing (tests and daemons may
    swap it). A stream with a file descriptor is written with ``os.write`` (one system call per line,
    no buffer); others (pytest's capture, the demo's log tail) with ``write`` and ``flush``.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        line = message + "\n"
        with _write_lock:
            try:
                fd = _file_descriptor(stream)
                if fd is None:
                    stream.write(line)
                    stream.flush()
                    return
                try:
                    stream.flush()  # what print() may have left in the stream's buffer goes first
                except (OSError, ValueError):
                    pass
                data = memoryview(line.encode("utf-8", "backslashreplace"))
                while data:
                    data = data[os.write(fd, data):]
            except (OSError, ValueError):  # EPIPE, ENOSPC, EAGAIN, a closed file, an unencodable line
                _drop()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


def say(text: str) -> None:
    """One plain line on stderr for the person at the terminal (configuration errors, the demo's banner);
    like a log line it never raises: a stderr nobody reads (closed pipe, full disk) loses it, counted."""
    _Sink(None).msg(text)


def _never_raises(cls: type) -> type:
    class Safe(cls):  # a subclass of the class structlog makes for the level
        def _proxy_to_logger(self, method_name: str, event: str | None = None, **event_kw: Any) -> Any:
            try:
                return super()._proxy_to_logger(method_name, event, **event_kw)
            except Exception:  # a processor failed on an odd value: lose the line, not the caller
                _drop()
                return None

    return Safe


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def configure(level: str = "info", fmt: str | None = None, stream: TextIO | None = None) -> None:
    """Set up logging for the process; ``stream`` None: stderr as it is at each write."""
    _current.update(stream=stream)
    target = stream if stream is not None else sys.stderr
    if fmt is None:
        fmt = "console" if _isatty(target) else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(target))
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, _event_first]
    processors.append(renderer)
    sink = _Sink(stream)
    structlog.configure(
        processors=processors,
        wrapper_class=_never_raises(structlog.make_filtering_bound_logger(getattr(logging, level.upper()))),
        logger_factory=lambda *_args: sink,
        cache_logger_on_first_use=False,
    )
    # Libraries log through stdlib logging; keep their noise out (APScheduler's "skipped: maximum
    # number of running instances reached" is reported by gpuwatch itself as poll_overrun).
    logging.getLogger("apscheduler").setLevel(logging.ERROR)


def reconfigure(level: str, fmt: str | None) -> None:
    """New level and format (SIGHUP), same destination."""
    configure(level, fmt, _current["stream"])


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("gpuwatch").bind(**context)


class Repeats:
    """Rate limit for events that can repeat without end, per key.

    ``log(level, event, key, **context)`` writes the first ``burst`` events of a key in each
    ``interval``; the others are counted, and the first event after the interval (or ``flush()``,
    called periodically) writes one summary line: the same event and context with ``repeated`` = how
    many lines were held back and ``window_seconds``. Counters elsewhere still count every event.
    """

    def __init__(self, logger: Any, burst: int = 3, interval: float = 60.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._burst = burst
        self._interval = interval
        self._monotonic = monotonic
        self._lock = threading.Lock()
        # key -> [window start, lines written in the window, held back, level, event, context of the last]
        self._keys: dict[Hashable, list[Any]] = {}

    def log(self, level: str, event: str, key: Hashable, **context: Any) -> None:
        now = self._monotonic()
        summary = None
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None and now - entry[0] >= self._interval:
                summary = self._close(entry)
                entry = None
            if entry is None:
                self._keys[key] = [now, 1, 0, level, event, context]
                write = True
            elif entry[1] < self._burst:
                entry[1] += 1
                write = True
            else:
                entry[2] += 1
                entry[3:] = [level, event, context]
                write = False
        if summary is not None:
            self._write(*summary)
        if write:
            getattr(self._log, level)(event, **context)

    def _close(self, entry: list[Any]) -> tuple[str, str, dict[str, Any]] | None:
        if not entry[2]:
            return None
        context = {k: v for k, v in entry[5].items() if k != "exc_info"}
        return entry[3], entry[4], {**context, "repeated": entry[2], "window_seconds": self._interval}

    def _write(self, level: str, event: str, context: dict[str, Any]) -> None:
        getattr(self._log, level)(event, **context)

    def flush(self) -> None:
        """Write the summaries of the windows that are over, and forget their keys."""
        now = self._monotonic()
        summaries = []
        with self._lock:
            for key, entry in list(self._keys.items()):
                if now - entry[0] >= self._interval:
                    del self._keys[key]
                    summary = self._close(entry)
                    if summary is not None:
                        summaries.append(summary)
        for summary in summaries:
            self._write(*summary)
