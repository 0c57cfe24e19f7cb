"""A GPU's samples as the rule engine keeps them, with what rules derive from them kept per sample.

Only the engine appends and trims; rules read a History through their Window (gpuwatch/rules/window.py).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: The key of a series a rule declares (Rule.predicates, Rule.columns, Rule.derived): (rule id, name).
SeriesKey = tuple[str, str]

#: History.trim drops samples from the front of its lists in chunks of at least this many (and at
#: least half of the list), so that trimming costs O(1) amortized per sample, not O(length).
_CHUNK = 16  # expired samples dropped at once: memory stays within the window + 16 samples


class History(Generic[T]):
    """One GPU's samples in time order, oldest first, as the engine keeps them (one append per poll).

    ``samples`` holds the samples and ``times`` their monotonic times (an array of doubles: a list of
    (time, sample) pairs held a tuple and a float object per sample, 96 bytes where this holds 16: 0.8 MB at
    64 GPUs), valid from index ``start`` to ``end`` (older entries are dropped in chunks, so indices change
    only then).
    Looking back bisects ``times`` instead of walking the samples. What a rule derives from the
    samples is kept here and extended once per new sample, never recomputed over the window:

    - ``tally`` / ``first_last``: how many samples since a time match a predicate, and the first
      and last that do, in O(log n) from running counts of the predicate;
    - ``column``: one value per sample (e.g. the temperature), to slice and sum;
    - ``derive``: any value computed from the samples since a time, recomputed only when a sample
      enters or leaves that part of the history.

    Each is kept under the (rule id, name) of a series a rule declares (``SeriesKey``), never under
    a function's identity: as many caches as declared series, however often they are asked for and
    whatever functions the rules make. Only Window asks, with the key and function a rule declares
    (Window.tally, first_last, column, derive). Read a History, never change it: only the engine
    appends and trims.
    """

    __slots__ = ("samples", "times", "start", "_counts", "_columns", "_derived", "_since", "_lo")

    def __init__(self, items: Iterable[tuple[float, T]] = ()) -> None:
        pairs = list(items)
        self.samples: list[T] = [sample for _, sample in pairs]
        self.times = array("d", [t for t, _ in pairs])
        self.start = 0
        # key -> running counts of its predicate, counts[j] = matching samples in samples[:j]; key ->
        # values of its getter, values[j] = getter(samples[j]). Both are extended lazily (when
        # asked), and only the entries from ``start`` on mean anything.
        # The running counts are arrays of 64-bit ints: a list would hold an int object (32 bytes) per sample
        # once the counts pass 256 (0.8 MB of the history at 64 GPUs, 0.5 s polls).
        self._counts: dict[SeriesKey, array[int]] = {}
        self._columns: dict[SeriesKey, list[Any]] = {}
        self._derived: dict[SeriesKey, tuple[int, int, Any]] = {}  # key -> (lo, end, value)
        self._since: float | None = None  # the last ``index`` asked for, and its answer
        self._lo = 0

    def __len__(self) -> int:
        return len(self.samples) - self.start

    @property
    def end(self) -> int:
        """One past the index of the newest sample."""
        return len(self.samples)

    @property
    def last_time(self) -> float | None:
        """Time of the newest sample appended (None when there is none)."""
        return self.times[-1] if self.times else None

    def append(self, t: float, sample: T) -> None:
        """Add the newest sample (``t`` after every time already kept)."""
        self.samples.append(sample)
        self.times.append(t)
        self._since = None

    def trim(self, horizon: float) -> None:
        """Forget the samples older than ``horizon``."""
        start = bisect.bisect_left(self.times, horizon, self.start)
        if start >= _CHUNK:
            del self.samples[:start]
            del self.times[:start]
            for key, counts in self._counts.items():
                if len(counts) > start:
                    del counts[:start]
                else:  # not asked for since: start over
                    self._counts[key] = array("q", (0,))
            for key, values in self._columns.items():
                if len(values) >= start:
                    del values[:start]
                else:
                    self._columns[key] = []
            self._derived.clear()  # their indices changed
            start = 0
        self.start = start
        self._since = None

    def index(self, since: float | None) -> int:
        """Index of the first sample at or after monotonic time ``since`` (``start`` for None)."""
        if since is None:
            return self.start
        if since != self._since:  # rules of one evaluation often look back as far: bisect once
            self._since, self._lo = since, bisect.bisect_left(self.times, since, self.start)
        return self._lo

    def pairs(self, since: float | None = None) -> list[tuple[float, T]]:
        """(time, sample) from ``since`` on, oldest first: a copy of that part only."""
        return self.between(self.index(since))

    def tail(self, since: float | None = None) -> list[T]:
        """The samples from ``since`` on, oldest first: a copy of that part only."""
        return self.samples[self.index(since):]

    def between(self, lo: int) -> list[tuple[float, T]]:
        """(time, sample) of the samples from index ``lo`` on, oldest first."""
        return list(zip(self.times[lo:], self.samples[lo:]))

    def pair(self, i: int) -> tuple[float, T]:
        """(time, sample) of the sample at index ``i``."""
        return self.times[i], self.samples[i]

    def cached(self) -> list[tuple[str, SeriesKey]]:
        """("tally", key), ("column", key) and ("derive", key) of every series kept (for tests: bounded by
        the series the rules declare)."""
        return ([("tally", key) for key in self._counts] + [("column", key) for key in self._columns]
                + [("derive", key) for key in self._derived])

    def _running(self, key: SeriesKey, predicate: Callable[[T], bool]) -> array[int]:
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = array("q", (0,)) * (self.start + 1)
        n = len(counts) - 1
        if n < len(self.samples):
            total = counts[-1]
            append = counts.append
            for sample in self.samples[n:]:
                if predicate(sample):
                    total += 1
                append(total)
        return counts

    def tally(self, key: SeriesKey, predicate: Callable[[T], bool], since: float | None = None) -> tuple[int, int]:
        """(samples for which ``predicate``, kept under ``key``, is true, all samples) from ``since`` on."""
        lo = self.index(since)
        counts = self._running(key, predicate)
        return counts[-1] - counts[lo], len(self.samples) - lo

    def first_last(self, key: SeriesKey, predicate: Callable[[T], bool],
                   since: float | None = None) -> tuple[tuple[float, T], tuple[float, T]] | None:
        """The oldest and the newest (time, sample) from ``since`` on for which ``predicate`` (kept
        under ``key``) is true (the same pair when only one is); None when there is none."""
        lo = self.index(since)
        counts = self._running(key, predicate)
        before, total = counts[lo], counts[-1]
        if total == before:
            return None
        end = len(self.samples)
        if total - before == end - lo:  # all of them (the usual case)
            return self.pair(lo), self.pair(end - 1)
        first = bisect.bisect_left(counts, before + 1, lo) - 1
        last = bisect.bisect_left(counts, total, first + 1) - 1
        return self.pair(first), self.pair(last)

    def column(self, key: SeriesKey, getter: Callable[[T], Any]) -> list[Any]:
        """``getter(sample)`` of every sample, kept under ``key``, at the samples' indices (from
        ``start`` to ``end``)."""
        values = self._columns.get(key)
        if values is None:
            values = self._columns[key] = [None] * self.start
        n = len(values)
        if n < len(self.samples):
            values.extend([getter(sample) for sample in self.samples[n:]])
        return values

    def derive(self, key: SeriesKey, compute: Callable[[History[T], int], Any], since: float | None = None) -> Any:
        """``compute(self, lo)``, ``lo`` the index of the first sample since ``since``: kept under
        ``key`` and computed again only once a sample entered or left ``samples[lo:]``."""
        lo, end = self.index(since), len(self.samples)
        kept = self._derived.get(key)
        if kept is not None and kept[0] == lo and kept[1] == end:
            return kept[2]
        value = compute(self, lo)
        self._derived[key] = (lo, end, value)
        return value
