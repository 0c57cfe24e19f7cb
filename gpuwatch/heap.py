"""The C heap under a long-lived daemon: glibc's malloc told to keep less of what it no longer uses.

Python hands every block over 512 bytes (a dict's table, a list, a rendered exposition, a gRPC answer) to
malloc, and glibc's malloc gives each thread an arena of its own at its first allocation (up to 8 per
CPU): the poll threads, the HTTP connections' threads, gRPC's. Memory freed in one arena is kept by
it for later use there, and the pages of free chunks between live ones stay resident. Under churn (jobs,
pods, MIG layouts coming and going, so that the sizes of what is allocated keep changing) the soak saw the
resident anonymous memory rise about 0.7 MB per 1,000 s while Python's live objects stayed flat
(tracemalloc), and ``malloc_trim(0)`` on the running daemon gave back 4 MB at once (docs/performance.md).

Two remedies, both glibc's own knobs, both without effect elsewhere (musl, macOS: nothing is done):

- ``limit_arenas()`` at start: at most ``ARENA_MAX`` arenas (``mallopt(M_ARENA_MAX)``, as the
  ``MALLOC_ARENA_MAX`` variable does; one the operator set, there or as ``GLIBC_TUNABLES``'
  ``glibc.malloc.arena_max``, wins). Threads past the cap share arenas; Python's threads allocate under
  the GIL, so they seldom contend for one: more arenas only spread the free memory thinner.
- ``Trimmer.maybe_trim()``, called by a periodic job: ``malloc_trim(0)`` at most every ``TRIM_SECONDS``,
  which gives the kernel back the whole free pages inside every arena and the free top of the main one
  (another arena's free top stays, up to malloc's trim threshold) (0.05–1.5 ms a call, measured).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

ARENA_MAX = 2
M_ARENA_MAX = -8  # malloc.h
TRIM_SECONDS = 60.0

_libc: Any = None


def _glibc() -> Any:
    """glibc's handle (the process's own symbols), or None where the C library is another."""
    global _libc
    if _libc is None:
        _libc = False
        try:
            glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
        except (ValueError, OSError):  # no such name here: another C library
            glibc = False
        if glibc:
            try:
                lib = ctypes.CDLL(None)
                lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
                lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _libc = lib
            except (OSError, AttributeError):
                pass
    return _libc or None


def limit_arenas(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """At most ARENA_MAX malloc arenas from now on (call before threads start: glibc ignores the cap once
    the process has had more than 8 arenas, and never removes one); False where nothing was done: not
    glibc, or the operator's own number (MALLOC_ARENA_MAX, GLIBC_TUNABLES=glibc.malloc.arena_max=N), which
    glibc read at start."""
    lib = _glibc()
    if lib is None or environ.get("MALLOC_ARENA_MAX"):
        return False
    if any(t.strip().startswith("glibc.malloc.arena_max=") for t in environ.get("GLIBC_TUNABLES", "").split(":")):
        return False
    return bool(lib.mallopt(M_ARENA_MAX, ARENA_MAX))


class Trimmer:
    """``malloc_trim(0)`` at most once every ``every`` seconds of ``monotonic`` time."""

    def __init__(self, every: float = TRIM_SECONDS, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._every, self._monotonic = every, monotonic
        self._last = monotonic()
        self.trims = 0

    def maybe_trim(self) -> bool:
        """Trims if it is time; True when it did."""
        now = self._monotonic()
        if now - self._last < self._every:
            return False
        self._last = now
        lib = _glibc()
        if lib is None:
            return False
        lib.malloc_trim(0)
        self.trims += 1
        return True
