"""Time sources. Code takes a Clock so that tests never patch ``time``."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class FakeClock:
    """A clock that only moves when told to (``advance``). ``sleep`` advances it."""

    def __init__(self, wall: float = 1_700_000_000.0, monotonic: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._wall = wall
        self._mono = monotonic

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def wall(self) -> float:
        with self._lock:
            return self._wall

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
            self._mono += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
