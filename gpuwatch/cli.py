"""The command line and composition root: the one place that wires concrete parts together.

    gpuwatch run     the daemon (NVML backend by default)
    gpuwatch demo    the daemon on a simulated 8-GPU node with a scripted tour of faults
    gpuwatch once    one poll, the exposition on stdout, then exit
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from gpuwatch import __version__
from gpuwatch import config as configuration
from gpuwatch import logs
from gpuwatch.backends.base import Backend
from gpuwatch.clock import Clock, SystemClock
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.exporter import build_registry, text_exposition
from gpuwatch.exporter.http import App, HttpServers
from gpuwatch.poller import Poller
from gpuwatch.store import Store

EX_CONFIG = 78


def make_backend(config: Config, clock: Clock) -> Backend:
    if config.backend == "simulated":
        from gpuwatch.backends.simulated import SimulatedBackend, demo_tour

        faults = None
        if config.sim_faults:
            if config.sim_gpus >= 3:
                faults = demo_tour(gpu_count=config.sim_gpus, profile=config.sim_profile)
            else:
                logs.get_logger(component="main").warning(
                    "demo_tour_disabled", reason="the fault tour needs at least 3 GPUs", hint="use --sim.gpus 3 or more")
        return SimulatedBackend(clock, gpu_count=config.sim_gpus, profile=config.sim_profile, faults=faults)
    from gpuwatch.backends.nvml import NvmlBackend

    return NvmlBackend()


class Agent:
    """Backend, store, poller, collector and HTTP servers, wired together."""

    def __init__(self, config: Config, clock: Clock | None = None, backend: Backend | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.backend = backend or make_backend(config, self.clock)
        self.store = Store(self.clock, self.backend.name)
        self.poller = Poller(self.backend, self.store, self.clock, config.poll_interval, config.poll_slow_interval)
        self.registry = build_registry(self.store.snapshot, self.clock, config.staleness)
        self.http: HttpServers | None = None

    def serve(self) -> list[str]:
        app = App(self.registry, self.store.snapshot, self.clock.monotonic, self.config.telemetry_path,
                  self.config.staleness("fast"))
        self.http = HttpServers(self.config.listen_addresses, app)
        self.http.start()
        return self.http.bound()

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        self.poller.stop()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuwatch", description="NVIDIA GPU node monitor and Prometheus exporter.")
    parser.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in (
        ("run", "run the daemon (NVML backend unless configured otherwise)"),
        ("demo", "run the daemon on a simulated 8-GPU node with a scripted tour of faults"),
        ("once", "poll once, print the exposition to stdout and exit"),
    ):
        command = sub.add_parser(name, help=text, description=text)
        configuration.add_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    overrides: dict[str, Any] = {}
    if args.command == "demo":
        overrides = {"backend": "simulated", "sim_faults": True}
    try:
        config = configuration.load(args, overrides=overrides)
    except ConfigError as exc:
        print(f"gpuwatch: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    logs.configure(config.log_level, config.log_format)
    if args.command == "once":
        return _once(config)
    return _run(config, demo=args.command == "demo")


def _once(config: Config) -> int:
    agent = Agent(config)
    agent.poller.poll_fast()  # opens the backend and also runs the first slow poll
    sys.stdout.buffer.write(text_exposition(agent.registry))
    sys.stdout.flush()
    up = agent.poller.backend_up
    agent.poller.stop()
    return 0 if up else 1


def _run(config: Config, demo: bool) -> int:
    log = logs.get_logger(component="main")
    agent = Agent(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        bound = agent.serve()
    except OSError as exc:
        log.error("listen_failed", addresses=list(config.listen_addresses), error=str(exc),
                  hint="another process uses the port, or the address is not on this host: "
                       "pick one with --web.listen-address")
        return 1
    agent.poller.start()
    log.info("started", version=__version__, backend=agent.backend.name, listen=bound,
             telemetry_path=config.telemetry_path, poll_interval=config.poll_interval,
             poll_slow_interval=config.poll_slow_interval)
    viewer = None
    if demo:
        from gpuwatch.live import LiveView

        urls = [f"http://{_display_host(b)}{config.telemetry_path}" for b in bound]
        print(f"gpuwatch demo: simulated {config.sim_gpus}-GPU node ({config.sim_profile}); "
              f"scrape {' or '.join(urls)}; Ctrl-C stops.", file=sys.stderr, flush=True)
        if sys.stdout.isatty():
            viewer = LiveView(agent.store.snapshot, agent.clock, config.staleness("fast"), sys.stdout)
            viewer.start(config.poll_interval)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if viewer is not None:
            viewer.stop()
        agent.stop()
        log.info("stopped")
    return 0


def _display_host(bound: str) -> str:
    host, _, port = bound.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        host = "localhost"
    return f"{host}:{port}"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
