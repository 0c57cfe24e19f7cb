"""What a rule sees: the latest snapshot and the engine's per-GPU histories, one view per rule.

A rule reads its GPU's fresh fast sample (``fast``), its latest slow sample while the GPU answers
(``slow``: the one definition of which slow sample a rule sees), its allocations while the host read is
fresh (``host``, ``host_fresh``), and the series it declares (Rule.predicates, .columns, .derived) by name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuwatch.groups.jobs import JobUsage
from gpuwatch.model import FastSample, GpuHost, GpuState, NodeSnapshot, SlowSample, fresh
from gpuwatch.rules.history import History, SeriesKey

if TYPE_CHECKING:
    from gpuwatch.rules.base import Rule


class UndeclaredSeries(LookupError):
    """A rule asked its Window for a series (by name) that it does not declare: a bug in the rule."""


_NO_HISTORY: History[Any] = History()


class Window:
    """What rules see: the latest snapshot plus a bounded per-GPU history of fast (and slow) samples.

    The engine keeps the history incrementally (one append per GPU per poll) in ``History``
    objects, so looking back costs only the samples a rule asks for. Node-wide aggregates are
    computed once per Window (one Window per evaluation) and shared by every GPU's evaluation:
    the fresh samples of the node behind ``fast`` and ``peers``, and whatever a rule keeps with
    ``memo``. Each rule gets its own view of it (``for_rule``), through which it reads the
    series it declares by name. A test may pass plain lists of (time, sample) pairs, oldest
    first, as the history.
    """

    def __init__(self, latest: NodeSnapshot,
                 history: Mapping[str, History[FastSample] | Sequence[tuple[float, FastSample]]],
                 fast_staleness: float, expected_gpus: int = 0, now: float | None = None,
                 slow_history: Mapping[str, History[SlowSample] | Sequence[tuple[float, SlowSample]]] | None = None,
                 slow_staleness: float | None = None) -> None:
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
        self.slow_staleness = slow_staleness  # the slow tier's bound (slow samples, host reads); None: any age
        self._rule: Rule | None = None

    def for_rule(self, rule: Rule) -> Window:
        """This window as ``rule`` sees it: the same snapshot, histories and node-wide aggregates
        (``memo``), and the series ``rule`` declares, which ``tally``, ``first_last``, ``column`` and
        ``derive`` read by name. The engine passes each rule its own view."""
        self._fresh_samples()  # computed once, before the views share it (and _memo, _wrapped: the same dicts)
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._rule = rule
        return view

    @property
    def rule(self) -> Rule | None:
        """The rule this view is for (None: the engine's Window itself, which declares no series)."""
        return self._rule

    @property
    def now(self) -> float:
        """Monotonic time of this evaluation (at or after the latest snapshot)."""
        return self._now

    def gpu(self, uuid: str) -> GpuState | None:
        return self._by_uuid.get(uuid)

    def _fresh_samples(self) -> dict[str, FastSample]:
        """uuid -> latest fast sample, for the GPUs that are up and fresh (computed once)."""
        fresh_samples = self._fresh
        if fresh_samples is None:
            fresh_samples = self._fresh = {}
            now, staleness = self._now, self.fast_staleness
            for uuid, state in self._by_uuid.items():
                sample = state.fresh_fast(now, staleness)
                if sample is not None:
                    fresh_samples[uuid] = sample
            self._fresh_list = [(state.identity.uuid, fresh_samples[state.identity.uuid])
                                for state in self.latest.gpus if state.identity.uuid in fresh_samples]
        return fresh_samples

    def fast(self, uuid: str) -> FastSample | None:
        """The GPU's latest fast sample, if it is up and fresh."""
        fresh = self._fresh  # computed by for_rule: each rule asks this for each GPU
        return (self._fresh_samples() if fresh is None else fresh).get(uuid)

    def fresh(self) -> list[tuple[str, FastSample]]:
        """(uuid, fresh fast sample) of every GPU of the node that has one, in snapshot order
        (computed once per Window: do not change the list)."""
        self._fresh_samples()
        return self._fresh_list  # type: ignore[return-value]  # set with _fresh

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

    def host_fresh(self, taken: float | None) -> bool:
        """Whether a read of the host groups ended at monotonic time ``taken`` is fresh enough for a rule: at
        most ``slow_staleness`` seconds old (model.fresh), any age without a bound. ``host`` and ``jobs`` ask it:
        allocations and jobs come and go, a stale read says nothing about now."""
        bound = self.slow_staleness
        return bound is None or fresh(taken, self._now, bound)

    def slow(self, uuid: str) -> SlowSample | None:
        """The GPU's latest slow sample while the GPU answers and the backend is up, whatever its age; None:
        cannot tell. The one definition of which slow sample a rule sees: every rule reads it here. No age
        bound: slow readings are limits, thresholds and counters that keep their last value, and a slow tier
        that stalls (a wedged call) must not silence the critical rules that read them (poll_success and
        collection_stalled say it stalls). Its time is the GPU state's ``slow_monotonic``."""
        state = self._by_uuid.get(uuid)
        if state is None or not state.up or not self.latest.backend_up:
            return None
        return state.slow

    def host(self, uuid: str) -> GpuHost | None:
        """The GPU's allocations from the last read of the host groups, while it is fresh (``host_fresh``)."""
        state = self._by_uuid.get(uuid)
        return None if state is None or not self.host_fresh(state.host_monotonic) else state.host

    def jobs(self) -> Mapping[tuple[str, str], JobUsage]:
        """(scheduler, job id) -> the job's host side (the jobs group), from a fresh host read (once per Window)."""
        return self.memo(("jobs",), _jobs)

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

    def samples(self, uuid: str, seconds: float | None = None) -> list[FastSample]:
        """The GPU's fast samples over the last ``seconds`` (all kept if None), oldest first, without their times."""
        return self.history(uuid).tail(self.since(seconds))

    def slow_series(self, uuid: str, seconds: float | None = None) -> list[tuple[float, SlowSample]]:
        """(monotonic time, slow sample) of the GPU over the last ``seconds``, oldest first."""
        return self.slow_history(uuid).pairs(self.since(seconds))

    def _declared(self, kind: str, name: str) -> tuple[SeriesKey, Any]:
        """(key, function) of the series ``name`` of ``kind`` (Rule.predicates, .columns, .derived)
        that this view's rule declares; UndeclaredSeries, and no cache, when it declares none."""
        rule = self._rule
        function = None if rule is None else getattr(rule, kind).get(name)
        if function is None:
            if rule is None:
                raise UndeclaredSeries(f"{kind} {name!r} asked of a Window that is for no rule: evaluate the rule "
                                       "with Window.for_rule(rule), as the engine does")
            declared = ", ".join(sorted(getattr(rule, kind))) or "none"
            raise UndeclaredSeries(f"rule {rule.id!r} reads {kind} {name!r}, which it does not declare "
                                   f"(its {kind}: {declared}): add it to the rule's {kind}")
        return (rule.id, name), function  # type: ignore[union-attr]  # rule is set when function is

    def tally(self, uuid: str, seconds: float | None, name: str) -> tuple[int, int]:
        """(fast samples of the last ``seconds`` for which the rule's predicate ``name`` is true, all
        of them), in O(log n) from running counts kept per (rule, name)."""
        key, predicate = self._declared("predicates", name)
        return self.history(uuid).tally(key, predicate, self.since(seconds))

    def first_last(self, uuid: str, seconds: float | None, name: str
                   ) -> tuple[tuple[float, FastSample], tuple[float, FastSample]] | None:
        """The oldest and newest (time, fast sample) of the last ``seconds`` for which the rule's
        predicate ``name`` is true; None if none is."""
        key, predicate = self._declared("predicates", name)
        return self.history(uuid).first_last(key, predicate, self.since(seconds))

    def column(self, uuid: str, name: str) -> list[Any]:
        """The rule's getter ``name`` of every fast sample of the GPU, at the indices of ``history(uuid)``
        (from its ``start`` to its ``end``): extended once per new sample, never recomputed."""
        key, getter = self._declared("columns", name)
        return self.history(uuid).column(key, getter)

    def derive(self, uuid: str, seconds: float | None, name: str) -> Any:
        """The rule's computation ``name`` over the GPU's fast samples of the last ``seconds``,
        computed again only once a sample entered or left them (History.derive)."""
        key, compute = self._declared("derived", name)
        return self.history(uuid).derive(key, compute, self.since(seconds))

    def slow_derive(self, uuid: str, seconds: float | None, name: str) -> Any:
        """As ``derive``, over the GPU's slow samples."""
        key, compute = self._declared("derived", name)
        return self.slow_history(uuid).derive(key, compute, self.since(seconds))


def _jobs(window: Window) -> dict[tuple[str, str], JobUsage]:
    snap = window.latest
    host = snap.host if window.host_fresh(snap.host_monotonic) else None
    return {(j.scheduler, j.job_id): j for j in (host.jobs or ())} if host is not None else {}
