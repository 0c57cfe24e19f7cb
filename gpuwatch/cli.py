"""The command line and composition root: the one place that wires concrete parts together.

    gpuwatch run     the daemon (NVML backend by default)
    gpuwatch demo    the daemon on a simulated 8-GPU node with a scripted tour of faults
    gpuwatch once    one poll, the exposition on stdout, then exit
    gpuwatch check   ask the running daemon for anomalies (Slurm HealthCheckProgram, NHC)
    gpuwatch record  poll the configured backend like `run` and write what it reports to a trace file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpuwatch import __version__, logs, slurm, webconfig
from gpuwatch import config as configuration
from gpuwatch.attribution import Attributor
from gpuwatch.backends.base import Backend
from gpuwatch.clock import Clock, SystemClock
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError, ReplayFormatError
from gpuwatch.exporter import build_exposition
from gpuwatch.exporter.http import App, HttpServers
from gpuwatch.poller import Poller
from gpuwatch.rules import all_rules
from gpuwatch.rules.engine import Engine, build_configs
from gpuwatch.sdnotify import Notifier
from gpuwatch.status import verdict, where
from gpuwatch.store import Store

EX_CONFIG = 78


def make_backend(config: Config, clock: Clock) -> Backend:
    if config.backend == "simulated":
        from gpuwatch.backends.simulated import SimulatedBackend, demo_tour, scenarios

        if config.sim_scenario is not None:
            known = scenarios()
            if config.sim_scenario not in known:
                raise ConfigError(f"sim.scenario: unknown scenario {config.sim_scenario!r}; "
                                  f"known: {', '.join(sorted(known))} (gpuwatch demo --list)")
            return known[config.sim_scenario].backend(clock)
        faults = None
        if config.sim_faults:
            if config.sim_gpus >= 3:
                faults = demo_tour(gpu_count=config.sim_gpus, profile=config.sim_profile)
            else:
                logs.get_logger(component="main").warning(
                    "demo_tour_disabled", reason="the fault tour needs at least 3 GPUs", hint="use --sim.gpus 3 or more")
        return SimulatedBackend(clock, gpu_count=config.sim_gpus, profile=config.sim_profile, faults=faults)
    if config.backend == "replay":
        from gpuwatch.backends.replay import ReplayBackend
        from gpuwatch.trace import read_trace

        assert config.replay_file is not None  # configuration.load() refuses backend replay without a file
        trace = read_trace(config.replay_file)  # ReplayFormatError: main() reports it, exit 78
        log = logs.get_logger(component="main")
        for note in trace.notes:
            log.warning("replay_trace_truncated", note=note)
        wanted = trace.header.fast_interval / config.replay_speed
        if config.poll_interval > wanted * 1.01:
            log.warning("replay_undersampled", recorded_interval=trace.header.fast_interval,
                        speed=config.replay_speed, poll_interval=config.poll_interval,
                        hint=f"readings between polls are skipped: use --poll.interval {wanted:g} to see them all")
        return ReplayBackend(trace, clock, speed=config.replay_speed, loop=config.replay_loop)
    from gpuwatch.backends.nvml import NvmlBackend

    return NvmlBackend(config.collectors, config.collector_options)


class Agent:
    """Backend, store, poller, collector and HTTP servers, wired together."""

    def __init__(self, config: Config, clock: Clock | None = None, backend: Backend | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.backend = backend or make_backend(config, self.clock)
        self.store = Store(self.clock, self.backend.name)
        rules = all_rules()
        self.engine = Engine(rules, build_configs(rules, config.rules), config.staleness("fast"),
                             config.rules_window, config.rules_expected_gpus)
        attribute = None
        if "processes" in config.collectors:
            attribute = Attributor(config.attribution_proc_root, config.attribution_mapping_dir).attribute
        self.poller = Poller(self.backend, self.store, self.clock, config.poll_interval, config.poll_slow_interval,
                             evaluate=self.evaluate_rules, attribute=attribute, enabled=config.collectors)
        options = config.collector_options
        self.exposition = build_exposition(
            self.store.snapshot, self.clock, config.staleness, enabled=config.collectors,
            per_pid_max=options["processes.per-pid-max"] if options["processes.per-pid"] else 0)
        self.http: HttpServers | None = None

    def evaluate_rules(self) -> None:
        anomalies = self.engine.evaluate(self.store.snapshot(), self.clock.monotonic(), self.clock.wall())
        self.store.set_anomalies(anomalies, *self.engine.counters())

    def alive(self) -> str | None:
        """None while gpuwatch itself works (scheduler and HTTP), else why not. GPUs do not count here."""
        bound = max(3 * self.config.poll_interval, 10.0)
        last = self.poller.last_evaluated  # the scheduler's heartbeat: a rule that raises does not stop it
        if last is None or self.clock.monotonic() - last > bound:
            return f"the scheduler has not run the rules for more than {bound:g} s"
        if self.http is not None and not self.http.alive():
            return "an HTTP listener thread died"
        return None

    def status_line(self) -> str:
        """One line for systemd's STATUS=, e.g. '8 GPUs, 1 anomaly, last poll 1.4 s ago'."""
        snap = self.store.snapshot()
        if not snap.backend_up:
            return f"backend {snap.backend} down: {snap.backend_reason}"
        firing = sum(1 for a in snap.anomalies if a.firing and a.severity != "info")
        last = snap.tiers["fast"].last_completed_monotonic
        age = "never" if last is None else f"{self.clock.monotonic() - last:.1f} s ago"
        return f"{snap.visible_gpus} GPUs, {firing} {'anomaly' if firing == 1 else 'anomalies'}, last poll {age}"

    def reconfigure(self, new: Config) -> list[str]:
        """Apply what can change without a restart (rules, log level); returns the settings that need one."""
        rules = build_configs(self.engine.rules, new.rules)  # ConfigError: the caller keeps the old settings
        self.engine.reconfigure(rules)
        logs.reconfigure(new.log_level, new.log_format)
        live = ("rules", "log_level", "log_format",  # the check_* settings are for `gpuwatch check` only
                "check_username", "check_password_file", "check_client_cert_file", "check_client_key_file")
        changed = [f.name for f in dataclasses.fields(Config)
                   if f.name not in live and getattr(new, f.name) != getattr(self.config, f.name)]
        self.config = dataclasses.replace(self.config, rules=new.rules, log_level=new.log_level,
                                          log_format=new.log_format)
        return changed

    def serve(self) -> list[str]:
        app = App(self.exposition, self.store.snapshot, self.clock.monotonic, self.config.telemetry_path,
                  self.config.staleness)
        # the content of the web config file is re-read while serving (docs/security.md); its name is not
        web = webconfig.load(self.config.web_config_file) if self.config.web_config_file else None
        self.http = HttpServers(self.config.listen_addresses, app, web_config=web,
                                max_requests=self.config.web_max_requests)
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
        ("check", "ask the local daemon for anomalies; exit 0 healthy, 1 critical anomaly, 2 cannot tell"),
    ):
        command = sub.add_parser(name, help=text, description=text)
        configuration.add_arguments(command)
    demo = sub.choices["demo"]
    demo.add_argument("--scenario", dest="sim_scenario", metavar="NAME",
                      help="play a named scenario (one per anomaly rule) instead of the tour")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    check = sub.choices["check"].add_argument_group(
        "Slurm", "drain/resume this node from Slurm's HealthCheckProgram, as root (docs/slurm.md)")
    check.add_argument("--drain", action="store_true",
                       help="on a critical anomaly, drain the node: scontrol update State=DRAIN "
                            "Reason='gpuwatch: ...' (never over another drain, never when the check cannot tell)")
    check.add_argument("--resume", action="store_true",
                       help="resume the node once healthy for --resume-after, only if its reason starts with "
                            "'gpuwatch:'")
    check.add_argument("--dry-run", action="store_true",
                       help="with --drain/--resume: log and print what would be done, never run scontrol update")
    check.add_argument("--node", metavar="NAME", help="Slurm NodeName of this node (default: the short host name)")
    check.add_argument("--resume-after", metavar="SECONDS",
                       help=f"healthy time before --resume acts: 600, 10m... "
                            f"(default {slurm.DEFAULT_RESUME_AFTER:g})")
    check.add_argument("--min-interval", metavar="SECONDS",
                       help=f"at most one drain or resume per this time, 0 for no limit "
                            f"(default {slurm.DEFAULT_MIN_INTERVAL:g})")
    check.add_argument("--state-file", metavar="PATH", default=slurm.DEFAULT_STATE_FILE,
                       help="where --drain/--resume remember the healthy time and the last action "
                            f"(default {slurm.DEFAULT_STATE_FILE})")
    text = "poll the configured backend like `run` (serving nothing) and write what it reports to a trace"
    record = sub.add_parser("record", help=text, description=f"{text} (format: docs/trace-format.md)")
    configuration.add_arguments(record)
    record.add_argument("--output", required=True, metavar="FILE",
                        help="trace file to write (replaced if it exists); - for stdout")
    record.add_argument("--duration", metavar="D",
                        help="stop after D: 90s, 10m, 1h30m or seconds (default: at Ctrl-C or SIGTERM)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    overrides: dict[str, Any] = {}
    if args.command == "demo":
        if args.list:
            return _list_scenarios()
        overrides = {"backend": "simulated", "sim_faults": True}
    duration = None
    drain = None
    try:
        config = configuration.load(args, overrides=overrides)
        if args.command == "record" and args.duration is not None:
            duration = configuration.parse_duration("--duration", args.duration)
        if args.command == "check":
            drain = _drain_settings(args)
        if config.web_config_file:
            webconfig.load(config.web_config_file)  # the whole file and the files it names: exit 78 at start
    except ConfigError as exc:
        logs.say(f"gpuwatch: configuration error: {exc}")
        return EX_CONFIG
    if args.command == "check":
        if drain is not None:
            logs.configure(config.log_level, config.log_format)
        return _check(config, drain)
    logs.configure(config.log_level, config.log_format)
    try:
        if args.command == "record":
            return _record(config, args.output, duration)
        agent = Agent(config)
    except ConfigError as exc:
        logs.say(f"gpuwatch: configuration error: {exc}")
        return EX_CONFIG
    except ReplayFormatError as exc:
        logs.say(f"gpuwatch: cannot replay: {exc}")
        return EX_CONFIG
    if args.command == "once":
        return _once(agent)
    rc = _run(agent, demo=args.command == "demo", reload=lambda: configuration.load(args, overrides=overrides))
    _exit_past_stuck_threads(rc)
    return rc


def _exit_past_stuck_threads(rc: int, grace: float = 2.0) -> None:
    """A poll thread stuck in a wedged NVML call (D state) cannot be joined: exit without waiting for it.

    (Python joins thread-pool workers at exit, daemon or not, so a stuck one would hang the stop.)
    """
    import time

    deadline = time.monotonic() + grace
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if stuck:
        logs.get_logger(component="main").warning("exit_with_busy_threads", threads=stuck,
                                                   hint="an NVML call did not return; check the GPUs with nvidia-smi")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _once(agent: Agent) -> int:
    agent.poller.poll_fast()  # opens the backend and also runs the first slow poll
    sys.stdout.buffer.write(agent.exposition.render()[0])
    sys.stdout.flush()
    up = agent.poller.backend_up
    agent.poller.stop()
    return 0 if up else 1


def _run(agent: Agent, demo: bool, reload: Callable[[], Config]) -> int:
    log = logs.get_logger(component="main")
    config = agent.config
    stop = threading.Event()
    reload_requested = threading.Event()
    notifier = Notifier()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: reload_requested.set())
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
        while not stop.wait(0.25):
            now = agent.clock.monotonic()
            if not ready and (agent.store.snapshot().tiers["fast"].last_completed_monotonic is not None
                              or now - started > 60):
                # listener bound and the first discovery done (or the backend known to be down)
                notifier.send(READY=1, STATUS=agent.status_line())
                ready, last_status = True, now
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
            if ready and now - last_status >= 5:
                notifier.send(STATUS=agent.status_line())
                last_status = now
    finally:
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


def _list_scenarios() -> int:
    from gpuwatch.backends.simulated import scenarios

    for name, scenario in sorted(scenarios().items()):
        fires = f" -> {scenario.rule} on GPU {scenario.gpu}" if scenario.rule and scenario.gpu is not None else (
            f" -> {scenario.rule}" if scenario.rule else "")
        print(f"{name:24} {scenario.profile:8} {scenario.gpu_count} GPUs  {scenario.description}{fires}")
    return 0


def _record(config: Config, output: str, duration: float | None) -> int:
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


def _drain_settings(args: argparse.Namespace) -> slurm.Settings | None:
    """`check --drain/--resume` and their options (docs/slurm.md); None without either. ConfigError if bad."""
    if not (args.drain or args.resume):
        return None
    return slurm.Settings(
        node=args.node or slurm.default_node_name(), drain=args.drain, resume=args.resume, dry_run=args.dry_run,
        resume_after=slurm.DEFAULT_RESUME_AFTER if args.resume_after is None
        else slurm.parse_seconds("--resume-after", args.resume_after),
        min_interval=slurm.DEFAULT_MIN_INTERVAL if args.min_interval is None
        else slurm.parse_seconds("--min-interval", args.min_interval),
        state_file=args.state_file)


def _check(config: Config, drain: slurm.Settings | None = None) -> int:
    """Exit 0 healthy (warnings are printed), 1 on a critical anomaly, 2 when the state is unknown.

    With ``drain`` (--drain/--resume) the node is then drained or resumed in Slurm (gpuwatch/slurm.py,
    docs/slurm.md); the exit code stays the check's verdict whatever happens there.
    """
    rc, document = _check_status(config)
    if drain is not None:
        for line in slurm.enforce(document, drain).lines:
            print(line)
    return rc


def _check_status(config: Config) -> tuple[int, dict[str, Any] | None]:
    """Print the check's lines; (exit code, the status document or None when it could not be read).

    Speaks what the daemon serves: with the same web config file it uses https (pinned to the
    daemon's own certificate, tls_server_config.cert_file), basic auth with --check.username and
    --check.password-file, and a client certificate with --check.client-cert-file (docs/security.md).
    """
    from gpuwatch.config import parse_listen_address
    from gpuwatch.exporter.http import STATUS_PATH

    host, port = parse_listen_address(config.listen_addresses[0])
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    web = webconfig.load(config.web_config_file) if config.web_config_file else None  # checked at start already
    scheme = "https" if web is not None and web.tls is not None else "http"
    url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}{STATUS_PATH}"
    try:
        password = webconfig.read_secret(config.check_password_file) if config.check_password_file else None
        status, body = webconfig.local_get(host, port, STATUS_PATH, web, username=config.check_username,
                                           password=password, client_cert=config.check_client_cert_file,
                                           client_key=config.check_client_key_file, timeout=5)
        if status == 401:
            raise webconfig.LocalRequestError(
                "401 Unauthorized: " + ("--check.username or --check.password-file is wrong" if config.check_username
                                        else "the daemon asks for basic auth: set --check.username and "
                                             "--check.password-file"))
        if status != 200:
            raise webconfig.LocalRequestError(f"HTTP {status}: {body[:200].decode(errors='replace').strip()}")
        document = json.loads(body)
    except (OSError, ValueError) as exc:
        print(f"gpuwatch: UNKNOWN: cannot read the daemon's status at {url}: {exc} "
              "(is gpuwatch running? `systemctl status gpuwatch`)")
        return 2, None
    v = verdict(document)
    if v.status == "unknown":
        print(f"gpuwatch: UNKNOWN: {v.detail}")
        return v.exit_code, document
    for a in v.critical + v.warnings:
        print(f"gpuwatch: {a['severity'].upper()}: {where(a)}: {a['summary']}")
    if v.status == "ok":
        print(f"gpuwatch: OK ({len(document['gpus'])} GPUs)")
    return v.exit_code, document


def _display_host(bound: str) -> str:
    host, _, port = bound.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        host = "localhost"
    return f"{host}:{port}"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
