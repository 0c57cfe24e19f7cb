"""The poller against a scripted backend: lifecycle, lost GPUs, wedged calls, XID events."""

import json
import threading
import time

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobExecutionEvent
from daemon import wait_for
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch import poller as poller_module
from gpuwatch.clock import FakeClock, SystemClock
from gpuwatch.errors import BackendUnavailable
from gpuwatch.model import XidEvent
from gpuwatch.poller import Poller
from gpuwatch.store import Store
from gpuwatch.testing import ScriptedBackend, exposition


def samples(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text, name, **labels):
    return samples(text).get((name, tuple(sorted(labels.items()))))


def make(gpus=2):
    clock = FakeClock()
    backend = ScriptedBackend(gpus)
    store = Store(clock, backend.name)
    poller = Poller(backend, store, clock, fast_interval=2.0, slow_interval=30.0)
    return clock, backend, store, poller


def log_events(capsys):
    return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]


def test_first_fast_poll_also_reads_the_slow_tier():
    """Thresholds and limits are there from the first fast poll, not 30 s later."""
    clock, backend, store, poller = make()
    poller.poll_fast()
    text = exposition(store, clock)
    assert value(text, "gpuwatch_backend_up", backend="scripted") == 1
    assert value(text, "gpuwatch_power_limit_watts", gpu="0", uuid=backend.gpus[0].identity.uuid, limit="enforced") == 700
    assert value(text, "gpuwatch_poll_success", tier="fast") == 1
    assert value(text, "gpuwatch_poll_success", tier="slow") == 1
    assert backend.calls["read_slow"] == 2


def test_backend_down_is_logged_once_retried_with_backoff_and_recovers(capsys):
    """Driver not loaded: served as backend_up 0, one log line with a hint, capped backoff, recovery."""
    clock, backend, store, poller = make()
    backend.open_error = BackendUnavailable("driver_not_loaded", "NVML: Driver Not Loaded", "modprobe nvidia")
    attempts = []
    for _ in range(40):
        before = backend.calls.get("open", 0)
        poller.poll_fast()
        if backend.calls.get("open", 0) > before:
            attempts.append(clock.monotonic())
        clock.advance(2.0)
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[:4] == [2.0, 4.0, 8.0, 16.0]
    assert max(gaps) <= 60.0
    text = exposition(store, clock)
    assert value(text, "gpuwatch_backend_up", backend="scripted") == 0
    assert value(text, "gpuwatch_poll_success", tier="fast") == 0
    down = [e for e in log_events(capsys) if e["event"] == "backend_down"]
    assert len(down) == 1 and down[0]["reason"] == "driver_not_loaded" and down[0]["hint"] == "modprobe nvidia"

    backend.open_error = None
    clock.advance(60.0)
    poller.poll_fast()
    text = exposition(store, clock)
    assert value(text, "gpuwatch_backend_up", backend="scripted") == 1
    assert value(text, "gpuwatch_gpus") == 2
    assert [e["event"] for e in log_events(capsys)] .count("backend_recovered") == 1


def test_backend_lost_mid_run_marks_down_and_reopens(capsys):
    clock, backend, store, poller = make()
    poller.poll_fast()
    backend.read_error = BackendUnavailable("uninitialized", "NVML: Uninitialized", "")
    clock.advance(2)
    poller.poll_fast()
    assert not store.snapshot().backend_up
    assert backend.calls["close"] == 1
    backend.read_error = None
    clock.advance(2)
    poller.poll_fast()
    assert store.snapshot().backend_up
    assert backend.calls["open"] == 2


def test_lost_gpu_stays_visible_at_zero_and_others_go_on(capsys):
    clock, backend, store, poller = make(3)
    poller.poll_fast()
    lost = backend.gpus[1].identity.uuid
    backend.lost.add(lost)
    for _ in range(3):
        clock.advance(2)
        poller.poll_fast()
    text = exposition(store, clock)
    assert value(text, "gpuwatch_gpu_up", gpu="1", uuid=lost) == 0
    assert value(text, "gpuwatch_gpu_up", gpu="0", uuid=backend.gpus[0].identity.uuid) == 1
    assert value(text, "gpuwatch_temperature_celsius", gpu="1", uuid=lost, sensor="gpu") is None
    assert value(text, "gpuwatch_temperature_celsius", gpu="2", uuid=backend.gpus[2].identity.uuid, sensor="gpu") == 28
    assert value(text, "gpuwatch_poll_success", tier="fast") == 0
    assert value(text, "gpuwatch_poll_errors_total", tier="fast", error="gpu_is_lost") == 3
    assert [e["event"] for e in log_events(capsys)].count("gpu_lost") == 1
    backend.lost.clear()
    clock.advance(2)
    poller.poll_fast()
    assert value(exposition(store, clock), "gpuwatch_gpu_up", gpu="1", uuid=lost) == 1


def test_readings_are_dropped_after_the_staleness_bound():
    """A poll that stops completing leaves the last-poll timestamp old and the readings gone."""
    clock, backend, store, poller = make(1)
    polled_at = clock.wall()
    poller.poll_fast()
    uuid = backend.gpus[0].identity.uuid
    clock.advance(5.9)
    assert value(exposition(store, clock), "gpuwatch_temperature_celsius", gpu="0", uuid=uuid, sensor="gpu") == 28
    clock.advance(0.2)
    text = exposition(store, clock)
    assert value(text, "gpuwatch_temperature_celsius", gpu="0", uuid=uuid, sensor="gpu") is None
    assert value(text, "gpuwatch_poll_success", tier="fast") == 0
    assert value(text, "gpuwatch_gpu_up", gpu="0", uuid=uuid) == 1
    assert value(text, "gpuwatch_last_poll_timestamp_seconds", tier="fast") == polled_at


def test_wedged_call_skips_runs_without_piling_up_and_resumes(capsys):
    """With the real scheduler: a read that blocks holds one thread; later runs are skipped, not queued,
    and the skipped ticks run the rules (so collection_stalled can fire while no poll completes)."""
    clock, backend, store, poller = make(1)
    evaluations: list[float] = []
    scheduler_poller = Poller(backend, store, SystemClock(), fast_interval=0.05, slow_interval=30.0,
                              evaluate=lambda: evaluations.append(time.monotonic()))
    backend.block = threading.Event()
    scheduler_poller.start()
    try:
        seen: list[dict] = []
        wait_for(lambda: [e for e in seen.extend(log_events(capsys)) or seen if e["event"] == "poll_overrun"],
                 what="poll_overrun while the read is blocked")
        wait_for(lambda: len(evaluations) >= 2, what="the rules to run at the skipped ticks (every 3 s)")
        assert backend.calls.get("read_fast", 0) == 1  # the first poll is still blocked: no poll ran them
        assert threading.active_count() < 20
        backend.block.set()
        wait_for(lambda: backend.calls.get("read_fast", 0) >= 3, what="polls resuming")
    finally:
        backend.block.set()
        scheduler_poller.stop()


def test_a_bug_that_escapes_the_fast_poll_is_logged_and_the_polls_go_on(capsys):
    """The fast poll's own thread outlives what the poll raises (poll_fast catches the backend's errors
    itself; this is for a bug around them): one poll_failed line per burst, the next ticks run."""
    _, backend, store, _ = make(1)
    poller = Poller(backend, store, SystemClock(), fast_interval=0.02, slow_interval=30.0)
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("a bug")

    poller.poll_fast = broken  # type: ignore[method-assign]  # jobs() takes the bound attribute
    poller.start()
    try:
        wait_for(lambda: len(calls) >= 3, what="polls after the failures")
    finally:
        poller.stop()
    failed = [e for e in log_events(capsys) if e["event"] == "poll_failed"]
    assert failed and failed[0]["tier"] == "fast" and failed[0]["error"] == "RuntimeError: a bug"
    assert "RuntimeError" in failed[0]["exception"]


def test_xid_events_become_counters_from_zero():
    """The per-GPU XID counter exists at 0 from the start; a code's own series appears with its first event."""
    clock, backend, store, poller = make(1)
    poller.poll_fast()
    uuid = backend.gpus[0].identity.uuid
    text = exposition(store, clock)
    assert value(text, "gpuwatch_xid_events_total", gpu="0", uuid=uuid) == 0
    assert value(text, "gpuwatch_xid_errors_total", gpu="0", uuid=uuid, xid="79") is None
    store.record_xid(XidEvent(uuid, 79, 1_700_000_100.0))
    store.record_xid(XidEvent(uuid, 13, 1_700_000_200.0))
    text = exposition(store, clock)
    assert value(text, "gpuwatch_xid_events_total", gpu="0", uuid=uuid) == 2
    assert value(text, "gpuwatch_xid_errors_total", gpu="0", uuid=uuid, xid="79") == 1
    assert value(text, "gpuwatch_xid_errors_total", gpu="0", uuid=uuid, xid="13") == 1
    assert value(text, "gpuwatch_xid_last_timestamp_seconds", gpu="0", uuid=uuid, xid="13") == 1_700_000_200.0


class _WaitingBackend(ScriptedBackend):
    """wait_events blocks as nvmlEventSetWait does until the test releases it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        self._count("wait_events")
        self.entered.set()
        self.release.wait()
        self.returned.set()
        return []


def test_a_stop_does_not_wait_for_the_events_threads_wait_in_progress(monkeypatch):
    """The events thread waits up to EVENT_WAIT_SECONDS (10 s) in nvmlEventSetWait: a stop closes the backend
    without waiting for that wait to end (NvmlBackend.close leaves NVML initialised under it)."""
    monkeypatch.setattr(poller_module, "EVENT_WAIT_SECONDS", 3600.0)  # a stop that waited would time out
    backend = _WaitingBackend()
    poller = Poller(backend, Store(SystemClock(), backend.name), SystemClock(), fast_interval=0.05,
                    slow_interval=30.0)
    poller.start()
    try:
        wait_for(backend.entered.is_set, what="the events thread inside its wait")
        poller.stop()
        assert (backend.calls.get("close"), backend.returned.is_set()) == (1, False)
    finally:
        backend.release.set()
    wait_for(backend.returned.is_set, what="the wait's own end")


def test_the_events_thread_waits_for_events_as_soon_as_the_backend_comes_up(monkeypatch):
    """While the backend is down the events thread pauses (up to EVENT_WAIT_SECONDS); the backend coming up ends
    the pause, so the XIDs after a start or a recovery are waited for at once, each with its own code (those
    queued before a wait begins all come out with the last one's code)."""
    monkeypatch.setattr(poller_module, "EVENT_WAIT_SECONDS", 3600.0)  # only the backend's coming up ends the pause
    _, backend, _, _ = make(1)
    backend.open_error = BackendUnavailable("driver_not_loaded", "NVML: Driver Not Loaded", "modprobe nvidia")
    poller = Poller(backend, Store(SystemClock(), backend.name), SystemClock(), fast_interval=0.05,
                    slow_interval=30.0)
    poller.start()
    try:
        wait_for(lambda: backend.calls.get("open", 0) >= 2, what="retries of the open")
        assert backend.calls.get("wait_events", 0) == 0  # paused: nothing to wait on
        backend.open_error = None
        wait_for(lambda: backend.calls.get("wait_events", 0) >= 1, timeout=5, what="a wait after the open")
    finally:
        poller.stop()


def test_steady_scheduler_moves_every_job_by_a_wall_clock_step():
    """When wall minus monotonic time jumps (an NTP step), every next run time jumps with it, so the
    jobs keep their monotonic cadence; drift under the threshold is left alone."""
    from datetime import datetime, timezone

    from gpuwatch.schedule import SteadyScheduler

    wall = [1_700_000_000.0]
    mono = [100.0]
    scheduler = SteadyScheduler(timezone="UTC", wall=lambda: wall[0], monotonic=lambda: mono[0])
    due = datetime(2030, 1, 1, tzinfo=timezone.utc)
    scheduler.start(paused=True)  # jobs in the job store; paused: they never run here
    scheduler.add_job(lambda: None, "interval", seconds=2, id="fast", next_run_time=due)

    def next_run():
        return scheduler.get_job("fast").next_run_time

    scheduler._process_jobs()  # first look: nothing to compare with
    wall[0] += 1.0
    mono[0] += 1.2  # 0.2 s of drift: not a step
    scheduler._process_jobs()
    assert next_run() == due and scheduler.steps == []
    wall[0] -= 300.0  # stepped back 5 minutes
    mono[0] += 1.0
    wall[0] += 1.0
    scheduler._process_jobs()
    assert round((next_run() - due).total_seconds(), 3) == -300.0 and scheduler.steps == [-300.0]
    # a step while APScheduler looks at the jobs (between the scheduler's two reads of the clocks): its wait is
    # on the wrong side of the step, so the scheduler looks again at once, and that look moves the jobs
    reads = iter([wall[0], wall[0] + 600.0])
    scheduler._wall = lambda: next(reads, wall[0] + 600.0)
    assert scheduler._process_jobs() == 0.0 and scheduler.steps == [-300.0]
    scheduler._process_jobs()
    assert round((next_run() - due).total_seconds(), 3) == 300.0 and scheduler.steps == [-300.0, 600.0]
    scheduler.shutdown(wait=False)


def test_rules_run_once_per_fast_poll_and_at_the_skipped_ticks_only_while_polls_stall():
    """The rules have no timer of their own: at 4 s polls and slower they run at the end of each fast poll,
    and when a fast tick is skipped because the last poll still runs (a wedged call: APScheduler's
    max-instances event), at that tick, within the watchdog's bound of 3 intervals. A skipped slow tick
    runs no rules."""
    clock = FakeClock()
    backend = ScriptedBackend(1)
    store = Store(clock, backend.name)
    runs = []
    poller = Poller(backend, store, clock, fast_interval=4.0, slow_interval=30.0,
                    evaluate=lambda: runs.append(clock.monotonic()))
    assert [job_id for job_id, *_ in poller.jobs()] == ["fast", "slow"]  # one wake-up per poll, no timer

    def skipped(tier: str) -> None:
        poller._on_max_instances(JobExecutionEvent(EVENT_JOB_MAX_INSTANCES, tier, "default", None))

    for _ in range(5):
        poller.poll_fast()  # its rules run at its end
        clock.advance(3.99)
        skipped("slow")  # a slow poll overran: not the rules' business
        clock.advance(0.01)
    assert len(runs) == 5  # once per poll (at 4 s polls and slower)
    # polls stall: each skipped fast tick runs the rules when they have not run for their cadence (4 s)
    for _ in range(6):
        clock.advance(4.0)
        skipped("fast")
    gaps = [b - a for a, b in zip(runs[4:], runs[5:])]  # from the last poll's run on
    assert len(gaps) >= 2 and max(gaps) <= 3 * 4.0


def test_rules_run_about_every_4_s_at_faster_polls_and_while_such_polls_stall():
    """At 0.5 s polls the rules run after every eighth poll (RULES_EVERY_SECONDS, half a poll of tolerance for
    the polls' jitter), at 2 s after every other one; while a poll hangs, at the skipped ticks at most 4.5 s
    apart, inside the watchdog's bound of max(3 intervals, 10 s)."""
    for interval in (0.5, 2.0):
        clock = FakeClock()
        backend = ScriptedBackend(1)
        store = Store(clock, backend.name)
        runs: list[float] = []
        poller = Poller(backend, store, clock, fast_interval=interval, slow_interval=30.0,
                        evaluate=lambda clock=clock, runs=runs: runs.append(clock.monotonic()))
        started = clock.monotonic()
        for i in range(round(16 / interval) + 1):
            poller.poll_fast()
            clock.advance(interval + (0.1 if i % 2 else -0.1) * interval)  # the scheduler's jitter
        assert [round(t - started) for t in runs] == [0, 4, 8, 12, 16]
        assert backend.calls["read_fast"] == round(16 / interval) + 1  # every poll still reads
        last = runs[-1]
        for _ in range(round(30 / interval)):  # a poll hangs: every fast tick is skipped
            poller._on_max_instances(JobExecutionEvent(EVENT_JOB_MAX_INSTANCES, "fast", "default", None))
            clock.advance(interval)
        gaps = [b - a for a, b in zip([last, *runs], runs) if b > last]
        assert len(gaps) >= 5 and max(gaps) <= 4.0 + interval + 0.2 <= max(3 * interval, 10.0)


def test_a_short_overrun_reported_after_its_poll_says_how_long_the_poll_ran(capsys):
    """The fast poll's own thread reports a tick that a poll overlapped by a little when the poll has ended
    (the watcher looks only every 4 s): running_seconds is then that poll's duration, not null."""
    clock, backend, store, poller = make(1)
    poller.poll_fast()
    ran = store.snapshot().tiers["fast"].duration_seconds
    assert ran is not None and store.snapshot().tiers["fast"].in_flight_since is None
    poller._overrun("fast")
    [line] = [e for e in log_events(capsys) if e["event"] == "poll_overrun"]
    assert line["running_seconds"] == round(ran, 1)


def test_a_storm_of_short_overruns_is_three_lines_a_minute_and_a_summary(capsys):
    """A busy host makes short polls overrun now and then: each overrun is one poll_overrun line (the next
    poll re-arms it), but at most 3 a minute per tier, then one line with how many were held back."""
    clock, backend, store, poller = make(1)

    def overrun() -> None:
        poller.poll_fast()
        poller._on_max_instances(JobExecutionEvent(EVENT_JOB_MAX_INSTANCES, "fast", "default", None))
        poller._on_max_instances(JobExecutionEvent(EVENT_JOB_MAX_INSTANCES, "fast", "default", None))  # same overrun
        clock.advance(2.0)

    for _ in range(10):  # 20 s
        overrun()
    lines = [e for e in log_events(capsys) if e["event"] == "poll_overrun"]
    assert len(lines) == 3 and all(e["tier"] == "fast" and "repeated" not in e for e in lines)
    assert "host is busy" in lines[0]["hint"]
    clock.advance(60.0)
    overrun()
    lines = [e for e in log_events(capsys) if e["event"] == "poll_overrun"]
    assert [e.get("repeated") for e in lines] == [7, None]
