"""What more than one rule family uses: GPU labels for summaries and the windowed shares of throttle reasons.

The rule families (fan, thermal, throttle, health, interconnect, workload, node) import from here and
from base, never from one another (tests/test_rules.py says so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gpuwatch.model import FastSample
from gpuwatch.rules.window import Window


def gpu_label(window: Window, uuid: str) -> str:
    """"GPU 3" (the NVML index), for summaries."""
    state = window.gpu(uuid)
    return _label(state.identity.index) if state is not None else uuid


@functools.lru_cache(maxsize=1024)
def _label(index: int) -> str:
    return f"GPU {index}"


def counter_name(reason: str) -> str:
    """The name under which a rule declares the predicate "the sample has the ``reason`` throttle-time
    counter" (``counters``), as ``counter_share`` reads it."""
    return "counter:" + reason


def counters(*reasons: str) -> dict[str, Callable[[FastSample], bool]]:
    """The predicates ``counter_share(window, uuid, reasons, ...)`` reads, for the rule's ``predicates``."""
    return {counter_name(reason): _has_counter(reason) for reason in reasons}


def _has_counter(reason: str) -> Callable[[FastSample], bool]:
    return lambda sample: reason in sample.clocks.clocks_event_seconds


def reasons_active(reasons: tuple[str, ...], unless: tuple[str, ...] = ()) -> Callable[[FastSample], bool]:
    """Predicate "any of ``reasons`` and none of ``unless`` is active in the sample", for a rule's
    ``predicates`` (``sample_share`` reads it by the name the rule gives it)."""

    def predicate(sample: FastSample) -> bool:
        # loops, not any() over generators: called for every GPU's every fast sample (a generator costs ~0.3 µs)
        active = sample.clocks.clocks_event_active
        for reason in reasons:
            if active.get(reason):
                break
        else:
            return False
        for reason in unless:
            if active.get(reason):
                return False
        return True

    return predicate


def counter_share(window: Window, uuid: str, reasons: tuple[str, ...], seconds: float) -> float | None:
    """Largest share of the last ``seconds`` that any of the ``reasons`` counters counted.

    From the cumulative clocks_event_seconds counters (NVML violation / throttle time), so nothing
    that happened between two polls is missed. None when no counter has two readings. Only the
    first and the last reading of the window are read. The rule declares ``counters(*reasons)``.
    """
    best: float | None = None
    for reason in reasons:
        ends = window.first_last(uuid, seconds, counter_name(reason))
        if ends is None:
            continue
        (t0, s0), (t1, s1) = ends
        v0, v1 = s0.clocks.clocks_event_seconds[reason], s1.clocks.clocks_event_seconds[reason]
        if t1 <= t0 or v1 < v0:  # one reading, or a counter reset (driver reload): nothing to say this window
            continue
        share = min(1.0, (v1 - v0) / (t1 - t0))
        best = share if best is None else max(best, share)
    return best


def sample_share(window: Window, uuid: str, name: str, seconds: float) -> float | None:
    """Share of the fast samples of the last ``seconds`` for which the rule's predicate ``name`` (made
    with ``reasons_active``) is true; None without samples."""
    hits, samples = window.tally(uuid, seconds, name)
    if not samples:
        return None
    return hits / samples


def median(values: list[float]) -> float:
    """statistics.median of a non-empty list, without importing statistics (and with it decimal and
    fractions: half a megabyte of resident memory for one median)."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
