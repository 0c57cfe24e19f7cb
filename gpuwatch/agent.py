"""The composition root: the one place that wires concrete parts together.

``make_backend`` picks the data source from the configuration; ``Agent`` is backend, store, rule
engine, poller, exposition and HTTP servers wired together, with what the daemon's loop needs
(liveness for the watchdog, a status line, reconfiguration at SIGHUP). The commands (gpuwatch/cli/)
drive an Agent; nothing else constructs these parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gpuwatch import logs, web
from gpuwatch.attribution import Attributor
from gpuwatch.backends.base import Backend
from gpuwatch.clock import Clock, SystemClock
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.exporter import build_exposition
from gpuwatch.groups import Selection
from gpuwatch.model import NodeInfo
from gpuwatch.poller import Poller
from gpuwatch.rules import all_rules
from gpuwatch.rules.engine import Engine
from gpuwatch.rules.settings import build_configs
from gpuwatch.store import Store
from gpuwatch.web import App, HttpServers


def select_groups(config: Config) -> Selection:
    """The reading groups the configuration selects, with their options: built once, given to every part."""
    return Selection.of(config.collectors, config.collector_options)


def make_backend(config: Config, clock: Clock, selection: Selection | None = None) -> Backend:
    selection = selection or select_groups(config)
    if config.backend == "simulated":
        from gpuwatch.backends.simulated import SimulatedBackend, demo_tour, scenarios

        if config.sim_scenario is not None:
            known = scenarios()
            if config.sim_scenario not in known:
                raise ConfigError(f"sim.scenario: unknown scenario {config.sim_scenario!r}; "
                                  f"known: {', '.join(sorted(known))} (gpuwatch demo --list)")
            return known[config.sim_scenario].backend(clock, selection)
        faults = None
        if config.sim_faults:
            if config.sim_gpus >= 3:
                faults = demo_tour(gpu_count=config.sim_gpus, profile=config.sim_profile)
            else:
                logs.get_logger(component="main").warning(
                    "demo_tour_disabled", reason="the fault tour needs at least 3 GPUs",
                    hint="use --sim.gpus 3 or more")
        from gpuwatch.backends.simulated.tour import parse_fault_spec

        extra = []
        for spec in config.sim_fault:
            try:
                extra.extend(parse_fault_spec(spec, config.sim_gpus))
            except ValueError as exc:
                raise ConfigError(f"sim.fault: {spec!r}: {exc}") from None
        try:
            return SimulatedBackend(clock, gpu_count=config.sim_gpus, profile=config.sim_profile,
                                    faults=[*(faults or ()), *extra], selection=selection)
        except ValueError as exc:  # a fault on a GPU the node does not have, or that the profile cannot show
            raise ConfigError(f"sim.fault: {exc}") from None
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

    return NvmlBackend(selection)


def make_host_reader(config: Config, backend: Backend, clock: Clock,
                     selection: Selection | None = None) -> Callable[..., Any] | None:
    """The host groups' reader: the simulator's own for the simulated backend, none for a replay
    (a trace has no host side), else gpuwatch/hostside/ over this machine's /proc and cgroups."""
    selection = selection or select_groups(config)
    if not selection.host or config.backend == "replay":
        return None
    simulated = getattr(backend, "read_host", None)
    if simulated is not None:
        return simulated
    from gpuwatch.hostside import HostReader

    return HostReader(selection, config.attribution_proc_root,
                      config.attribution_cgroup_root, config.attribution_mapping_dir, clock.monotonic)


def node_info(config: Config) -> NodeInfo:
    """The node's place and power budget; a simulated scenario brings its own budget."""
    budget = config.node_power_budget_watts
    if budget is None and config.backend == "simulated" and config.sim_scenario is not None:
        from gpuwatch.backends.simulated import scenarios

        scenario = scenarios().get(config.sim_scenario)
        budget = None if scenario is None else scenario.node_power_budget_watts
    return NodeInfo(config.node_rack, config.node_row, config.node_room, config.node_pdu, budget)


class Agent:
    """Backend, store, poller, collector and HTTP servers, wired together."""

    def __init__(self, config: Config, clock: Clock | None = None, backend: Backend | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.selection = select_groups(config)
        self.backend = backend or make_backend(config, self.clock, self.selection)
        self.store = Store(self.clock, self.backend.name, node_info(config))
        rules = all_rules()
        self.engine = Engine(rules, build_configs(rules, config.rules), config.staleness("fast"),
                             config.rules_window, config.rules_expected_gpus,
                             min_history_seconds=config.poll_slow_interval + config.staleness("fast"),
                             slow_staleness=config.staleness("slow"))
        attribute = None
        if self.selection.attributed:
            attribute = Attributor(config.attribution_proc_root).attribute
        self.host = make_host_reader(config, self.backend, self.clock, self.selection)
        self.poller = Poller(self.backend, self.store, self.clock, config.poll_interval, config.poll_slow_interval,
                             evaluate=self.evaluate_rules, attribute=attribute, selection=self.selection,
                             remember=self.remember_samples,
                             host=self.host)
        self.exposition = build_exposition(self.store.snapshot, self.clock, config.staleness, selection=self.selection)
        self.http: HttpServers | None = None

    def remember_samples(self) -> None:
        self.engine.remember_states(*self.store.gpu_states())

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
        web_config = web.load(self.config.web_config_file) if self.config.web_config_file else None
        self.http = HttpServers(self.config.listen_addresses, app, web_config=web_config,
                                max_requests=self.config.web_max_requests)
        self.http.start()
        return self.http.bound()

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        self.poller.stop()
        close = getattr(self.host, "close", None)
        if close is not None:
            close()
