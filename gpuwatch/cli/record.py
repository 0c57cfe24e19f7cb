"""`gpuwatch record`: poll the configured backend like `run` (serving nothing) and write a trace."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from gpuwatch import __version__, logs
from gpuwatch.agent import Agent, make_backend
from gpuwatch.clock import SystemClock
from gpuwatch.config import Config


def record_command(config: Config, output: str, duration: float | None) -> int:
    """The normal poller over the configured backend wrapped in a Recorder, for ``duration`` (or until a signal)."""
    from gpuwatch.backends.recorder import Recorder
    from gpuwatch.trace import TraceWriter

    log = logs.get_logger(component="record")
    clock = SystemClock()
    inner = make_backend(config, clock)
    try:
        writer = TraceWriter(sys.stdout if output == "-" else output, clock, backend=inner.name,
                             fast_interval=config.poll_interval, slow_interval=config.poll_slow_interval)
    except OSError as exc:
        logs.say(f"gpuwatch: cannot write {output}: {exc.strerror or exc}")
        return 1
    recorder = Recorder(inner, writer, clock)
    agent = Agent(config, clock=clock, backend=recorder)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = None if duration is None else clock.monotonic() + duration
    agent.poller.start()
    log.info("recording", version=__version__, backend=inner.name, output=writer.name, duration_seconds=duration,
             poll_interval=config.poll_interval, poll_slow_interval=config.poll_slow_interval)
    try:
        while recorder.error is None:
            remaining = None if deadline is None else deadline - clock.monotonic()
            if remaining is not None and remaining <= 0:
                break
            if stop.wait(0.5 if remaining is None else min(0.5, remaining)):
                break
    finally:
        agent.stop()
        writer.close()
    if recorder.error is not None:
        logs.say(f"gpuwatch: recording stopped: {recorder.error}")
        return 1
    log.info("recorded", output=writer.name, records=writer.records, skipped=recorder.skipped,
             seconds=round(clock.monotonic() - writer.start, 1))
    return 0
