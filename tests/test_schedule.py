"""gpuwatch.schedule.Ticker: the fast poll's own thread, on a fixed grid of ticks, skipped ticks reported.

The ticker reads a monotonic clock the tests move by hand; its waits are real (short intervals), and the tests
wait for conditions with deadlines (daemon.wait_for), never for a time.
"""

from __future__ import annotations

import threading

import pytest
from daemon import wait_for

from gpuwatch.schedule import Ticker

INTERVAL = 0.02


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Job:
    """Counts its runs; the runs listed in ``block`` wait for ``gate``; ``during`` is called in run n."""

    def __init__(self, block: tuple[int, ...] = (), during: dict[int, object] | None = None) -> None:
        self.runs = 0
        self.started = threading.Event()
        self.gate = threading.Event()
        self.block = block
        self.during = during or {}

    def __call__(self) -> None:
        self.runs += 1
        action = self.during.get(self.runs)
        if callable(action):
            action()
        if self.runs in self.block:
            self.started.set()
            self.gate.wait(30)


def ticker(job, clock, overruns, errors=None, watch_seconds=INTERVAL):
    t = Ticker(job, INTERVAL, lambda: overruns.append(clock()), (errors if errors is not None else []).append,
               name="test-ticker", watch_seconds=watch_seconds, monotonic=clock)
    t.start()
    return t


def ended(t: Ticker) -> bool:
    for thread in t.threads:
        thread.join(timeout=10)
    return not any(thread.is_alive() for thread in t.threads)


def test_runs_at_once_then_every_tick_until_stopped():
    clock, job, overruns = Clock(), Job(), []
    t = ticker(job, clock, overruns)
    try:
        wait_for(lambda: job.runs >= 5, what="five runs")
    finally:
        t.stop()
    assert ended(t)
    runs = job.runs
    assert overruns == []  # runs that end before their next tick skip nothing
    t.stop()  # twice: nothing more
    assert job.runs == runs


def test_a_run_that_does_not_return_has_its_ticks_reported_as_they_pass_and_only_once():
    clock, job, overruns = Clock(), Job(block=(2,)), []
    t = ticker(job, clock, overruns)
    try:
        assert job.started.wait(10)  # the second run (tick 1) hangs
        clock.now += 4.5 * INTERVAL  # ticks 2, 3 and 4 pass while it does
        wait_for(lambda: len(overruns) >= 3, what="the watcher to report the skipped ticks")
        job.gate.set()
        wait_for(lambda: job.runs >= 5, what="runs going on after the hang")
    finally:
        job.gate.set()
        t.stop()
    assert ended(t)
    assert len(overruns) == 3  # reported by the watcher, not again by the run when it returned


def test_a_long_run_skips_the_tick_it_overlaps_even_when_the_watcher_is_asleep():
    """The run reports what it overlapped when it ends: one skipped tick for 2.5 intervals of work."""
    clock, overruns = Clock(), []

    def long_work() -> None:
        clock.now += 2.5 * INTERVAL

    job = Job(during={2: long_work})
    t = ticker(job, clock, overruns, watch_seconds=3600)
    try:
        wait_for(lambda: job.runs >= 4, what="runs after the long one")
    finally:
        t.stop()
    assert ended(t)
    assert len(overruns) == 1


def test_a_run_that_raises_is_reported_and_the_ticks_go_on():
    clock, errors, overruns = Clock(), [], []

    def boom() -> None:
        raise RuntimeError("a bug in the poll")

    job = Job(during={1: boom, 3: boom})
    t = ticker(job, clock, overruns, errors)
    try:
        wait_for(lambda: job.runs >= 5, what="runs after the failures")
    finally:
        t.stop()
    assert ended(t)
    assert [str(e) for e in errors] == ["a bug in the poll"] * 2


def test_stop_ends_the_waits_at_once():
    clock, job, overruns = Clock(), Job(), []
    t = Ticker(job, 3600.0, lambda: overruns.append(1), print, name="test-ticker", watch_seconds=3600.0,
               monotonic=clock)
    t.start()
    wait_for(lambda: job.runs == 1, what="the first run, at once")
    t.stop()
    assert ended(t)  # both threads were waiting an hour
    assert job.runs == 1


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError):
        Ticker(Job(), 0.0, print, print, name="t", watch_seconds=1.0)


def test_a_failing_overrun_report_is_an_error_not_a_dead_watcher():
    clock, errors = Clock(), []

    def bad_report() -> None:
        raise KeyError("a bug in the report")

    job = Job(block=(2,))
    t = Ticker(job, INTERVAL, bad_report, errors.append, name="test-ticker", watch_seconds=INTERVAL, monotonic=clock)
    t.start()
    try:
        assert job.started.wait(10)
        clock.now += 3.5 * INTERVAL  # ticks 2 and 3 pass while run 2 (tick 1) hangs
        wait_for(lambda: len(errors) >= 2, what="both reports to fail")
        job.gate.set()
        wait_for(lambda: job.runs >= 4, what="runs going on")
        assert all(thread.is_alive() for thread in t.threads)
    finally:
        job.gate.set()
        t.stop()
    assert ended(t)
    assert [type(e) for e in errors] == [KeyError, KeyError]


def test_the_watcher_follows_a_run_it_finds_to_its_next_tick_and_no_further():
    """A run found in progress is looked at again at its next tick (its first skipped tick is reported as it
    passes, not one watch period later), and at each tick while it overruns; once it has ended on time the
    watcher looks every watch_seconds again, even if the next run is in progress at that look."""
    t = Ticker(Job(), 2.0, print, print, name="t", watch_seconds=4.0, monotonic=Clock())
    t._origin = 100.0
    look = t.next_look
    assert look(None, None, 5, 110.5) == (4.0, None)  # nothing running: every watch_seconds
    assert look(5, None, 5, 110.5) == (1.5, 5)  # run 5 in progress, on time so far: look at tick 6 (112)
    assert look(5, 5, 6, 112.0) == (2.0, 5)  # still run 5 at tick 6: overrunning, look at each tick
    assert look(5, 5, 5, 111.75) == (0.25, 5)  # woke before tick 6 (a clock a hair behind): look again at it
    assert look(6, 5, 6, 112.0) == (4.0, None)  # run 5 ended on time, run 6 just started: back to 4 s
    assert look(6, 5, 8, 116.5) == (1.5, 6)  # run 6 is overrunning already: follow it
    assert look(7, None, 9, 119.0) == (1.0, 7)
