"""Real Prometheus, Alertmanager, VictoriaMetrics and vmalert on loopback for tests, and a webhook receiver to
catch notifications."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from daemon import stop_process, wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is missing: scripts/test installs it (Debian packages prometheus, "
                             "prometheus-alertmanager, victoria-metrics)")
    return path


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


class Process:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._file = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        stop_process(self.proc)
        self._file.close()


class Prometheus(Process):
    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path] = (),
                 alertmanager: str | None = None, interval: str = "1s") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": "gpuwatch", "static_configs": [{"targets": targets}]}],
            "rule_files": [str(p) for p in rule_files],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        (workdir / "tsdb").mkdir(exist_ok=True)
        super().__init__([_binary("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{self.port}"], workdir / "prometheus.log")
        wait_for(lambda: _get(self.base + "/-/ready")[0] == 200, 30, "Prometheus to be ready")

    def query(self, expr: str) -> list[dict]:
        status, body = _get(self.base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert status == 200, body
        document = json.loads(body)
        assert document["status"] == "success", document
        return document["data"]["result"]


class Alertmanager(Process):
    def __init__(self, workdir: Path, webhook_url: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = {
            "route": {"receiver": "test", "group_by": ["alertname", "instance", "gpu"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        }
        path = workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        (workdir / "am").mkdir(exist_ok=True)
        super().__init__([_binary("prometheus-alertmanager"), f"--config.file={path}",
                          f"--storage.path={workdir / 'am'}", f"--web.listen-address={self.address}",
                          "--cluster.listen-address="], workdir / "alertmanager.log")
        wait_for(lambda: _get(f"http://{self.address}/-/ready")[0] == 200, 30, "Alertmanager to be ready")


def default_args(path: Path) -> list[str]:
    """The ARGS of an /etc/default file (deploy/victoriametrics/*.default) as argv words."""
    text = path.read_text().replace("\\\n", "")  # a backslash-newline continues the line (shell, systemd)
    match = re.search(r'^ARGS="([^"]*)"', text, re.MULTILINE)
    assert match, f"no ARGS=\"...\" in {path}"
    return shlex.split(match.group(1))


def override(args: list[str], **flags: str | list[str]) -> list[str]:
    """``args`` with each of ``flags`` (its name with _ for . : storageDataPath, datasource_url) set to the
    value given (several values: the flag repeated), in place of the shipped value(s)."""
    names = {name.replace("_", "."): value for name, value in flags.items()}
    kept = [a for a in args if a.split("=", 1)[0].lstrip("-") not in names]
    for name, value in names.items():
        kept += [f"-{name}={v}" for v in ([value] if isinstance(value, str) else value)]
    return kept


class VictoriaMetrics(Process):
    """VictoriaMetrics single-node with the shipped flags (deploy/victoriametrics/victoria-metrics.default),
    its data directory and address on loopback here, and ``flags`` in place of the shipped ones."""

    def __init__(self, workdir: Path, shipped: Path, **flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = override(default_args(shipped), storageDataPath=str(workdir / "vm"),
                        httpListenAddr=f"127.0.0.1:{self.port}", **flags)
        super().__init__([_binary("victoria-metrics"), *args], workdir / "victoria-metrics.log")
        wait_for(lambda: _get(self.base + "/-/ready")[0] == 200, 30, "VictoriaMetrics to be ready")


class VmAlert(Process):
    """vmalert with the shipped flags (deploy/victoriametrics/vmalert.default) over ``rules``, reading and
    writing ``store``, sending to ``alertmanager`` (host:port), and ``flags`` in place of the shipped ones."""

    def __init__(self, workdir: Path, shipped: Path, rules: list[Path], store: str, alertmanager: str,
                 **flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = override(default_args(shipped), rule=[str(p) for p in rules], datasource_url=store,
                        remoteWrite_url=store, remoteRead_url=store, notifier_url=f"http://{alertmanager}",
                        httpListenAddr=f"127.0.0.1:{self.port}", **flags)
        super().__init__([_binary("vmalert"), *args], workdir / "vmalert.log")
        wait_for(lambda: _get(self.base + "/-/ready")[0] == 200, 30, "vmalert to be ready")


class Webhook:
    """Collects the JSON bodies Alertmanager posts."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        received = self.notifications

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, name: str, status: str) -> list[dict]:
        return [a for n in list(self.notifications) for a in n["alerts"]
                if a["labels"].get("alertname") == name and a["status"] == status]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
