"""What a rule is: a pure function of a window of snapshots plus its configuration.

A rule never does I/O and never reads a clock: time comes from the snapshots
(``NodeSnapshot.taken_monotonic``). It returns an Observation for *now*; the engine turns
observations into pending -> firing -> resolved with hold and clear times.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gpuwatch.groups.jobs import JobUsage
from gpuwatch.model import FastSample, GpuHost, GpuState, NodeSnapshot, Observation, SlowSample


@dataclass(frozen=True)
class RuleConfig:
    """A rule's effective settings: defaults overridden by the YAML ``rules:`` section."""

    enabled: bool
    severity: str
    hold_seconds: float
    clear_seconds: float
    params: Mapping[str, float]
    every_seconds: float = 0.0  # evaluated at most this often (0: at every evaluation), Rule.every_seconds

    def __getitem__(self, name: str) -> float:
        return self.params[name]


T = TypeVar("T")

#: History.trim drops samples from the front of its lists in chunks of at least this many (and at
#: least half of the list), so that trimming costs O(1) amortized per sample, not O(length).
_CHUNK = 16  # expired samples dropped at once: memory stays within the window + 16 samples


class History(Generic[T]):
    """One GPU's samples in time order, oldest first, as the engine keeps them (one append per poll).

    ``items`` holds the (monotonic time, sample) pairs and ``times`` the times alone, valid from
    index ``start`` to ``end`` (older entries are dropped in chunks, so indices change only then).
    Looking back bisects ``times`` instead of walking the samples. What a rule derives from the
    samples is kept here and extended once per new sample, never recomputed over the window:

    - ``tally`` / ``first_last``: how many samples since a time match a predicate, and the first
      and last that do, in O(log n) from running counts of the predicate;
    - ``column``: one value per sample (e.g. the temperature), to slice and sum;
    - ``derive``: any value computed from the samples since a time, recomputed only when a sample
      enters or leaves that part of the history.

    The predicate, getter or key is also the key under which the result is kept: pass the same
    function object every time (a module-level function, or one made once and kept), never a new
    lambda per call. Read a History, never change it: only the engine appends and trims.
    """

    __slots__ = ("items", "times", "start", "_counts", "_columns", "_derived", "_since", "_lo")

    def __init__(self, items: Iterable[tuple[float, T]] = ()) -> None:
        self.items: list[tuple[float, T]] = list(items)
        self.times: list[float] = [t for t, _ in self.items]
        self.start = 0
        # predicate -> running counts, counts[j] = matching samples in items[:j]; getter -> values,
        # values[j] = getter(items[j][1]). Both are extended lazily (when asked), and only the
        # entries from ``start`` on mean anything.
        self._counts: dict[Callable[[T], bool], list[int]] = {}
        self._columns: dict[Callable[[T], Any], list[Any]] = {}
        self._derived: dict[Hashable, tuple[int, int, Any]] = {}  # key -> (lo, end, value)
        self._since: float | None = None  # the last ``index`` asked for, and its answer
        self._lo = 0

    def __len__(self) -> int:
        return len(self.items) - self.start

    @property
    def end(self) -> int:
        """One past the index of the newest sample."""
        return len(self.items)

    @property
    def last_time(self) -> float | None:
        """Time of the newest sample appended (None when there is none)."""
        return self.times[-1] if self.times else None

    def append(self, t: float, sample: T) -> None:
        """Add the newest sample (``t`` after every time already kept)."""
        self.items.append((t, sample))
        self.times.append(t)
        self._since = None

    def trim(self, horizon: float) -> None:
        """Forget the samples older than ``horizon``."""
        start = bisect.bisect_left(self.times, horizon, self.start)
        if start >= _CHUNK:
            del self.items[:start]
            del self.times[:start]
            for predicate, counts in self._counts.items():
                if len(counts) > start:
                    del counts[:start]
                else:  # not asked for since: start over
                    self._counts[predicate] = [0]
            for getter, values in self._columns.items():
                if len(values) >= start:
                    del values[:start]
                else:
                    self._columns[getter] = []
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
        return self.items[self.index(since):]

    def _running(self, predicate: Callable[[T], bool]) -> list[int]:
        counts = self._counts.get(predicate)
        if counts is None:
            counts = self._counts[predicate] = [0] * (self.start + 1)
        n = len(counts) - 1
        if n < len(self.items):
            total = counts[-1]
            append = counts.append
            for _, sample in self.items[n:]:
                if predicate(sample):
                    total += 1
                append(total)
        return counts

    def tally(self, predicate: Callable[[T], bool], since: float | None = None) -> tuple[int, int]:
        """(samples for which ``predicate`` is true, all samples) from ``since`` on."""
        lo = self.index(since)
        counts = self._running(predicate)
        return counts[-1] - counts[lo], len(self.items) - lo

    def first_last(self, predicate: Callable[[T], bool],
                   since: float | None = None) -> tuple[tuple[float, T], tuple[float, T]] | None:
        """The oldest and the newest (time, sample) from ``since`` on for which ``predicate`` is
        true (the same pair when only one is); None when there is none."""
        lo = self.index(since)
        counts = self._running(predicate)
        before, total = counts[lo], counts[-1]
        if total == before:
            return None
        end = len(self.items)
        if total - before == end - lo:  # all of them (the usual case)
            return self.items[lo], self.items[end - 1]
        first = bisect.bisect_left(counts, before + 1, lo) - 1
        last = bisect.bisect_left(counts, total, first + 1) - 1
        return self.items[first], self.items[last]

    def column(self, getter: Callable[[T], Any]) -> list[Any]:
        """``getter(sample)`` of every sample, at the samples' indices (from ``start`` to ``end``)."""
        values = self._columns.get(getter)
        if values is None:
            values = self._columns[getter] = [None] * self.start
        n = len(values)
        if n < len(self.items):
            values.extend([getter(sample) for _, sample in self.items[n:]])
        return values

    def derive(self, key: Hashable, compute: Callable[[History[T], int], Any], since: float | None = None) -> Any:
        """``compute(self, lo)``, ``lo`` the index of the first sample since ``since``: kept under
        ``key`` and computed again only once a sample entered or left ``items[lo:]``."""
        lo, end = self.index(since), len(self.items)
        kept = self._derived.get(key)
        if kept is not None and kept[0] == lo and kept[1] == end:
            return kept[2]
        value = compute(self, lo)
        self._derived[key] = (lo, end, value)
        return value


_NO_HISTORY: History[Any] = History()


class Window:
    """What rules see: the latest snapshot plus a bounded per-GPU history of fast (and slow) samples.

    The engine keeps the history incrementally (one append per GPU per poll) in ``History``
    objects, so looking back costs only the samples a rule asks for. Node-wide aggregates are
    computed once per Window (one Window per evaluation) and shared by every GPU's evaluation:
    the fresh samples of the node behind ``fast`` and ``peers``, and whatever a rule keeps with
    ``memo``. A test may pass plain lists of (time, sample) pairs, oldest first, as the history.
    """

    def __init__(self, latest: NodeSnapshot,
                 history: Mapping[str, History[FastSample] | Sequence[tuple[float, FastSample]]],
                 fast_staleness: float, expected_gpus: int = 0, now: float | None = None,
                 slow_history: Mapping[str, History[SlowSample] | Sequence[tuple[float, SlowSample]]] | None = None,
                 host_staleness: float | None = None) -> None:
        self.latest = latest
        self._slow_history = slow_history or {}
        self._now = latest.taken_monotonic if now is None else now
        self._history = history
        self.fast_staleness = fast_staleness
        self.expected_gpus = expected_gpus  # configured, else the most GPUs seen since start
        self._by_uuid = {state.identity.uuid: state for state in latest.gpus}
        self._fresh: dict[str, FastSample] | None = None
        self._fresh_list: list[tuple[str, FastSample]] | None = None
        self._wrapped: dict[tuple[bool, str], History[Any]] = {}
        self._memo: dict[Hashable, Any] = {}
        self.host_staleness = host_staleness  # the host groups' bound (the slow tier's); None: any age

    @property
    def now(self) -> float:
        """Monotonic time of this evaluation (at or after the latest snapshot)."""
        return self._now

    def gpu(self, uuid: str) -> GpuState | None:
        return self._by_uuid.get(uuid)

    def _fresh_samples(self) -> dict[str, FastSample]:
        """uuid -> latest fast sample, for the GPUs that are up and fresh (computed once)."""
        fresh = self._fresh
        if fresh is None:
            fresh = self._fresh = {}
            now, staleness = self._now, self.fast_staleness
            for uuid, state in self._by_uuid.items():
                sample = state.fresh_fast(now, staleness)
                if sample is not None:
                    fresh[uuid] = sample
        return fresh

    def fast(self, uuid: str) -> FastSample | None:
        """The GPU's latest fast sample, if it is up and fresh."""
        return self._fresh_samples().get(uuid)

    def fresh(self) -> list[tuple[str, FastSample]]:
        """(uuid, fresh fast sample) of every GPU of the node that has one, in snapshot order
        (computed once per Window: do not change the list)."""
        result = self._fresh_list
        if result is None:
            fresh = self._fresh_samples()
            result = self._fresh_list = [(state.identity.uuid, fresh[state.identity.uuid])
                                         for state in self.latest.gpus if state.identity.uuid in fresh]
        return result

    def peers(self, uuid: str) -> list[tuple[str, FastSample]]:
        """(uuid, fresh fast sample) of the other GPUs of the node.

        O(GPUs) per call: a rule that compares every GPU with its peers should aggregate
        ``fresh()`` once per evaluation with ``memo`` rather than call this for every GPU.
        """
        return [pair for pair in self.fresh() if pair[0] != uuid]

    def memo(self, key: Hashable, compute: Callable[[Window], Any]) -> Any:
        """``compute(self)``, computed once per Window for ``key``: for node-wide aggregates that
        every GPU's evaluation of a rule needs (e.g. the peers of each model, sorted by power)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute(self)
            return value

    def host(self, uuid: str) -> GpuHost | None:
        """The GPU's allocations from the last read of the host groups, while it is fresh."""
        state = self._by_uuid.get(uuid)
        if state is None:
            return None
        return state.host if self.host_staleness is None else state.fresh_host(self._now, self.host_staleness)

    def jobs(self) -> Mapping[tuple[str, str], JobUsage]:
        """(scheduler, job id) -> the job's host side (the jobs group), from a fresh host read (once per Window)."""
        return self.memo(("jobs",), _jobs)

    def slow(self, uuid: str) -> SlowSample | None:
        state = self._by_uuid.get(uuid)
        return None if state is None else state.slow

    def history(self, uuid: str) -> History[FastSample]:
        """The GPU's fast-sample history (empty if none), to bisect or tally; never change it."""
        found = self._history.get(uuid)
        return found if found.__class__ is History else self._lookup(False, uuid)

    def slow_history(self, uuid: str) -> History[SlowSample]:
        return self._lookup(True, uuid)

    def _lookup(self, slow: bool, uuid: str) -> History[Any]:
        found = (self._slow_history if slow else self._history).get(uuid)
        if found is None:
            return _NO_HISTORY
        if isinstance(found, History):
            return found
        key = (slow, uuid)
        wrapped = self._wrapped.get(key)
        if wrapped is None:  # a plain sequence (tests): a History over a copy, once per Window
            wrapped = self._wrapped[key] = History(found)
        return wrapped

    def since(self, seconds: float | None) -> float | None:
        """Monotonic time ``seconds`` before now (None: everything kept)."""
        return None if seconds is None else self._now - seconds

    def series(self, uuid: str, seconds: float | None = None) -> list[tuple[float, FastSample]]:
        """(monotonic time, fast sample) of the GPU over the last ``seconds`` (all kept if None), oldest first.

        A copy of those samples only, found by bisection; prefer ``tally``/``first_last`` where a
        count or the end points are all a rule needs.
        """
        return self.history(uuid).pairs(self.since(seconds))

    def slow_series(self, uuid: str, seconds: float | None = None) -> list[tuple[float, SlowSample]]:
        """(monotonic time, slow sample) of the GPU over the last ``seconds``, oldest first."""
        return self.slow_history(uuid).pairs(self.since(seconds))

    def tally(self, uuid: str, seconds: float | None,
              predicate: Callable[[FastSample], bool]) -> tuple[int, int]:
        """(fast samples of the last ``seconds`` for which ``predicate`` is true, all of them).

        O(log n): ``predicate`` must be the same function object at every call (see History).
        """
        return self.history(uuid).tally(predicate, self.since(seconds))

    def first_last(self, uuid: str, seconds: float | None, predicate: Callable[[FastSample], bool]
                   ) -> tuple[tuple[float, FastSample], tuple[float, FastSample]] | None:
        """The oldest and newest (time, fast sample) of the last ``seconds`` for which
        ``predicate`` is true; None if none is. Same rule for ``predicate`` as ``tally``."""
        return self.history(uuid).first_last(predicate, self.since(seconds))


def _jobs(window: Window) -> dict[tuple[str, str], JobUsage]:
    snap = window.latest
    host = snap.host if window.host_staleness is None else snap.fresh_host(window.now, window.host_staleness)
    return {(j.scheduler, j.job_id): j for j in (host.jobs or ())} if host is not None else {}


GpuEvaluate = Callable[[Window, str, RuleConfig], Observation | None]
NodeEvaluate = Callable[[Window, RuleConfig], Observation | None]


def everywhere(state: GpuState) -> bool:
    """``applies`` of the rules that apply to every GPU (the default)."""
    return True


@dataclass(frozen=True)
class Rule:
    """A rule's identity, documentation and defaults, with its pure evaluation function.

    ``scope`` "gpu": ``evaluate(window, uuid, config)`` per GPU where ``applies(state)`` is true.
    ``scope`` "node": ``evaluate(window, config)`` once per poll.
    Returning None means "cannot tell now" (no fresh data): the rule's state does not move.
    ``lookback``: the parameters that are seconds of the engine's history the rule looks back
    over, with the tier of that history ("fast" or "slow"). The engine keeps ``rules.window``
    seconds of fast samples and refuses (ConfigError) a fast look-back longer than that; it keeps
    slow samples for the longest slow look-back.
    ``every_seconds``: the rule is evaluated at most this often (0: after every poll). For rules
    whose condition is held for tens of seconds or more, or that read the slow tier only: they
    fire at most that much later, and cost that much less (docs/rules.md, "Evaluation").
    """

    id: str
    scope: str
    severity: str
    hold_seconds: float
    clear_seconds: float
    condition: str  # one sentence, for docs/rules.md and the status API
    evaluate: Callable[..., Observation | None]
    params: Mapping[str, float] = field(default_factory=dict)
    applies: Callable[[GpuState], bool] = everywhere
    lookback: Mapping[str, str] = field(default_factory=dict)
    every_seconds: float = 0.0

    def default_config(self) -> RuleConfig:
        return RuleConfig(True, self.severity, self.hold_seconds, self.clear_seconds, dict(self.params),
                          self.every_seconds)


@dataclass(frozen=True)
class Needs:
    """``applies`` for rules that need readings the GPU may not support (no fan rules on an H200).

    A function of the GPU's probed features only, so the engine may keep its answer for as long
    as the GPU keeps the same ``features`` mapping (until it is discovered again).
    """

    features: tuple[str, ...]

    def __call__(self, state: GpuState) -> bool:
        return all(state.features.get(f, False) for f in self.features)


def needs(*features: str) -> Needs:
    """``applies`` for rules that need readings the GPU may not support (no fan rules on an H200)."""
    return Needs(features)


@dataclass(frozen=True)
class NeedsAny(Needs):
    """``applies`` for rules that can work from any one of several readings (a function of the
    features, kept by the engine like ``Needs``)."""

    def __call__(self, state: GpuState) -> bool:
        return any(state.features.get(f, False) for f in self.features)


def needs_any(*features: str) -> Needs:
    return NeedsAny(features)
