"""TraceWriter: a trace written line by line, each line flushed, so a killed recorder leaves a readable prefix."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterable, Mapping
from typing import IO, Any

from gpuwatch import __version__
from gpuwatch.clock import Clock
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample
from gpuwatch.trace.codec import encode_driver, encode_fast, encode_float, encode_gpu, encode_int, encode_slow
from gpuwatch.trace.records import FORMAT, TIERS, VERSION


class TraceWriter:
    """Writes a trace: the header at once, then one line per ``write_*`` call, flushed.

    ``target`` is a path (the file is created or truncated, and closed by ``close()``) or an open
    text file (left open). ``t`` of a record is, unless given, seconds since the writer was made by
    ``clock.monotonic()``; given times must not go backwards. Safe to use from several threads.
    ``write_*`` raise ValueError for what cannot be recorded (a NaN reading), before writing
    anything, and OSError when the file cannot be written.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | IO[str],
        clock: Clock,
        *,
        backend: str,
        fast_interval: float,
        slow_interval: float,
        driver: DriverInfo | None = None,
    ) -> None:
        for name, value in (("fast_interval", fast_interval), ("slow_interval", slow_interval)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self._clock = clock
        self._lock = threading.Lock()
        self._last_t = 0.0
        self._records = 0
        if isinstance(target, (str, os.PathLike)):
            self.name = os.fspath(target)
            self._file: IO[str] = open(target, "w", encoding="utf-8", newline="\n")
            self._owned = True
        else:
            self.name = getattr(target, "name", "<stream>")
            self._file = target
            self._owned = False
        self._closed = False
        self.start = clock.monotonic()
        self.created = clock.wall()
        header: dict[str, Any] = {
            "type": "header",
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "backend": backend,
            "driver": None if driver is None else encode_driver(driver),
            "fast_interval": float(fast_interval),
            "slow_interval": float(slow_interval),
            "gpuwatch": __version__,
        }
        try:
            self._write_line(header)
        except BaseException:
            if self._owned:
                self._file.close()
            raise

    # -- records ------------------------------------------------------------------------------
    def write_gpus(self, gpus: Iterable[DiscoveredGpu], *, t: float | None = None) -> None:
        self._record("gpus", {"gpus": [encode_gpu(g) for g in gpus]}, t)

    def write_fast(self, uuid: str, sample: FastSample, *, t: float | None = None) -> None:
        self._record("fast", {"uuid": uuid, **encode_fast(sample)}, t)

    def write_slow(self, uuid: str, sample: SlowSample, *, t: float | None = None) -> None:
        self._record("slow", {"uuid": uuid, **encode_slow(sample)}, t)

    def write_lost(
        self, uuid: str, *, tier: str | None = None, message: str | None = None, t: float | None = None
    ) -> None:
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        fields_: dict[str, Any] = {"uuid": uuid}
        if tier is not None:
            fields_["tier"] = tier
        if message:
            fields_["message"] = message
        self._record("lost", fields_, t)

    def write_xid(self, uuid: str, xid: int, *, timestamp: float | None = None, t: float | None = None) -> None:
        fields_: dict[str, Any] = {"uuid": uuid, "xid": encode_int(xid)}
        if timestamp is not None:
            fields_["timestamp"] = encode_float(timestamp)
        self._record("xid", fields_, t)

    def write_backend_down(self, reason: str, message: str, hint: str = "", *, t: float | None = None) -> None:
        self._record("backend_down", {"reason": reason, "message": message, "hint": hint}, t)

    def write_backend_up(self, driver: DriverInfo, *, t: float | None = None) -> None:
        self._record("backend_up", {"driver": encode_driver(driver)}, t)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def records(self) -> int:
        """Records written so far (the header not counted)."""
        return self._records

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owned:
                self._file.close()
            else:
                self._file.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _record(self, kind: str, body: dict[str, Any], t: float | None) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"the trace writer of {self.name} is closed")
            if t is None:
                t = self._clock.monotonic() - self.start
            if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"t must be a finite number of seconds >= 0, got {t!r}")
            t = round(float(t), 6)
            if t < self._last_t:
                raise ValueError(f"records must be written in time order: t={t} after t={self._last_t}")
            self._write_line({"t": t, "type": kind, **body})
            self._last_t = t
            self._records += 1

    def _write_line(self, obj: Mapping[str, Any]) -> None:
        # Encode first: a value JSON cannot hold raises before anything reaches the file.
        line = json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()
