"""The poller: two tiers of polls, the backend's lifecycle, XID events.

- fast tier (default 2 s; on a thread of its own, gpuwatch.schedule.Ticker) and slow tier
  (default 30 s; an APScheduler job) run at most one poll in flight each: a wedged NVML call
  holds its tier's thread, later runs of that tier are skipped (reported once as
  ``poll_overrun``) and the data goes stale; nothing piles up and HTTP never waits. When the
  call returns, the next run goes on by itself.
- the backend's lifecycle: if it cannot be opened (driver not loaded, library missing, driver
  upgraded without reboot) the poller logs the cause once with a hint, retries with capped
  exponential backoff and recovers by itself. One lost GPU never stops the others.
- XID events arrive on their own thread (``wait_events``) and go into the store. The thread waits in
  nvmlEventSetWait: the XIDs queued before a wait begins all come out with the last one's code (nvml.h), so
  draining the queue after each poll instead would count an Xid 48 followed by the killed job's 43 as two 43s.
- the host groups (Slurm allocations, the kubelet's pods, the jobs' CPU time: gpuwatch/hostside/)
  are read by a job of their own every slow interval, so a slow scontrol or kubelet delays no poll.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timezone
from typing import Any

from gpuwatch.backends.base import EVENT_WAIT_SECONDS, Backend
from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.groups.selection import Selection
from gpuwatch.groups.xid import describe as describe_xid
from gpuwatch.heap import Trimmer
from gpuwatch.logs import Repeats, get_logger
from gpuwatch.model import FastSample, GpuIdentity, GpuProcess, GpuState, HostSample, ProcessInfo, SlowSample
from gpuwatch.schedule import (
    EVENT_JOB_MAX_INSTANCES,
    IntervalTrigger,
    JobExecutionEvent,
    SteadyScheduler,
    ThreadPoolExecutor,
    Ticker,
    utc_now,
)
from gpuwatch.store import Store

MAX_BACKOFF_SECONDS = 60.0
EVENTS_THREAD = "gpuwatch-events"  # its wait lasts up to EVENT_WAIT_SECONDS: a stop does not wait for it
RULES_EVERY_SECONDS = 4.0  # the rules run after a fast poll this often (docs/rules.md); every poll feeds them


class Poller:
    def __init__(
        self,
        backend: Backend,
        store: Store,
        clock: Clock,
        fast_interval: float = 2.0,
        slow_interval: float = 30.0,
        evaluate: Callable[[], None] | None = None,
        attribute: Callable[[GpuIdentity, tuple[GpuProcess, ...] | None], tuple[ProcessInfo, ...]] | None = None,
        selection: Selection | None = None,
        host: Callable[[Sequence[GpuState]], HostSample] | None = None,
        remember: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend
        self._store = store
        self._clock = clock
        self._trimmer = Trimmer(monotonic=clock.monotonic)
        self._fast_interval = fast_interval
        self._slow_interval = slow_interval
        self._evaluate = evaluate
        self._remember = remember  # a poll's samples into the rules' history when they do not run
        self._attribute = attribute
        self._host = host
        self._host_overrun_logged = False
        self._host_lock = threading.Lock()
        self._host_running = False
        self._host_again = False
        selection = selection or Selection.of()
        self._selection = selection
        # tier -> the selected groups that read in it, for gpuwatch_collector_success/_duration_seconds
        self._tier_groups = {tier: selection.tier(tier) for tier in ("fast", "slow")}
        self._attributed = selection.attributed  # the groups whose slow reading is attributed to jobs
        self._events_ok: bool | None = None
        self._features = selection.features
        self._log = get_logger(component="poller", backend=backend.name)
        self._lifecycle = threading.Lock()
        self._up = False
        self._next_attempt = 0.0
        self._backoff = fast_interval
        self._last_down_reason: str | None = None
        self._lost: set[str] = set()
        self._overrun_logged: set[str] = set()
        self._stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        self._events_wake = threading.Event()  # the backend came up, or stop(): the events thread's pause ends
        self._scheduler: SteadyScheduler | None = None
        self._ticker: Ticker | None = None
        self._slow_due = True
        self._last_evaluated = float("-inf")
        self._rules_every = max(fast_interval, RULES_EVERY_SECONDS)
        self._discovery_errors: list[str] = []  # counted with the poll that ran the discovery
        # events that can repeat every poll or thousands of times a second (XID storms)
        self._repeats = Repeats(self._log, monotonic=clock.monotonic)

    # -- lifecycle of the backend ------------------------------------------------------------
    @property
    def backend_up(self) -> bool:
        return self._up

    def ensure_backend(self) -> bool:
        """Open the backend if it is down and a retry is due. Returns whether it is up."""
        if self._up:
            return True
        if self._clock.monotonic() < self._next_attempt:
            return False
        if not self._lifecycle.acquire(blocking=False):
            return False  # another tier is opening it right now
        try:
            if self._up:
                return True
            try:
                driver = self._backend.open()
                gpus = self._backend.discover()
            except BackendUnavailable as exc:
                self._mark_down(exc)
                return False
            except Exception as exc:  # a bug: down, retried with backoff, logged once per cause (not per poll)
                self._mark_down(BackendUnavailable(
                    "internal", f"{type(exc).__name__}: {exc}",
                    "a gpuwatch bug: please report it with this log line; gpuwatch keeps retrying"), exc)
                return False
            if not self._selection.everything:  # a backend that reads every group (not NVML): keep the selected
                gpus = [dataclasses.replace(g, features={k: v for k, v in g.features.items() if k in self._features})
                        for g in gpus]
            self._discovery_errors.extend(driver.errors)
            self._discovery_errors.extend(error for gpu in gpus for error in gpu.errors)
            self._store.set_gpus(gpus)
            if self._selection.events:
                self._events_status(True)  # registered at discovery; the events thread reports from here on
                self._events_wake.set()  # it waits on the new event set now, not after its pause
            up = len(gpus) > 0
            self._store.set_backend(up, None if up else "no GPUs visible", driver)
            self._up = True
            self._backoff = self._fast_interval
            self._slow_due = True
            self._wake_host()  # the allocations of the GPUs just found, without waiting a slow interval
            event = "backend_recovered" if self._last_down_reason else "backend_up"
            self._log.info(event, gpus=len(gpus), driver_version=driver.driver_version)
            if not gpus:
                self._log.warning("no_gpus", hint="the driver sees no GPU: check `nvidia-smi -L` and the device nodes")
            self._last_down_reason = None
            return True
        finally:
            self._lifecycle.release()

    def _mark_down(self, exc: BackendUnavailable, cause: BaseException | None = None) -> None:
        self._up = False
        try:
            self._backend.close()
        except Exception:  # close() must not raise; if it does, the next open() starts over anyway
            pass
        self._store.set_backend(False, exc.message)
        self._next_attempt = self._clock.monotonic() + self._backoff
        retry_in = self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_SECONDS)
        if exc.reason != self._last_down_reason:
            self._log.error("backend_down", reason=exc.reason, error=exc.message, hint=exc.hint,
                            retry_in_seconds=round(retry_in, 1),
                            exc_info=(type(cause), cause, cause.__traceback__) if cause is not None else None)
            self._last_down_reason = exc.reason
        else:
            self._log.debug("backend_still_down", reason=exc.reason, retry_in_seconds=round(retry_in, 1))

    def _backend_lost(self, exc: BackendUnavailable) -> None:
        with self._lifecycle:
            if self._up:
                self._backoff = self._fast_interval
                self._mark_down(exc)

    # -- polls -------------------------------------------------------------------------------
    def poll_fast(self) -> None:
        self._poll("fast")
        if self._clock.monotonic() - self._last_evaluated >= self._rules_every - self._fast_interval / 2:
            self.evaluate()
        elif self._remember is not None:
            try:
                self._remember()
            except Exception as exc:  # a bug: the polls go on
                self._repeats.log("error", "rules_failed", ("remember_failed",), error=repr(exc), exc_info=True)

    @property
    def last_evaluated(self) -> float | None:
        """Monotonic time the scheduler last ran the rules (whether every rule succeeded or not)."""
        return None if self._last_evaluated == float("-inf") else self._last_evaluated

    def evaluate(self) -> None:
        """Run the rules: after a fast poll (at most about every RULES_EVERY_SECONDS), and at the fast ticks
        skipped while a poll hangs."""
        if self._evaluate is None:
            return
        self._last_evaluated = self._clock.monotonic()
        try:
            self._evaluate()
        except Exception as exc:  # a broken rule must not stop polling
            self._log.error("rules_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)

    def poll_slow(self) -> None:
        self._poll("slow")
        self._trimmer.maybe_trim()  # malloc's free pages back to the kernel, once a minute (gpuwatch.heap)

    def _poll(self, tier: str) -> None:
        started = time.perf_counter()
        self._overrun_logged.discard(tier)
        if not self.ensure_backend():
            self._store.poll_finished(tier, False, time.perf_counter() - started)
            return
        if tier == "fast" and self._slow_due:
            # Thresholds and limits are needed from the first fast poll on.
            self._slow_due = False
            self._poll("slow")
        self._store.poll_started(tier)
        errors: list[str] = []
        while self._discovery_errors:
            errors.append(self._discovery_errors.pop())
        complete = True
        read = self._backend.read_fast if tier == "fast" else self._backend.read_slow
        # group -> [seconds, every GPU read it without an error] (gpuwatch_collector_*)
        stats: dict[str, list[Any]] = {name: [0.0, True] for name in self._tier_groups[tier]}
        narrow = None if self._selection.everything else self._selection.narrow
        for identity in self._store.visible_identities():  # in index order
            uuid = identity.uuid
            try:
                sample = read(uuid)
            except DeviceLost as exc:
                complete = False
                errors.append("gpu_is_lost")
                if self._store.set_gpu_up(uuid, False) or uuid not in self._lost:
                    self._lost.add(uuid)
                    self._log.error("gpu_lost", tier=tier, uuid=uuid, gpu=self._index(uuid), error=str(exc),
                                    hint="the GPU fell off the bus or hangs: check `dmesg` for Xid 79; "
                                         "it needs a GPU reset or a reboot")
                continue
            except BackendUnavailable as exc:
                errors.append(exc.reason)
                self._backend_lost(exc)
                self._store.poll_finished(tier, False, time.perf_counter() - started, errors,
                                          {name: (seconds, False) for name, (seconds, _) in stats.items()})
                return
            except Exception as exc:  # a bug in a backend must not stop the other GPUs
                complete = False
                errors.append("internal")
                self._repeats.log("error", "poll_failed", ("poll_failed", tier, uuid), tier=tier, uuid=uuid,
                                  gpu=str(identity.index), error=f"{type(exc).__name__}: {exc}", exc_info=True)
                continue
            if uuid in self._lost:
                self._lost.discard(uuid)
                self._log.info("gpu_recovered", uuid=uuid, gpu=self._index(uuid))
            if narrow is not None:
                sample = narrow(sample)  # a backend that reads every group (not NVML)
            if sample.errors:
                errors.extend(sample.errors)
            for name, seconds, ok in sample.collected:
                entry = stats.get(name)
                if entry is not None:
                    entry[0] += seconds
                    if not ok:
                        entry[1] = False
            if isinstance(sample, SlowSample):
                attributed = time.perf_counter()
                workloads = self._workloads(identity, sample)
                for name in self._attributed:
                    if name in stats:
                        stats[name][0] += time.perf_counter() - attributed
                self._store.put_slow(uuid, sample, workloads)
            elif isinstance(sample, FastSample):
                self._store.put_fast(uuid, sample)
        self._store.poll_finished(tier, complete, time.perf_counter() - started, errors,
                                  {name: (seconds, ok and complete) for name, (seconds, ok) in stats.items()})

    def poll_host(self) -> None:
        """One read of the host groups, on the host job's own thread (never an NVML poll's)."""
        self._host_overrun_logged = False
        if self._host is None:
            return
        with self._host_lock:
            self._host_running = True
        try:
            while True:
                # every GPU discovered since start: a lost one keeps its place (Slurm's GRES order)
                gpus = list(self._store.snapshot().gpus)
                if not gpus:
                    return  # nothing discovered yet: the discovery wakes this job
                try:
                    sample = self._host(gpus)
                except Exception as exc:  # a bug in a host source: the polls and the other readings go on
                    self._repeats.log("error", "host_read_failed", ("host_read_failed",),
                                      error=f"{type(exc).__name__}: {exc}", exc_info=True)
                    return
                self._store.put_host(sample)
                with self._host_lock:
                    if not self._host_again:
                        return
                    self._host_again = False  # a discovery during the read: read again for its GPUs
        finally:
            with self._host_lock:
                self._host_running = False

    def _wake_host(self) -> None:
        """Read the host groups now (after a discovery), or once more right after the read in flight."""
        scheduler = self._scheduler
        if scheduler is None or self._host is None:
            return
        with self._host_lock:
            if self._host_running:
                self._host_again = True
                return
        try:
            scheduler.modify_job("host", next_run_time=utc_now())
        except Exception:  # shutting down: nothing to wake
            pass

    def _workloads(self, identity: GpuIdentity, sample: SlowSample) -> tuple[ProcessInfo, ...]:
        if self._attribute is None:
            return ()
        try:
            return self._attribute(identity, sample.processes)
        except Exception as exc:  # attribution is best effort: never lose the slow sample for it
            self._repeats.log("error", "attribution_failed", ("attribution_failed", identity.uuid), uuid=identity.uuid,
                              gpu=str(identity.index), error=f"{type(exc).__name__}: {exc}", exc_info=True)
            return ()

    def _index(self, uuid: str) -> str:
        for gpu in self._store.snapshot().gpus:
            if gpu.identity.uuid == uuid:
                return str(gpu.identity.index)
        return ""

    def _evaluate_if_due(self) -> None:
        """At a fast tick skipped because the last fast poll still runs (a wedged NVML call): the rules run
        here when they have not run for their cadence (within the watchdog's max(3 intervals, 10 s))."""
        if self._clock.monotonic() - self._last_evaluated >= self._rules_every:
            self.evaluate()

    # -- XID events ----------------------------------------------------------------------------
    def _events_loop(self) -> None:
        """Until stopped, whatever happens: the store counts every event; the log gets the first few
        lines per GPU and code, then a summary line per minute (Repeats)."""
        while not self._stop.is_set():
            try:
                self._events_once()
            except Exception as exc:  # a bug: the thread must outlive it
                self._events_status(False)
                self._repeats.log("error", "events_failed", ("events_failed",),
                                  error=f"{type(exc).__name__}: {exc}", exc_info=True)
                self._events_pause()

    def _events_status(self, ok: bool) -> None:
        if ok != self._events_ok:  # only changes reach the store (each is a new snapshot)
            self._events_ok = ok
            self._store.set_events_ok(ok)

    def _events_once(self) -> None:
        if not self.drain_events(EVENT_WAIT_SECONDS):
            self._events_pause()

    def _events_pause(self) -> None:
        """The events thread's pause while the backend is down (or its events failed): until it comes up, or
        EVENT_WAIT_SECONDS."""
        self._events_wake.wait(EVENT_WAIT_SECONDS)
        self._events_wake.clear()

    def drain_events(self, timeout_seconds: float = 0.0) -> bool:
        """One pass of the events thread without its waits: the XID events that arrive within
        ``timeout_seconds`` go into the store and the log. False when the backend is down or its
        events failed (the thread then waits before the next pass). Public for
        gpuwatch.testing.Harness, which runs the poller's jobs on simulated time."""
        self._repeats.flush()
        if not self._up:
            return False
        try:
            events = self._backend.wait_events(timeout_seconds)
        except BackendUnavailable:
            self._events_status(False)
            return False
        self._events_status(True)
        for event in events:
            self._store.record_xid(event)
        if events:
            index = {g.identity.uuid: str(g.identity.index) for g in self._store.snapshot().gpus}
            for event in events:
                meaning, severity, action = describe_xid(event.xid)  # the one XID table (groups/xid.py)
                self._repeats.log("warning", "xid_event", ("xid_event", event.uuid, event.xid), uuid=event.uuid,
                                  gpu=index.get(event.uuid, ""), xid=event.xid, meaning=meaning,
                                  xid_severity=severity, action=action)
        return True

    # -- scheduling ----------------------------------------------------------------------------
    def _on_max_instances(self, event: JobExecutionEvent) -> None:
        self._overrun(event.job_id)

    def _overrun(self, tier: str) -> None:
        if tier == "host":
            if not self._host_overrun_logged:
                self._host_overrun_logged = True
                self._log.warning("host_read_overrun",
                                  hint="reading the host groups (scontrol, the kubelet, /proc) takes longer than the "
                                       "slow interval; their readings go stale, the polls are not affected")
            return
        if tier not in ("fast", "slow"):
            return
        if tier == "fast":
            self._evaluate_if_due()
        self._store.poll_overrun(tier)
        if tier not in self._overrun_logged:
            self._overrun_logged.add(tier)
            state = self._store.snapshot().tiers[tier]
            # a run that overran by less than the fast tier's watcher looks is reported when it ends: its duration
            since, ran = state.in_flight_since, state.duration_seconds
            if since is not None:
                ran = self._clock.monotonic() - since
            running = None if ran is None else round(ran, 1)
            # one line per overrun (the next poll to start re-arms it), at most 3 a minute per tier under a
            # storm of short overruns (a busy host), then a summary line with ``repeated``
            self._repeats.log("warning", "poll_overrun", ("poll_overrun", tier), tier=tier, running_seconds=running,
                              hint="a poll is still running at its next tick, which is skipped: the host is busy, "
                                   "or, if this repeats with growing running_seconds, an NVML call is not "
                                   "returning (wedged driver?) and data goes stale until it does")

    def jobs(self) -> tuple[tuple[str, Callable[[], None], float, bool], ...]:
        """The scheduler's jobs: (id, function, interval in seconds, whether it runs at once rather than one
        interval in). ``start`` schedules exactly these; gpuwatch.testing.Harness runs them on simulated time."""
        jobs = [("fast", self.poll_fast, self._fast_interval, True),
                ("slow", self.poll_slow, self._slow_interval, False)]
        if self._host is not None:
            jobs.append(("host", self.poll_host, self._slow_interval, True))
        # The rules run at the end of a fast poll when due (poll_fast); while a poll hangs, at the fast ticks
        # skipped for it (_overrun, from the Ticker's watcher). No timer of their own: a wake-up of a thread
        # costs 0.12-0.3 ms of CPU (a cold one, measured on the bench's VM), as much as reading a GPU.
        return tuple(jobs)

    @property
    def reads_events(self) -> bool:
        """Whether a selected group reads NVML events: the events thread runs then."""
        return self._selection.events

    def start(self) -> None:
        jobs = self.jobs()
        fast = [job for job in jobs if job[0] == "fast"]
        others = [job for job in jobs if job[0] != "fast"]
        scheduler = SteadyScheduler(  # one worker per job at most: each runs one instance at a time
            executors={"default": ThreadPoolExecutor(max_workers=max(1, len(others)))},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        scheduler.add_listener(self._on_max_instances, EVENT_JOB_MAX_INSTANCES)
        for job_id, function, seconds, at_once in others:
            trigger = IntervalTrigger(seconds=seconds, timezone=timezone.utc)  # an object, not the alias "interval"
            scheduler.add_job(function, trigger, id=job_id, **({"next_run_time": utc_now()} if at_once else {}))
        scheduler.start()
        self._scheduler = scheduler
        for _, function, seconds, _ in fast:  # at once, as jobs() says
            self._ticker = Ticker(function, seconds, lambda: self._overrun("fast"), self._fast_failed,
                                  name="gpuwatch-fast-poll", watch_seconds=self._rules_every)
            self._ticker.start()
        if self.reads_events:  # XIDs; MIG configuration changes
            self._events_thread = threading.Thread(target=self._events_loop, name=EVENTS_THREAD, daemon=True)
            self._events_thread.start()

    def _fast_failed(self, exc: Exception) -> None:
        self._repeats.log("error", "poll_failed", ("fast_poll_failed",), tier="fast",
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.stop()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        self._events_wake.set()
        if self._events_thread is not None:
            # a thread between two waits ends at once; one inside nvmlEventSetWait is not waited for (up to
            # EVENT_WAIT_SECONDS): the backend's close leaves NVML initialised under it, and the process ends
            self._events_thread.join(timeout=0.1)
        if self._lifecycle.acquire(timeout=2):
            try:
                self._backend.close()
            finally:
                self._lifecycle.release()
