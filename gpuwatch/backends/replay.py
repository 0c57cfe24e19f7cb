"""A backend that plays a recorded trace back (``gpuwatch run --backend replay --replay.file F``).

Replay time is ``t = (clock.monotonic() - first open()) × speed`` seconds into the trace; every call
answers with the state the trace was in at ``t``:

- ``open()``/``discover()``/reads raise BackendUnavailable when the latest backend_up/backend_down
  record at or before ``t`` is a backend_down (with the recorded reason, message and hint);
- ``discover()`` returns the GPUs of the latest ``gpus`` record;
- ``read_fast``/``read_slow`` return the latest sample of that GPU, or raise DeviceLost when that
  GPU's latest record (of any tier) is ``lost``;
- ``wait_events`` returns the XID records whose ``t`` passed since the last call.

Before the first record of a kind, the first one answers (a recording's first records come a moment
after its time zero). Without ``loop`` the last state holds after the end; with ``loop`` the trace
repeats every ``duration + fast_interval`` seconds (its last poll plus one interval), XIDs included.
Like the simulated backend, ``close()`` then ``open()`` resumes where replay time is, it does not
start over. Every lookup is a bisection over per-GPU time arrays: O(log n) in the trace's length.
"""

from __future__ import annotations

import math
import sys
import threading
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent
from gpuwatch.trace import (
    BackendDownRecord,
    BackendUpRecord,
    FastRecord,
    GpusRecord,
    LostRecord,
    SlowRecord,
    Trace,
    XidRecord,
)

#: Reported by open() when the trace says nothing about the driver.
UNKNOWN_DRIVER = DriverInfo(driver_version="unknown", nvml_version="unknown", cuda_driver_version="unknown")
# Longest real-time slice of a wait_events wait, so that close() and new events are seen promptly.
_EVENT_POLL_SECONDS = 0.25
# A looping replay starts over at most this often (trace seconds), and one call delivers the XIDs of at most
# _MAX_LOOPS of its periods: a header's fast_interval of 1e-300 (positive, so valid) or a huge speed made one
# wait_events walk 10**300 periods, spinning a CPU and piling up XIDs until the memory ran out.
_MIN_PERIOD = 0.001
_MAX_LOOPS = 100

T = TypeVar("T")


@dataclass
class _Series(Generic[T]):
    """Values in time order; ``at(t)`` is the latest at or before ``t``, else the first."""

    times: list[float] = field(default_factory=list)
    values: list[T] = field(default_factory=list)

    def add(self, t: float, value: T) -> None:
        self.times.append(t)
        self.values.append(value)

    def index_at(self, t: float) -> int | None:
        if not self.times:
            return None
        return max(0, bisect_right(self.times, t) - 1)


@dataclass
class _GpuSeries:
    fast: _Series[FastSample] = field(default_factory=_Series)
    slow: _Series[SlowSample] = field(default_factory=_Series)
    # every fast/slow record (None: answering) and every lost record, for "is it lost at t"
    status: _Series[LostRecord | None] = field(default_factory=_Series)


class ReplayBackend:
    """Plays ``trace`` back at ``speed`` times real time (see the module docstring)."""

    name = "replay"

    def __init__(self, trace: Trace, clock: Clock, speed: float = 1.0, loop: bool = False) -> None:
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"replay speed must be a positive number, got {speed!r}")
        self._trace = trace
        self._clock = clock
        self._speed = float(speed)
        self._loop = bool(loop)
        self._period = max(trace.duration + trace.header.fast_interval, _MIN_PERIOD)
        self._state: _Series[BackendUpRecord | BackendDownRecord] = _Series()
        self._discoveries: _Series[tuple[DiscoveredGpu, ...]] = _Series()
        self._gpus: dict[str, _GpuSeries] = {}
        self._xids: _Series[XidRecord] = _Series()
        for record in trace.records:
            self._index(record)
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._open = False
        self._closed = threading.Event()
        self._events_until = -1.0  # XIDs up to this (unwrapped) replay time have been delivered

    @property
    def trace(self) -> Trace:
        return self._trace

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def loop(self) -> bool:
        return self._loop

    @property
    def period(self) -> float:
        """Seconds of trace time after which a looping replay starts over."""
        return self._period

    def _index(self, record: object) -> None:
        if isinstance(record, (BackendUpRecord, BackendDownRecord)):
            self._state.add(record.t, record)
        elif isinstance(record, GpusRecord):
            self._discoveries.add(record.t, record.gpus)
        elif isinstance(record, FastRecord):
            gpu = self._gpus.setdefault(record.uuid, _GpuSeries())
            gpu.fast.add(record.t, record.sample)
            gpu.status.add(record.t, None)
        elif isinstance(record, SlowRecord):
            gpu = self._gpus.setdefault(record.uuid, _GpuSeries())
            gpu.slow.add(record.t, record.sample)
            gpu.status.add(record.t, None)
        elif isinstance(record, LostRecord):
            self._gpus.setdefault(record.uuid, _GpuSeries()).status.add(record.t, record)
        elif isinstance(record, XidRecord):
            self._xids.add(record.t, record)

    # -- the Backend protocol ------------------------------------------------------------------
    def open(self) -> DriverInfo:
        with self._lock:
            if self._t0 is None:
                self._t0 = self._clock.monotonic()
            state = self._state_at(self._now())
            if isinstance(state, BackendDownRecord):
                raise BackendUnavailable(state.reason, state.message, state.hint)
            self._open = True
            self._closed = threading.Event()
            if isinstance(state, BackendUpRecord):
                return state.driver
            return self._trace.header.driver or UNKNOWN_DRIVER

    def close(self) -> None:
        with self._lock:
            self._open = False
            self._closed.set()

    def discover(self) -> list[DiscoveredGpu]:
        with self._lock:
            t = self._up_now()
            i = self._discoveries.index_at(t)
            return [] if i is None else list(self._discoveries.values[i])

    def read_fast(self, uuid: str) -> FastSample:
        with self._lock:
            gpu, t = self._answering(uuid)
            return self._sample(gpu.fast, t, uuid, "fast")

    def read_slow(self, uuid: str) -> SlowSample:
        with self._lock:
            gpu, t = self._answering(uuid)
            return self._sample(gpu.slow, t, uuid, "slow")

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        remaining = max(0.0, float(timeout_seconds))
        while True:
            with self._lock:
                self._check_open()
                elapsed = self._elapsed()
                events = self._due_events(elapsed)
                if not events:
                    self._up_at(self._wrap(elapsed))
                next_in = self._seconds_to_next_event(elapsed)
                closed = self._closed
            if events or remaining <= 0.0:
                return events
            wait = min(remaining, _EVENT_POLL_SECONDS, max(next_in, 0.001))
            if closed.wait(wait):
                return []
            remaining -= wait

    # -- internals (called with the lock held) -------------------------------------------------
    def _elapsed(self) -> float:
        """Unwrapped replay time: seconds of trace time since the first open()."""
        if self._t0 is None:
            return 0.0
        return max(0.0, (self._clock.monotonic() - self._t0) * self._speed)

    def _wrap(self, elapsed: float) -> float:
        if self._loop and self._period > 0:
            return elapsed % self._period
        return elapsed

    def _now(self) -> float:
        return self._wrap(self._elapsed())

    def _state_at(self, t: float) -> BackendUpRecord | BackendDownRecord | None:
        i = self._state.index_at(t)
        return None if i is None else self._state.values[i]

    def _check_open(self) -> None:
        if not self._open:
            raise BackendUnavailable(
                "not_open",
                "the replay backend is not open",
                "call open() first (the poller does this on start and after errors)",
            )

    def _up_at(self, t: float) -> None:
        state = self._state_at(t)
        if isinstance(state, BackendDownRecord):
            raise BackendUnavailable(state.reason, state.message, state.hint)

    def _up_now(self) -> float:
        self._check_open()
        t = self._now()
        self._up_at(t)
        return t

    def _answering(self, uuid: str) -> tuple[_GpuSeries, float]:
        t = self._up_now()
        gpu = self._gpus.get(uuid)
        if gpu is None:
            raise DeviceLost(uuid, f"the trace has no readings of GPU {uuid}")
        i = gpu.status.index_at(t)
        lost = None if i is None else gpu.status.values[i]
        if lost is not None:
            raise DeviceLost(uuid, lost.message or "GPU is lost (replayed)")
        return gpu, t

    def _sample(self, series: _Series[T], t: float, uuid: str, tier: str) -> T:
        i = series.index_at(t)
        if i is None:
            raise DeviceLost(uuid, f"the trace has no {tier} readings of GPU {uuid}")
        return series.values[i]

    def _due_events(self, elapsed: float) -> list[XidEvent]:
        """XIDs with unwrapped time in (last call, elapsed], oldest first."""
        after, self._events_until = self._events_until, max(self._events_until, elapsed)
        if elapsed <= after or not self._xids.times:
            return []
        times = self._xids.times
        due: list[tuple[float, XidRecord]] = []
        if self._loop and self._period > 0:
            last = math.floor(min(elapsed / self._period, sys.float_info.max))  # inf: an absurd speed
            first = max(0, math.floor(min(after / self._period, sys.float_info.max)), last - _MAX_LOOPS + 1)
            for k in range(first, last + 1):
                base = k * self._period
                lo, hi = bisect_right(times, after - base), bisect_right(times, elapsed - base)
                due.extend((base + times[i], self._xids.values[i]) for i in range(lo, hi))
        else:
            lo, hi = bisect_right(times, after), bisect_right(times, elapsed)
            due.extend((times[i], self._xids.values[i]) for i in range(lo, hi))
        wall = self._clock.wall()
        return [
            XidEvent(uuid=record.uuid, xid=record.xid, timestamp=wall - (elapsed - at) / self._speed)
            for at, record in due
        ]

    def _seconds_to_next_event(self, elapsed: float) -> float:
        """Real seconds until the next XID comes due (inf when none will)."""
        times: Sequence[float] = self._xids.times
        if not times:
            return math.inf
        i = bisect_right(times, self._wrap(elapsed))
        if i < len(times):
            gap = times[i] - self._wrap(elapsed)
        elif self._loop and self._period > 0:
            gap = self._period - self._wrap(elapsed) + times[0]
        else:
            return math.inf
        return gap / self._speed
