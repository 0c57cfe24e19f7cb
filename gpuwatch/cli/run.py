"""`gpuwatch run` and `gpuwatch demo` (the daemon's loop: signals, sd_notify, reload), `gpuwatch once`."""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from gpuwatch import __version__, heap, logs
from gpuwatch.agent import Agent
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.poller import EVENTS_THREAD
from gpuwatch.sdnotify import Notifier

EX_CONFIG = 78


def exit_past_stuck_threads(rc: int, grace: float = 2.0) -> None:
    """A poll thread stuck in a wedged NVML call (D state) cannot be joined: exit without waiting for it.

    (Python joins thread-pool workers at exit, daemon or not, so a stuck one would hang the stop.) The events
    thread is neither waited for nor reported: it waits for an XID up to EVENT_WAIT_SECONDS by design, and
    the backend's close left NVML to it.
    """
    import time

    deadline = time.monotonic() + grace
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread.name != EVENTS_THREAD:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    stuck = [name for name in alive if name != EVENTS_THREAD]
    if stuck:
        hint = ("a scrape was still being served (a slow client)" if all(n == "gpuwatch-http-conn" for n in stuck)
                else "an NVML call did not return; check the GPUs with nvidia-smi")
        logs.get_logger(component="main").warning("exit_with_busy_threads", threads=stuck, hint=hint)
    if alive:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def once_command(agent: Agent) -> int:
    agent.poller.poll_fast()  # opens the backend and also runs the first slow poll
    agent.poller.poll_host()  # and the host groups once (allocations, jobs)
    sys.stdout.buffer.write(agent.exposition.render()[0])
    sys.stdout.flush()
    up = agent.poller.backend_up
    agent.poller.stop()
    return 0 if up else 1


# Young objects between collections of the youngest generation (Python's default: 700). A poll makes
# thousands of short-lived objects that their reference counts free; a collection every 700 allocations
# traverses the ones alive at that moment again and again (at 64 GPUs and 0.5 s polls: 280 collections
# a minute and a half, 0.6 ms each, measured on the bench's VM). gpuwatch makes few reference cycles.
GC_THRESHOLD_YOUNG = 20_000


def _tune_gc() -> None:
    """Once the first poll is done: everything built by then (modules, the groups, discovery, caches)
    lives as long as the process; ``gc.freeze`` moves it out of the collector's reach, so that a full
    collection traverses what came since (at 64 GPUs a full one took 53 ms, most of it on objects that
    never die), and the youngest generation is collected less often (GC_THRESHOLD_YOUNG)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD_YOUNG, older, oldest)


# systemd's STATUS= line ("8 GPUs, 0 anomalies, last poll 1.4 s ago") is refreshed this often.
STATUS_SECONDS = 5.0


def raise_descriptor_limit() -> None:
    """The soft limit of open descriptors up to the hard one, as the Go runtime does for node_exporter and
    Prometheus: systemd's soft 1024 is what 4 listeners' kept connections (256 each) take by themselves."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:  # never lowered
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError):
            pass  # not allowed here: the accept loop copes (http_accept_failed)


def _idle_seconds(notifier: Notifier) -> float | None:
    """How long the main loop sleeps once ready when no signal comes: until its next duty, the STATUS=
    line and the watchdog's ping (at half its period, looked at every quarter); without systemd's
    notify socket it has none, and sleeps until a signal (each wake-up costs about 0.2 ms of CPU on a
    vCPU that idled: once a second it was a sixth of an idle 8-GPU node's CPU, docs/performance.md)."""
    if not notifier.enabled:
        return None
    if notifier.watchdog_seconds:
        return min(STATUS_SECONDS, notifier.watchdog_seconds / 4)
    return STATUS_SECONDS


def run_command(agent: Agent, demo: bool, reload: Callable[[], Config]) -> int:
    log = logs.get_logger(component="main")
    config = agent.config
    stop = threading.Event()
    reload_requested = threading.Event()
    notifier = Notifier()

    # The main loop sleeps in select() on the read end of a socket pair that Python's C-level signal
    # handler writes to (signal.set_wakeup_fd): a signal wakes it at once, and otherwise it wakes
    # for its duties only (a wake-up costs CPU). The handlers only set flags: nobody waits on them.
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: reload_requested.set())
    raise_descriptor_limit()
    heap.limit_arenas()  # before the HTTP, scheduler and events threads start
    try:
        bound = agent.serve()
    except ConfigError as exc:  # the web config file changed between the check at start and now
        logs.say(f"gpuwatch: configuration error: {exc}")
        return EX_CONFIG
    except OSError as exc:
        log.error("listen_failed", addresses=list(config.listen_addresses), error=str(exc),
                  hint="another process uses the port, or the address is not on this host: "
                       "pick one with --web.listen-address")
        return 1
    agent.poller.start()
    assert agent.http is not None
    web = agent.http.web_config
    log.info("started", version=__version__, backend=agent.backend.name, listen=bound, scheme=agent.http.scheme,
             basic_auth=web is not None and web.basic_auth, max_requests=config.web_max_requests,
             telemetry_path=config.telemetry_path, poll_interval=config.poll_interval,
             poll_slow_interval=config.poll_slow_interval)
    viewer = None
    if demo:
        from gpuwatch.live import LiveView

        urls = [f"{agent.http.scheme}://{_display_host(b)}{config.telemetry_path}" for b in bound]
        what = (f"scenario {config.sim_scenario}" if config.sim_scenario
                else f"simulated {config.sim_gpus}-GPU node ({config.sim_profile}) with a tour of faults")
        logs.say(f"gpuwatch demo: {what}; scrape {' or '.join(urls)}; Ctrl-C stops.")
        if sys.stdout.isatty():
            from gpuwatch.live import LogTail

            tail = LogTail()  # log lines go under the table instead of scrolling it away
            logs.configure(config.log_level, "console", stream=tail)  # type: ignore[arg-type]
            viewer = LiveView(agent.store.snapshot, agent.clock, config.staleness("fast"), sys.stdout, tail)
            viewer.draw()
            viewer.start(config.poll_interval)
    started = agent.clock.monotonic()
    ready = False
    last_status = last_ping = float("-inf")
    withheld: str | None = None
    try:
        idle = _idle_seconds(notifier)
        while not stop.is_set():
            select.select([wake_r], [], [], idle if ready else 0.25)
            with contextlib.suppress(OSError):
                while wake_r.recv(64):
                    pass
            if stop.is_set():
                break
            now = agent.clock.monotonic()
            if not ready and (agent.store.snapshot().tiers["fast"].last_completed_monotonic is not None
                              or now - started > 60):
                # listener bound and the first discovery done (or the backend known to be down)
                notifier.send(READY=1, STATUS=agent.status_line())
                ready, last_status = True, now
                _tune_gc()
            if reload_requested.is_set():
                reload_requested.clear()
                _reload(agent, reload, log)
            if notifier.watchdog_seconds and now - last_ping >= notifier.watchdog_seconds / 2:
                problem = agent.alive()
                if problem is None:
                    notifier.send(WATCHDOG=1)
                    last_ping, withheld = now, None
                elif problem != withheld:
                    withheld = problem
                    log.error("watchdog_withheld", reason=problem, hint="systemd restarts gpuwatch if this persists")
            if ready and now - last_status >= STATUS_SECONDS:
                notifier.send(STATUS=agent.status_line())
                last_status = now
    finally:
        signal.set_wakeup_fd(previous_fd)
        wake_r.close()
        wake_w.close()
        notifier.send(STOPPING=1)
        if viewer is not None:
            viewer.stop()
        agent.stop()
        log.info("stopped")
    return 0


def _reload(agent: Agent, reload: Callable[[], Config], log: Any) -> None:
    hint = "the previous configuration stays in effect; fix the file and send SIGHUP again (systemctl reload gpuwatch)"
    try:
        new = reload()
        needs_restart = agent.reconfigure(new)
    except ConfigError as exc:
        log.error("reload_failed", error=str(exc), hint=hint)
        return
    except Exception as exc:  # a bug must not take the running daemon down: it keeps the old settings
        log.error("reload_failed", error=f"{type(exc).__name__}: {exc}", hint=hint, exc_info=True)
        return
    log.info("reloaded", rules=sorted(new.rules))
    if needs_restart:
        log.warning("reload_needs_restart", settings=needs_restart,
                    hint="these settings take effect at the next start: systemctl restart gpuwatch")


def list_scenarios() -> int:
    from gpuwatch.backends.simulated import scenarios

    for name, scenario in sorted(scenarios().items()):
        fires = f" -> {scenario.rule} on GPU {scenario.gpu}" if scenario.rule and scenario.gpu is not None else (
            f" -> {scenario.rule}" if scenario.rule else "")
        print(f"{name:24} {scenario.profile:8} {scenario.gpu_count} GPUs  {scenario.description}{fires}")
    return 0


def _display_host(bound: str) -> str:
    host, _, port = bound.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        host = "localhost"
    return f"{host}:{port}"
