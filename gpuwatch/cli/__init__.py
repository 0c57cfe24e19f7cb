"""The command line: parsing and the commands, over the Agent (gpuwatch/agent.py).

    gpuwatch run     the daemon (NVML backend by default)
    gpuwatch demo    the daemon on a simulated 8-GPU node with a scripted tour of faults
    gpuwatch once    one poll, the exposition on stdout, then exit
    gpuwatch check   ask the running daemon for anomalies (Slurm HealthCheckProgram, NHC)
    gpuwatch record  poll the configured backend like `run` and write what it reports to a trace file
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gpuwatch import __version__, drain, logs, web
from gpuwatch import config as configuration
from gpuwatch.agent import Agent
from gpuwatch.cli.check import check_command, drain_settings
from gpuwatch.cli.record import record_command
from gpuwatch.cli.run import exit_past_stuck_threads, list_scenarios, once_command, run_command
from gpuwatch.errors import ConfigError, ReplayFormatError

EX_CONFIG = 78


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
                            f"(default {drain.DEFAULT_RESUME_AFTER:g})")
    check.add_argument("--min-interval", metavar="SECONDS",
                       help=f"at most one drain or resume per this time, 0 for no limit "
                            f"(default {drain.DEFAULT_MIN_INTERVAL:g})")
    check.add_argument("--state-file", metavar="PATH", default=drain.DEFAULT_STATE_FILE,
                       help="where --drain/--resume remember the healthy time and the last action "
                            f"(default {drain.DEFAULT_STATE_FILE})")
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
            return list_scenarios()
        overrides = {"backend": "simulated", "sim_faults": True}
    duration = None
    slurm = None
    try:
        config = configuration.load(args, overrides=overrides)
        if args.command == "record" and args.duration is not None:
            duration = configuration.parse_duration("--duration", args.duration)
        if args.command == "check":
            slurm = drain_settings(args)
        if config.web_config_file:
            web.load(config.web_config_file)  # the whole file and the files it names: exit 78 at start
    except ConfigError as exc:
        logs.say(f"gpuwatch: configuration error: {exc}")
        return EX_CONFIG
    if args.command == "check":
        if slurm is not None:
            logs.configure(config.log_level, config.log_format)
        return check_command(config, slurm)
    logs.configure(config.log_level, config.log_format)
    try:
        if args.command == "record":
            return record_command(config, args.output, duration)
        agent = Agent(config)
    except ConfigError as exc:
        logs.say(f"gpuwatch: configuration error: {exc}")
        return EX_CONFIG
    except ReplayFormatError as exc:
        logs.say(f"gpuwatch: cannot replay: {exc}")
        return EX_CONFIG
    if args.command == "once":
        return once_command(agent)
    rc = run_command(agent, demo=args.command == "demo", reload=lambda: configuration.load(args, overrides=overrides))
    exit_past_stuck_threads(rc)
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
