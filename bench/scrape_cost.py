"""What one scrape of cached bytes costs the gpuwatch daemon, on a new connection each time or on one kept
open (as Prometheus scrapes), over plain HTTP or TLS:

    .venv/bin/python bench/scrape_cost.py                      # 8 x L40S, 100 scrapes 0.5 s apart, both ways
    .venv/bin/python bench/scrape_cost.py --tls --scrapes 60   # the same over TLS (a P-256 certificate)

The daemon polls every 30 s, so the scrapes find the body rendered and gzipped: what is measured is the
HTTP path (accept, handshake, request parsing, the send) and the wake-ups, each scrape on a vCPU that idled
half a second. The figure is the process's utime + stime from /proc/PID/stat over the scrapes minus the
fake library's own CPU, divided by the scrapes (in nanoseconds: bench.Exporter.cpu_seconds). Runs gpuwatch from
bench.py's virtual environment (``bench/bench.py --only gpuwatch --gpus 8`` makes it; install this tree
into it first as bench.py does). Certificates for --tls are made with the openssl CLI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # it puts tests/ on the path: its fakes


def certificate(directory: Path) -> tuple[Path, Path, Path]:
    """(certificate, key, web config) for 127.0.0.1, self-signed."""
    cert, key, web = directory / "cert.pem", directory / "key.pem", directory / "web.yml"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    return cert, key, web


def measure(python: Path, workdir: Path, gpus: int, scrapes: int, gap: float, kept: bool, tls: bool) -> float:
    """ms of the daemon's CPU per scrape."""
    workdir.mkdir(parents=True, exist_ok=True)
    fx = bench.fakenvml.prepare(workdir, bench.NODES["pcie"][1](gpus))
    port = bench.free_port()
    argv = [str(python), "-m", "gpuwatch", "run", "--web.listen-address", f"127.0.0.1:{port}", "--poll.interval",
            "30", "--log.level", "warning", "--log.format", "json"]
    context = None
    if tls:
        cert, _, web = certificate(workdir)
        argv += ["--web.config.file", str(web)]
        context = ssl.create_default_context(cafile=str(cert))

    def connect() -> http.client.HTTPConnection:
        if context is not None:
            return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
        return http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    class Daemon(bench.Exporter):
        def _answers(self) -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpuwatch exited with {self.proc.returncode}: see {self.log.name}")
            connection = connect()
            try:
                connection.request("GET", "/healthz")
                return connection.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                return False
            finally:
                connection.close()

    daemon = Daemon("gpuwatch", argv, port, fx, workdir)
    kept_connection = connect()

    def scrape() -> None:
        connection = kept_connection if kept else connect()
        connection.request("GET", "/metrics", headers=bench.PROMETHEUS_HEADERS)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}")
        if not kept:
            connection.close()

    try:
        bench.wait_for(lambda: daemon.counters()[0] >= gpus, 60, "the first poll")
        for _ in range(10):
            scrape()
        cpu0, library0 = daemon.cpu_seconds(), daemon.counters()[1]
        for _ in range(scrapes):
            time.sleep(gap)  # the cadence being measured, not a synchronisation
            scrape()
        cpu1, library1 = daemon.cpu_seconds(), daemon.counters()[1]
    finally:
        kept_connection.close()
        daemon.stop()
    return ((cpu1 - cpu0) - (library1 - library0)) / scrapes * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between scrapes")
    ap.add_argument("--tls", action="store_true")
    args = ap.parse_args(argv)
    python = bench.OUT / "gpuwatch-venv" / "bin" / "python"
    if not python.exists():
        ap.error(f"{python} is missing: run bench/bench.py --only gpuwatch --gpus 8 first")
    result = {"gpus": args.gpus, "scrapes": args.scrapes, "gap_s": args.gap, "tls": args.tls}
    with tempfile.TemporaryDirectory() as directory:
        for kept in (False, True):
            key = "kept_connection_ms" if kept else "new_connection_ms"
            result[key] = round(measure(python, Path(directory) / key, args.gpus, args.scrapes, args.gap, kept,
                                        args.tls), 3)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
