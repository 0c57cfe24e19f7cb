"""`gpuwatch check`: ask the local daemon for its verdict; with --drain/--resume act on it in Slurm."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gpuwatch import drain, web
from gpuwatch.config import Config
from gpuwatch.status import verdict, where


def drain_settings(args: argparse.Namespace) -> drain.Settings | None:
    """`check --drain/--resume` and their options (docs/slurm.md); None without either. ConfigError if bad."""
    if not (args.drain or args.resume):
        return None
    return drain.Settings(
        node=args.node or drain.default_node_name(), drain=args.drain, resume=args.resume, dry_run=args.dry_run,
        resume_after=drain.DEFAULT_RESUME_AFTER if args.resume_after is None
        else drain.parse_seconds("--resume-after", args.resume_after),
        min_interval=drain.DEFAULT_MIN_INTERVAL if args.min_interval is None
        else drain.parse_seconds("--min-interval", args.min_interval),
        state_file=args.state_file)


def check_command(config: Config, slurm: drain.Settings | None = None) -> int:
    """Exit 0 healthy (warnings are printed), 1 on a critical anomaly, 2 when the state is unknown.

    With ``slurm`` (--drain/--resume) the node is then drained or resumed in Slurm (gpuwatch/drain.py,
    docs/slurm.md); the exit code stays the check's verdict whatever happens there.
    """
    rc, document = _check_status(config)
    if slurm is not None:
        for line in drain.enforce(document, slurm).lines:
            print(line)
    return rc


def _check_status(config: Config) -> tuple[int, dict[str, Any] | None]:
    """Print the check's lines; (exit code, the status document or None when it could not be read).

    Speaks what the daemon serves: with the same web config file it uses https (pinned to the
    daemon's own certificate, tls_server_config.cert_file), basic auth with --check.username and
    --check.password-file, and a client certificate with --check.client-cert-file (docs/security.md).
    """
    from gpuwatch.config import parse_listen_address
    from gpuwatch.web import STATUS_PATH

    host, port = parse_listen_address(config.listen_addresses[0])
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    web_config = web.load(config.web_config_file) if config.web_config_file else None  # checked at start already
    scheme = "https" if web_config is not None and web_config.tls is not None else "http"
    url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}{STATUS_PATH}"
    try:
        password = web.read_secret(config.check_password_file) if config.check_password_file else None
        status, body = web.local_get(host, port, STATUS_PATH, web_config, username=config.check_username,
                                           password=password, client_cert=config.check_client_cert_file,
                                           client_key=config.check_client_key_file, timeout=5)
        if status == 401:
            raise web.LocalRequestError(
                "401 Unauthorized: " + ("--check.username or --check.password-file is wrong" if config.check_username
                                        else "the daemon asks for basic auth: set --check.username and "
                                             "--check.password-file"))
        if status != 200:
            raise web.LocalRequestError(f"HTTP {status}: {body[:200].decode(errors='replace').strip()}")
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
