"""How the poller's jobs are timed: the only user of APScheduler.

- ``Ticker`` runs the fast poll on a thread of its own at a steady monotonic cadence. Under
  APScheduler each tick woke two threads (the scheduler, then a pool worker), and a wake-up after
  half a second asleep costs this process about 0.12 ms of CPU on the bench's VM: a tick under
  APScheduler cost 0.46 ms with an empty job, on its own thread 0.14 ms (docs/performance.md).
  A tick that comes while the poll still runs is skipped and reported (``on_overrun``), as
  APScheduler's ``max_instances`` did; a watcher thread, which looks every ``watch_seconds``
  while the polls keep time (and at the next tick when it finds one running), reports those of
  a poll that does not return (a wedged NVML call) as they pass.
- ``SteadyScheduler``: APScheduler's BackgroundScheduler for the other jobs (the slow poll, the
  host groups), immune to wall-clock steps.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from gpuwatch.deferred import deferred, load, without_plugins
from gpuwatch.logs import get_logger

# APScheduler uses asyncio for its asyncio executor only, importlib.metadata for plugins by alias, which
# gpuwatch does not use (it passes trigger and executor objects), and multiprocessing for its process pool,
# which gpuwatch does not use either (multiprocessing and concurrent.futures.process, 9 modules: 0.6 MB):
# gpuwatch.deferred. The pool module's ``from concurrent.futures.process import BrokenProcessPool`` gets
# BrokenProcessPool's base class, which its ``except`` then catches as it did (a process pool raises no other).
# tzlocal's table of Windows zone names (589 of them) is read only where the TZ variable is set.
with (deferred("importlib.metadata", answers=without_plugins()), deferred("multiprocessing"),
      deferred("concurrent.futures.process", answers={"BrokenProcessPool": concurrent.futures.BrokenExecutor}),
      deferred("tzlocal.windows_tz")):
    load("apscheduler.schedulers.background", "asyncio", functions=("iscoroutinefunction",))
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobExecutionEvent  # loaded above
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

CLOCK_STEP_SECONDS = 0.5  # a change of wall minus monotonic time larger than this is a clock step

__all__ = ["EVENT_JOB_MAX_INSTANCES", "IntervalTrigger", "JobExecutionEvent", "SteadyScheduler", "ThreadPoolExecutor",
           "Ticker", "utc_now"]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Ticker:
    """``function`` every ``interval`` seconds of monotonic time, the first at once, one run at a time.

    The ticks are on a fixed grid from the start: a run that ends after its next tick makes that tick
    (and any after it) skipped, one ``on_overrun()`` call each, and the next run waits for the tick
    after; a wait that ends late (a busy host) runs once, at once. ``on_error`` gets what ``function``
    or ``on_overrun`` raised, and must not raise itself. ``stop`` ends the waits at once; a run in progress
    finishes (nothing can interrupt an NVML call) and no other starts.
    """

    def __init__(self, function: Callable[[], None], interval: float, on_overrun: Callable[[], None],
                 on_error: Callable[[Exception], None], *, name: str, watch_seconds: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._function, self._interval, self._on_overrun, self._on_error = function, interval, on_overrun, on_error
        self._name = name
        self._watch_seconds = max(interval, watch_seconds)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._origin = 0.0
        self._running: int | None = None  # the tick whose run is in progress
        self._reported = -1  # the newest tick reported as skipped
        self._stopped = False
        # held until stop(): a wait on them ends at once then (a Lock's timed acquire is the cheapest wait)
        self._loop_wait, self._watch_wait = threading.Lock(), threading.Lock()
        self._loop_wait.acquire()
        self._watch_wait.acquire()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self._origin = self._monotonic()
        for target, suffix in ((self._loop, ""), (self._watch, "-watch")):
            thread = threading.Thread(target=target, name=self._name + suffix, daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._loop_wait.release()
        self._watch_wait.release()

    def _tick_at(self, now: float) -> int:
        """The newest tick at or before ``now``."""
        return max(0, int((now - self._origin) // self._interval))

    def _skipped(self, since: int, now: float) -> tuple[int, int]:
        """(ticks to report as skipped, the newest tick) for a run of tick ``since`` still going at ``now``
        or ended then: the ticks after it up to ``now`` not reported yet. Under the lock."""
        latest = self._tick_at(now)
        first = max(since, self._reported) + 1
        self._reported = max(self._reported, latest)
        return max(0, latest - first + 1), latest

    def _loop(self) -> None:
        tick = 0
        while True:
            with self._lock:
                if self._stopped:
                    return
                self._running = tick
            try:
                self._function()
            except Exception as exc:  # a bug in the job: the ticks go on
                self._on_error(exc)
            with self._lock:
                self._running = None
                skipped, latest = self._skipped(tick, self._monotonic())
            self._report(skipped)
            tick = latest + 1
            if self._loop_wait.acquire(True, max(0.0, self._origin + tick * self._interval - self._monotonic())):
                return  # stopped
            tick = max(tick, self._tick_at(self._monotonic()))  # woke late: this run stands for the ticks missed

    def _watch(self) -> None:
        wait, watched = self._watch_seconds, None
        while not self._watch_wait.acquire(True, wait):
            now = self._monotonic()
            with self._lock:
                running = self._running
                skipped, latest = (0, self._tick_at(now)) if running is None else self._skipped(running, now)
            self._report(skipped)
            wait, watched = self.next_look(running, watched, latest, now)

    def next_look(self, running: int | None, watched: int | None, latest: int, now: float) -> tuple[float, int | None]:
        """The watcher's next wait, and the run it follows, after a look at ``now`` found the run of tick
        ``running`` in progress (None: none), ``latest`` the newest tick. A run it finds in progress is
        looked at again at its next tick, and at each tick while it overruns (as APScheduler did), so the
        first skipped tick is reported as it passes; when the run it followed has ended (none, or another in
        progress: a run that was on time), it looks every ``watch_seconds`` again."""
        overrunning = running is not None and latest > running
        if running is None or (not overrunning and watched is not None and running != watched):
            return self._watch_seconds, None
        return max(0.0, self._origin + (latest + 1) * self._interval - now), running

    def _report(self, skipped: int) -> None:
        for _ in range(skipped):
            try:
                self._on_overrun()
            except Exception as exc:  # a bug there: the ticks and the watcher go on
                self._on_error(exc)


class SteadyScheduler(BackgroundScheduler):
    """APScheduler's BackgroundScheduler, immune to wall-clock steps.

    APScheduler 3 keeps each job's next run time as a wall-clock datetime and compares it with
    ``datetime.now()``; its waits themselves are monotonic (``threading.Event.wait``). So when NTP
    steps the clock back by X seconds, every job would wait X seconds more (the polls stall, the
    data goes stale, the watchdog restarts gpuwatch), and a step forward would make them all due at
    once. Before each look at the jobs this scheduler measures wall minus monotonic time; when it
    moved by more than ``CLOCK_STEP_SECONDS`` since the last look, the wall clock stepped, and
    every job's next run time moves by the same step: the jobs keep their monotonic cadence, no
    poll is skipped or repeated. Slow NTP slewing (parts per million) is below the threshold and
    left to the wall-clock schedule, as APScheduler does.
    """

    def __init__(self, *args: Any, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wall = wall
        self._monotonic = monotonic
        self._offset: float | None = None
        self.steps: list[float] = []  # the steps seen, in seconds (newest last; for logs and tests)

    def _process_jobs(self) -> float | None:
        offset = self._wall() - self._monotonic()
        if self._offset is not None and abs(offset - self._offset) > CLOCK_STEP_SECONDS:
            self._shift(offset - self._offset)
        self._offset = offset
        wait = super()._process_jobs()
        if abs(self._wall() - self._monotonic() - offset) > CLOCK_STEP_SECONDS:
            # the clock stepped while APScheduler looked at the jobs: the wait it computed is on the other side
            # of the step (back 300 s: a 300 s stall). Look again at once: that look moves the jobs.
            return 0.0
        return wait

    def _shift(self, seconds: float) -> None:
        delta = timedelta(seconds=seconds)
        with self._jobstores_lock:
            for store in self._jobstores.values():
                for job in store.get_all_jobs():
                    if job.next_run_time is not None:
                        job._modify(next_run_time=job.next_run_time + delta)
                        store.update_job(job)
        self.steps = self.steps[-9:] + [seconds]
        get_logger(component="poller").warning(
            "clock_step", seconds=round(seconds, 3),
            hint="the wall clock jumped (NTP step, manual date change); polls keep their interval")
