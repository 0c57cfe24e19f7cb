"""Recorder: a Backend that forwards every call to another and writes what came back to a trace."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gpuwatch.backends.base import Backend
from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.logs import get_logger
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent
from gpuwatch.trace import TraceWriter


class Recorder:
    """A Backend that forwards every call to ``inner`` and records what came back in ``writer``.

    Discoveries, samples, DeviceLost, BackendUnavailable (from any call), successful opens and XID
    events are written with ``t = clock.monotonic() - writer.start`` (``clock`` must be the
    writer's clock). Recording never changes what the caller sees: a sample that cannot be
    recorded (a NaN reading) is skipped and counted in ``skipped``; when the file cannot be written
    (disk full) recording stops, ``error`` says why, and the calls keep being forwarded.
    """

    def __init__(self, inner: Backend, writer: TraceWriter, clock: Clock) -> None:
        self.name = inner.name
        self._inner = inner
        self._writer = writer
        self._clock = clock
        self._lock = threading.Lock()
        self._error: str | None = None
        self._skipped = 0
        self._log = get_logger(component="recorder", backend=inner.name)

    @property
    def inner(self) -> Backend:
        return self._inner

    @property
    def error(self) -> str | None:
        """Why recording stopped (the trace file could not be written), or None."""
        return self._error

    @property
    def skipped(self) -> int:
        """Records that could not be encoded and were left out."""
        return self._skipped

    # -- the Backend protocol ------------------------------------------------------------------
    def open(self) -> DriverInfo:
        try:
            driver = self._inner.open()
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_backend_up, driver)
        return driver

    def close(self) -> None:
        self._inner.close()

    def discover(self) -> list[DiscoveredGpu]:
        try:
            gpus = self._inner.discover()
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_gpus, list(gpus))
        return gpus

    def read_fast(self, uuid: str) -> FastSample:
        try:
            sample = self._inner.read_fast(uuid)
        except DeviceLost as exc:
            self._record(self._writer.write_lost, uuid, tier="fast", message=str(exc))
            raise
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_fast, uuid, sample)
        return sample

    def read_slow(self, uuid: str) -> SlowSample:
        try:
            sample = self._inner.read_slow(uuid)
        except DeviceLost as exc:
            self._record(self._writer.write_lost, uuid, tier="slow", message=str(exc))
            raise
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_slow, uuid, sample)
        return sample

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        try:
            events = self._inner.wait_events(timeout_seconds)
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        for event in events:
            self._record(self._writer.write_xid, event.uuid, event.xid, timestamp=event.timestamp)
        return events

    # -- internals -----------------------------------------------------------------------------
    def _down(self, exc: BackendUnavailable) -> None:
        self._record(self._writer.write_backend_down, exc.reason, exc.message, exc.hint)

    def _record(self, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        # One lock around "read the clock, write": records from several threads stay in time order.
        with self._lock:
            if self._error is not None or self._writer.closed:
                return
            t = max(0.0, self._clock.monotonic() - self._writer.start)
            try:
                write(*args, t=t, **kwargs)
            except ValueError as exc:
                if self._writer.closed:  # closed while a poll was still in flight: nothing to record
                    return
                self._skipped += 1
                if self._skipped == 1:
                    self._log.warning("trace_record_skipped", error=str(exc),
                                      hint="the backend returned a value JSON cannot hold; "
                                           "further skips are only counted")
            except OSError as exc:
                self._error = f"cannot write {self._writer.name}: {exc.strerror or exc}"
                self._log.error("trace_write_failed", error=self._error,
                                hint="free disk space or record to another file; the recording stops here")
