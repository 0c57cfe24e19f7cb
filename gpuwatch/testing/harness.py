"""The whole agent in-process on simulated time: what the daemon does, without its threads or sleeps.

``Harness`` builds the real composition root (gpuwatch.agent.Agent) over a FakeClock and the backend
you choose (ScriptedBackend, SimulatedBackend on the same clock, a replay, NVML over a fake library in a
ChildBackend, or whatever ``make_backend`` picks from the configuration), and ``advance(seconds)`` runs
what the poller's scheduler would have run in that time, in time order, at the simulated instant each
is due: the fast poll every poll interval (from the start; the rules run after each), the slow poll every
slow interval (the first one with the first fast poll, as the daemon does), the host groups' job (at
the start, right after each discovery, then every slow interval), and after each
job a drain of the backend's events (wait_events with a timeout of 0), as the events thread would. No
APScheduler, no thread, no sleep: a run is deterministic and takes the time its polls take.

``scrape()`` is the exposition exactly as /metrics renders it (text format), ``status()`` the document
/api/v1/status serves, ``anomalies()`` the firing anomalies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatch import config as configuration
from gpuwatch.agent import Agent
from gpuwatch.backends.base import Backend
from gpuwatch.clock import FakeClock
from gpuwatch.config import Config
from gpuwatch.model import Anomaly, NodeSnapshot
from gpuwatch.status import status_document

_EPSILON = 1e-9


def load_config(args: Sequence[str] = (), environ: Mapping[str, str] | None = None,
                **overrides: Any) -> Config:
    """A Config from `gpuwatch run`'s flags (``["--poll.interval", "1"]``), an environment (default: none,
    not this process's) and overrides by field name, as the command builds it."""
    parser = argparse.ArgumentParser(prog="gpuwatch")
    configuration.add_arguments(parser)
    return configuration.load(parser.parse_args(list(args)), environ={} if environ is None else environ,
                              overrides=overrides)


class Harness:
    """The agent on simulated time (see the module docstring)."""

    def __init__(self, config: Config | None = None, *, backend: Backend | None = None,
                 clock: FakeClock | None = None, args: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> None:
        self.clock = clock if clock is not None else FakeClock()
        self.config = config if config is not None else load_config(args, environ)
        self.agent = Agent(self.config, self.clock, backend)
        self.backend = self.agent.backend
        self.store = self.agent.store
        self.poller = self.agent.poller
        now = self.clock.monotonic()
        self.started = now
        # the poller's jobs as Poller.start() schedules them: some at once, the others one interval later
        jobs = self.poller.jobs()
        self._functions = {job_id: function for job_id, function, _, _ in jobs}
        self.intervals = {job_id: seconds for job_id, _, seconds, _ in jobs}
        self._due = {job_id: now if at_once else now + seconds for job_id, _, seconds, at_once in jobs}
        self._host_grid: float | None = None  # the host job's next scheduled run while a woken one is due
        self._events = self.poller.reads_events
        self._order = [job_id for job_id, _, _, _ in jobs]  # jobs due at the same instant run in this order
        self.runs = dict.fromkeys(self._order, 0)  # how many times each job ran
        self.closed = False

    # -- time ------------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds of simulated time since the harness started."""
        return self.clock.monotonic() - self.started

    def advance(self, seconds: float) -> None:
        """Run every job due within the next ``seconds`` of simulated time, each at its instant."""
        if seconds < 0:
            raise ValueError("time only goes forward")
        target = self.clock.monotonic() + seconds
        while True:
            job = min(self._due, key=lambda j: (self._due[j], self._order.index(j)))
            due = self._due[job]
            if due > target + _EPSILON:
                break
            self._move_to(due)
            self._run(job)
            if job == "host" and self._host_grid is not None:
                # a run woken by a discovery: the job's schedule goes on from where it was
                self._due[job], self._host_grid = self._host_grid, None
            else:
                self._due[job] = due + self.intervals[job]
        self._move_to(target)
        self.drain_events()

    def run_until(self, condition: Callable[[], object], timeout: float = 60.0, step: float | None = None,
                  what: str = "condition") -> Any:
        """Advance ``step`` (default: one poll interval) at a time until ``condition()`` is truthy (checked
        first at once); AssertionError after ``timeout`` seconds of simulated time."""
        step = self.config.poll_interval if step is None else step
        deadline = self.clock.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            if self.clock.monotonic() >= deadline - _EPSILON:
                raise AssertionError(f"{what}: not true after {timeout:g} s of simulated time")
            self.advance(min(step, deadline - self.clock.monotonic()))

    def _move_to(self, instant: float) -> None:
        delta = instant - self.clock.monotonic()
        if delta > 0:
            self.clock.advance(delta)

    def _run(self, job: str) -> None:
        self.runs[job] += 1
        was_up = self.poller.backend_up
        self._functions[job]()
        if not was_up and self.poller.backend_up and "host" in self._due and job != "host":
            # a discovery wakes the host job (Poller._wake_host: the allocations of the GPUs just found);
            # APScheduler's interval trigger then keeps the job's own schedule
            if self._due["host"] > self.clock.monotonic() + _EPSILON:
                self._host_grid = self._due["host"]
                self._due["host"] = self.clock.monotonic()
        self.drain_events()

    def drain_events(self) -> None:
        """What the events thread would have taken by now (nothing while the backend is down)."""
        if self._events:
            self.poller.drain_events(0.0)

    # -- what the daemon serves ------------------------------------------------------------------------
    def scrape(self, openmetrics: bool = False) -> str:
        """The exposition, exactly as /metrics renders it now (process_* metrics included)."""
        return self.agent.exposition.render(openmetrics=openmetrics)[0].decode()

    def snapshot(self) -> NodeSnapshot:
        return self.store.snapshot()

    def status(self) -> dict[str, Any]:
        """The document /api/v1/status serves now."""
        return status_document(self.store.snapshot(), self.clock.monotonic(), self.config.staleness)

    def anomalies(self, firing: bool = True) -> list[Anomaly]:
        """The anomalies in the store (only the firing ones unless ``firing=False``)."""
        return [a for a in self.store.snapshot().anomalies if a.firing or not firing]

    def alive(self) -> str | None:
        """The watchdog's verdict (Agent.alive): None while the scheduler's jobs run."""
        return self.agent.alive()

    def close(self) -> None:
        """Stop the agent (closes the backend; the process of a ChildBackend is its owner's to stop)."""
        if self.closed:
            return
        self.closed = True
        self.agent.stop()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
