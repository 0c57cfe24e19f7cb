"""One typed Config, read from a YAML file, then ``GPUWATCH_*`` environment variables, then flags.

Every option has three spellings, derived from one table:

    flag  --poll.slow-interval 30
    env   GPUWATCH_POLL_SLOW_INTERVAL=30
    YAML  poll: {slow_interval: 30}

Flags win over the environment, the environment over the file. Invalid values raise ConfigError
(the CLI turns it into a one-line message and exit status 78).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatch import groups
from gpuwatch.errors import ConfigError
from gpuwatch.logs import FORMATS, LEVELS
from gpuwatch.typed import DEFAULT_PORT, NUMBER, WHOLE, number, parse_listen_address, shown
from gpuwatch.typed import parse_duration as parse_duration  # the commands read durations here
from gpuwatch.yamlfile import read_yaml

# "<group>.<option>" -> default, for every reading group's options (--collector.<group>.<option>)
COLLECTOR_DEFAULTS: dict[str, Any] = {f"{g.name}.{name}": default for g in groups.GROUPS
                                      for name, (default, _) in g.options.items()}
BACKENDS = ("nvml", "simulated", "replay")
SIM_PROFILES = ("rtx6000", "h200", "t4", "h100-mig", "b200", "a100", "rtx4090", "gh200", "gb200")


@dataclass(frozen=True)
class Config:
    listen_addresses: tuple[str, ...] = (f":{DEFAULT_PORT}",)
    telemetry_path: str = "/metrics"
    poll_interval: float = 2.0
    poll_slow_interval: float = 30.0
    poll_staleness: float | None = None  # None: three fast intervals (slow tier: three slow intervals)
    backend: str = "nvml"
    log_level: str = "info"
    log_format: str | None = None  # None: json when not a TTY, console on a TTY
    sim_gpus: int = 8
    sim_profile: str = "rtx6000"
    sim_faults: bool = False  # run the scripted fault tour (always on for `gpuwatch demo`)
    sim_fault: tuple[str, ...] = ()  # --sim.fault KIND[@GPU][:param=value,...], from start, forever
    sim_scenario: str | None = None  # a named scenario instead of the tour (`gpuwatch demo --list`)
    replay_file: str | None = None  # trace written by `gpuwatch record` (backend replay)
    replay_speed: float = 1.0  # trace seconds per real second
    replay_loop: bool = False  # start over at the end of the trace
    # reading groups switched on (--collector.<group> / --no-collector.<group>), and their options
    # "<group>.<option>" -> value (--collector.<group>.<option>); every option is in the mapping
    collectors: frozenset[str] = groups.DEFAULT_ENABLED
    collector_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(COLLECTOR_DEFAULTS))
    attribution_proc_root: str = "/proc"
    attribution_mapping_dir: str | None = None  # dcgm-exporter style HPC job mapping directory
    attribution_cgroup_root: str = "/sys/fs/cgroup"  # the jobs' cgroups (slurm and jobs groups)
    node_rack: str = ""  # where the node stands (gpuwatch_node_info), for sites without target labels
    node_row: str = ""
    node_room: str = ""
    node_pdu: str = ""
    node_power_budget_watts: float | None = None  # what the supplies deliver to the GPUs (node_power_budget)
    rules_expected_gpus: int = 0  # 0: the most GPUs seen since start
    rules_window: float = 300.0  # seconds of history the rules may look back
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # YAML `rules:` per-rule settings
    web_config_file: str | None = None  # exporter-toolkit web config: TLS, mTLS, basic auth (docs/security.md)
    web_max_requests: int = 40  # requests worked on at once, more get 503; 0: no limit
    check_username: str | None = None  # `gpuwatch check` against a daemon with basic_auth_users
    check_password_file: str | None = None
    check_client_cert_file: str | None = None  # `gpuwatch check` against a daemon that requires client certs
    check_client_key_file: str | None = None

    def staleness(self, tier: str) -> float:
        """Readings of ``tier`` older than this are not exported."""
        base = self.poll_interval if tier == "fast" else self.poll_slow_interval
        if self.poll_staleness is None:
            return 3 * base
        return max(self.poll_staleness, base) if tier == "slow" else self.poll_staleness


# -- parsers for single values ----------------------------------------------------------------

def _float(name: str, unit: str = "seconds") -> Callable[[Any], float]:
    """A positive finite number (of ``unit``)."""
    what = f"number of {unit}" if unit else "number"

    def parse(value: Any) -> float:
        try:
            result = float(number(value, NUMBER))
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond any float
            raise ConfigError(f"{name}: expected a {what}, got {shown(value)}") from None
        if not 0 < result < float("inf"):
            raise ConfigError(f"{name}: must be a positive {what}, got {shown(value)}")
        return result

    return parse


def _int(name: str, low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            result = int(number(value, WHOLE))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{name}: expected a whole number, got {shown(value)}") from None
        if not low <= result <= high:
            raise ConfigError(f"{name}: must be between {low} and {high}, got {shown(result)}")
        return result

    return parse


def _choice(name: str, choices: Sequence[str]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ConfigError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")
        return text

    return parse


def _bool(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")

    return parse


def _existing(name: str, directory: bool = False, hint: str = "") -> Callable[[Any], str]:
    """A path that must exist now: a file, or a directory."""
    check, kind = (os.path.isdir, "directory") if directory else (os.path.isfile, "file")

    def parse(value: Any) -> str:
        text = str(value)
        if not check(text):
            raise ConfigError(f"{name}: {text!r} is not a {kind}{hint}")
        return text

    return parse


def _readable(name: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value)
        try:
            with open(text, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {text!r}: {exc.strerror or exc}") from None
        except ValueError:  # a NUL in the name
            raise ConfigError(f"{name}: {shown(text)} is not a file name (it has a NUL in it)") from None
        return text

    return parse


def _addresses(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError("web.listen-address: expected one or more HOST:PORT addresses")
    result = []
    for item in items:
        for part in str(item).split(","):
            if part.strip():
                parse_listen_address(part)
                result.append(part.strip())
    if not result:
        raise ConfigError("web.listen-address: expected one or more HOST:PORT addresses")
    return tuple(result)


def _text(key: str, label: bool = False) -> Callable[[Any], str]:
    """``label``: the text is shown as a label value, so it must be UTF-8 (a path or a name passed to a command
    may be any bytes the system takes)."""
    def parse(value: Any) -> str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a text value, got {value!r}")
        text = str(value).strip()
        if "\x00" in text or "\n" in text:
            raise ConfigError(f"{key}: {value!r} has a line break or NUL in it")
        return _utf8(key, text) if label else text
    return parse


def _utf8(key: str, text: str) -> str:
    """``text``, when it is UTF-8: bytes that are not (os.environ's and argv's lone surrogates, YAML's "\\udcff")
    made every /metrics render of a label or the landing page raise UnicodeEncodeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key}: {shown(text)} is not UTF-8 text") from None
    return text


def _sim_faults(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError("sim.fault: expected KIND[@GPU][:param=value,...], e.g. load:utilization=0.9")
    for item in items:  # the kinds and their parameters are the simulator's to check (make_backend)
        if not _SIM_FAULT.fullmatch(item.strip()):
            raise ConfigError(f"sim.fault: {item!r} is not KIND[@GPU][:param=value,...], e.g. inlet_warm@3:celsius=10")
    return tuple(item.strip() for item in items)


_SIM_FAULT = re.compile(r"[a-z0-9_]+(?:@\d+)?(?::[a-z_]+=[^,=:]+(?:,[a-z_]+=[^,=:]+)*)?", re.ASCII)


def _path(value: Any) -> str:
    text = str(value)
    if not text.startswith("/") or text in ("/", "/healthz", "/api/v1/status") or any(c.isspace() for c in text):
        raise ConfigError(
            f"web.telemetry-path: {value!r} must start with '/' and not be '/' or '/healthz' (e.g. /metrics)"
        )
    return _utf8("web.telemetry-path", text)


@dataclass(frozen=True)
class Option:
    key: str  # dotted flag name, e.g. "poll.slow-interval"
    field: str  # Config field
    parse: Callable[[Any], Any]
    help: str
    repeatable: bool = False
    switch: bool = False  # a boolean that may be given bare: --replay.loop means --replay.loop true

    @property
    def flag(self) -> str:
        return "--" + self.key

    @property
    def env(self) -> str:
        return "GPUWATCH_" + self.key.replace(".", "_").replace("-", "_").upper()

    @property
    def yaml_path(self) -> tuple[str, ...]:
        return tuple(part.replace("-", "_") for part in self.key.split("."))


OPTIONS: tuple[Option, ...] = (
    Option("web.listen-address", "listen_addresses", _addresses,
           f"address to serve on, HOST:PORT, repeatable (default :{DEFAULT_PORT})", repeatable=True),
    Option("web.telemetry-path", "telemetry_path", _path, "path of the metrics endpoint (default /metrics)"),
    Option("web.config.file", "web_config_file", _readable("web.config.file"),
           "TLS and basic auth: web config file in node_exporter's format (docs/security.md; default: plain HTTP)"),
    Option("web.max-requests", "web_max_requests", _int("web.max-requests", 0, 10000),
           "requests served at once; more get 503 (default 40; 0: no limit)"),
    Option("poll.interval", "poll_interval", _float("poll.interval"),
           "seconds between fast polls: temperatures, fans, power, clocks (default 2)"),
    Option("poll.slow-interval", "poll_slow_interval", _float("poll.slow-interval"),
           "seconds between slow polls: ECC, row remapping, PCIe, limits (default 30)"),
    Option("poll.staleness", "poll_staleness", _float("poll.staleness"),
           "readings older than this many seconds are not exported (default 3 fast intervals)"),
    Option("backend", "backend", _choice("backend", BACKENDS), "data source: nvml, simulated or replay (default nvml)"),
    Option("log.level", "log_level", _choice("log.level", LEVELS), "debug, info, warning or error (default info)"),
    Option("log.format", "log_format", _choice("log.format", FORMATS),
           "json or console (default: json unless stderr is a terminal)"),
    Option("sim.gpus", "sim_gpus", _int("sim.gpus", 1, 64), "simulated backend: number of GPUs (default 8)"),
    Option("sim.profile", "sim_profile", _choice("sim.profile", SIM_PROFILES),
           "simulated backend: rtx6000 (fans), h200 or t4 (fanless), h100-mig, gh200 or gb200 (Grace-coupled) "
           "(default rtx6000)"),
    Option("sim.faults", "sim_faults", _bool("sim.faults"), "simulated backend: run the scripted fault tour"),
    Option("sim.fault", "sim_fault", _sim_faults,
           "simulated backend: a fault from the start, KIND[@GPU][:param=value,...], e.g. load:utilization=0.9 "
           "(every GPU), inlet_warm@3:celsius=10; repeatable (kinds: gpuwatch demo --list)", repeatable=True),
    Option("sim.scenario", "sim_scenario", str,
           "simulated backend: play a named scenario, one per anomaly rule (list them: gpuwatch demo --list)"),
    Option("replay.file", "replay_file",
           _existing("replay.file", hint=" (write one with `gpuwatch record --output FILE`)"),
           "replay backend: trace file to play, written by `gpuwatch record` (docs/trace-format.md)"),
    Option("replay.speed", "replay_speed", _float("replay.speed", unit=""),
           "replay backend: trace seconds per real second, e.g. 10 (default 1)"),
    Option("replay.loop", "replay_loop", _bool("replay.loop"),
           "replay backend: start over at the end of the trace instead of holding its last state", switch=True),
    Option("attribution.proc-root", "attribution_proc_root", _existing("attribution.proc-root", directory=True),
           "where to read PIDs' cgroups and owners (default /proc)"),
    Option("attribution.cgroup-root", "attribution_cgroup_root", str,
           "where the jobs' cgroups are: Slurm jobs and pods for the slurm and jobs groups (default /sys/fs/cgroup)"),
    Option("attribution.hpc-job-mapping-dir", "attribution_mapping_dir",
           _existing("attribution.hpc-job-mapping-dir", directory=True),
           "dcgm-exporter style directory of job ids per GPU index, written by a Slurm prolog (default: none)"),
    Option("node.rack", "node_rack", _text("node.rack", label=True),
           "the node's rack, for gpuwatch_node_info (default: none)"),
    Option("node.row", "node_row", _text("node.row", label=True), "the node's row of racks (default: none)"),
    Option("node.room", "node_room", _text("node.room", label=True), "the node's machine room or hall (default: none)"),
    Option("node.pdu", "node_pdu", _text("node.pdu", label=True),
           "the PDU (circuit) that feeds the node (default: none)"),
    Option("node.power-budget-watts", "node_power_budget_watts", _float("node.power-budget-watts", "watts"),
           "what the node's power supplies can deliver to its GPUs after redundancy, for node_power_budget "
           "(default: none)"),
    Option("rules.expected-gpus", "rules_expected_gpus", _int("rules.expected-gpus", 0, 4096),
           "GPUs this node should have, for gpu_missing (default 0: the most seen since start)"),
    Option("rules.window", "rules_window", _float("rules.window"),
           "seconds of history the anomaly rules look back (default 300)"),
    Option("check.username", "check_username", str,
           "gpuwatch check: basic auth user, when the web config file has basic_auth_users"),
    Option("check.password-file", "check_password_file", _readable("check.password-file"),
           "gpuwatch check: file whose first line is that user's password"),
    Option("check.client-cert-file", "check_client_cert_file", _readable("check.client-cert-file"),
           "gpuwatch check: client certificate (PEM) for a daemon that requires one (mTLS)"),
    Option("check.client-key-file", "check_client_key_file", _readable("check.client-key-file"),
           "gpuwatch check: key of that certificate (default: read from the certificate file)"),
)


def _collector_options() -> tuple[Option, ...]:
    """--collector.<group> for every reading group, and --collector.<group>.<option> for its options."""
    options = []
    for g in groups.GROUPS:
        options.append(Option(f"collector.{g.name}", f"collector:{g.name}", _bool(f"collector.{g.name}"),
                              f"reading group {g.name}: {g.help} (default {'on' if g.default else 'off'}; "
                              f"--no-collector.{g.name} turns it off)", switch=True))
        for name, (default, text) in g.options.items():
            key = f"collector.{g.name}.{name}"
            switch = isinstance(default, bool)
            parse = _bool(key) if switch else _text(key) if isinstance(default, str) else _int(key, 1, 1_000_000)
            options.append(Option(key, f"collector:{g.name}.{name}", parse, f"{text} (default {default})",
                                  switch=switch))
    return tuple(options)


COLLECTOR_OPTIONS: tuple[Option, ...] = _collector_options()
ALL_OPTIONS: tuple[Option, ...] = OPTIONS + COLLECTOR_OPTIONS
_BY_FIELD = {o.field: o for o in ALL_OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file (env GPUWATCH_CONFIG)")
    for option in OPTIONS:
        _add(parser, option)
    collectors = parser.add_argument_group(
        "reading groups",
        "switch a group off with --no-collector.<group> (its NVML calls and metrics go); docs/groups.md")
    for option in COLLECTOR_OPTIONS:
        _add(collectors, option)
        if option.key.count(".") == 1:  # the group itself
            collectors.add_argument("--no-" + option.key, dest=option.field, action="store_const", const="false",
                                    help=argparse.SUPPRESS)


def _add(parser: Any, option: Option) -> None:
    bare: dict[str, Any] = {"nargs": "?", "const": "true", "metavar": "true|false"} if option.switch else {}
    if not option.switch and option.field.startswith("collector:"):
        bare["metavar"] = "VALUE"
    parser.add_argument(
        option.flag,
        dest=option.field,
        default=None,
        action="append" if option.repeatable else "store",
        help=f"{option.help} [env {option.env}]",
        **bare,
    )


def _load_yaml(path: str) -> dict[str, Any]:
    data = read_yaml(path, "config file")  # ConfigError for every way the file can be unreadable
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys, e.g. 'poll: {{interval: 2}}'")
    return data


def _flatten_yaml(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Map nested YAML onto Config fields; unknown keys are an error (typos must not pass silently)."""
    by_path = {o.yaml_path: o for o in ALL_OPTIONS}
    prefixes = {p[:i] for p in by_path for i in range(1, len(p))}
    for p in list(by_path):  # "collector: {processes: {enabled: true, per_pid: true}}"
        if p in prefixes:
            by_path[p + ("enabled",)] = by_path[p]
    result: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], trail: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = trail + (str(key),)
            if here in by_path and not (here in prefixes and isinstance(value, dict)):
                result[by_path[here].field] = value
            elif trail == ("rules",):
                # per-rule settings; the rule engine validates them (ids, thresholds) at start
                result.setdefault("rules", {})[str(key)] = value
            elif here in prefixes and isinstance(value, dict):
                walk(value, here)
            else:
                known = sorted(".".join(p) for p in by_path)
                raise ConfigError(f"config file {path}: unknown key {'.'.join(here)!r}; known keys: {', '.join(known)}")

    walk(data, ())
    return result


def load(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the Config: defaults < YAML file < environment < flags < overrides (from the command)."""
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    config_file = getattr(args, "config", None) or environ.get("GPUWATCH_CONFIG")
    if config_file:
        raw.update(_flatten_yaml(_load_yaml(config_file), config_file))
    for option in ALL_OPTIONS:
        if option.env in environ and environ[option.env] != "":
            raw[option.field] = environ[option.env]
    if args is not None:
        for option in ALL_OPTIONS:
            value = getattr(args, option.field, None)
            if value is not None:
                raw[option.field] = value
    raw.update(overrides or {})
    values: dict[str, Any] = {}
    enabled = set(groups.DEFAULT_ENABLED)
    options = dict(COLLECTOR_DEFAULTS)
    for name, value in raw.items():
        if name == "rules":
            values[name] = value
            continue
        option = _BY_FIELD[name]
        parsed = None if value is None else option.parse(value)
        if name.startswith("collector:"):
            key = name[len("collector:"):]
            if "." in key:
                options[key] = parsed
            elif parsed is not None:
                (enabled.add if parsed else enabled.discard)(key)
            continue
        values[name] = parsed
    config = Config(**values, collectors=frozenset(enabled), collector_options=options)
    if config.poll_slow_interval < config.poll_interval:
        raise ConfigError(
            f"poll.slow-interval ({config.poll_slow_interval:g} s) must not be shorter than "
            f"poll.interval ({config.poll_interval:g} s)"
        )
    if config.backend == "replay" and config.replay_file is None:
        raise ConfigError("backend replay needs --replay.file FILE, a trace written by `gpuwatch record`")
    if (config.check_username is None) != (config.check_password_file is None):
        raise ConfigError("check.username and check.password-file go together")
    if config.check_client_key_file is not None and config.check_client_cert_file is None:
        raise ConfigError("check.client-key-file needs check.client-cert-file")
    if config.poll_staleness is not None and config.poll_staleness < config.poll_interval:
        raise ConfigError(
            f"poll.staleness ({config.poll_staleness:g} s) must be at least poll.interval ({config.poll_interval:g} s)"
        )
    return config


def replace(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)
