"""HTTP endpoints: ``/`` landing page, the metrics path, ``/healthz``.

A small WSGI app served by the stdlib's threading WSGI server, one server per listen address.
Nothing here touches a backend: every answer is built from the store's latest snapshot.
"""

from __future__ import annotations

import gzip
import html
import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuwatch import __version__
from gpuwatch.config import parse_listen_address
from gpuwatch.exporter.collector import tier_fresh
from gpuwatch.model import NodeSnapshot
from gpuwatch.status import status_document

StartResponse = Callable[..., Any]
STATUS_PATH = "/api/v1/status"


def health(snap: NodeSnapshot, now: float, fast_bound: float) -> tuple[bool, str]:
    """(healthy, one-line reason): healthy while the backend is up and the last fast poll is fresh."""
    if not snap.backend_up:
        return False, f"backend {snap.backend} down: {snap.backend_reason or 'unknown reason'}"
    tier = snap.tiers["fast"]
    if tier.last_completed_monotonic is None:
        return False, "no fast poll completed yet"
    age = now - tier.last_completed_monotonic
    if not tier_fresh(tier, now, fast_bound):
        if age > fast_bound:
            return False, f"last fast poll completed {age:.1f} s ago (staleness bound {fast_bound:g} s)"
        return False, "last fast poll failed for at least one GPU"
    return True, f"ok: {snap.visible_gpus} GPUs, last fast poll {age:.1f} s ago"


LANDING = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpuwatch</title></head>
<body><h1>gpuwatch {version}</h1>
<p>NVIDIA GPU node monitor.</p>
<ul><li><a href="{path}">{path}</a> Prometheus metrics</li>
<li><a href="/healthz">/healthz</a> health of the collection</li>
<li><a href="/api/v1/status">/api/v1/status</a> current anomalies and per-GPU state (JSON)</li></ul>
</body></html>
"""


class App:
    """The WSGI application."""

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], NodeSnapshot],
                 monotonic: Callable[[], float], telemetry_path: str, staleness: Callable[[str], float]) -> None:
        self._registry = registry
        self._snapshot = snapshot
        self._monotonic = monotonic
        self._path = telemetry_path
        self._staleness = staleness
        self._fast_bound = staleness("fast")
        self._landing = LANDING.format(version=__version__, path=html.escape(telemetry_path)).encode()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", b"only GET and HEAD are allowed\n",
                          extra=[("Allow", "GET, HEAD")])
        if path == self._path:
            return self._metrics(environ, start_response, method)
        if path == "/healthz":
            ok, reason = health(self._snapshot(), self._monotonic(), self._fast_bound)
            return _reply(start_response, "200 OK" if ok else "503 Service Unavailable", reason.encode() + b"\n",
                          head=method == "HEAD")
        if path == STATUS_PATH:
            document = status_document(self._snapshot(), self._monotonic(), self._staleness)
            body = json.dumps(document, separators=(",", ":")).encode()
            return _reply(start_response, "200 OK", body, "application/json", head=method == "HEAD")
        if path == "/":
            return _reply(start_response, "200 OK", self._landing, "text/html; charset=utf-8", head=method == "HEAD")
        return _reply(start_response, "404 Not Found", f"not found; metrics are at {self._path}\n".encode(),
                      head=method == "HEAD")

    def _metrics(self, environ: dict[str, Any], start_response: StartResponse, method: str) -> Iterable[bytes]:
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        body = encoder(self._registry)
        extra = []
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "") and len(body) > 1024:
            body = gzip.compress(body, compresslevel=1)
            extra.append(("Content-Encoding", "gzip"))
        return _reply(start_response, "200 OK", body, content_type, extra=extra, head=method == "HEAD")


def _reply(start_response: StartResponse, status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
           extra: list[tuple[str, str]] | None = None, head: bool = False) -> list[bytes]:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))] + (extra or [])
    start_response(status, headers)
    return [] if head else [body]


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # scrapes are not worth a log line each


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # ":PORT" means every interface, IPv4 too (dual stack), as node_exporter does.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _make_server(address: str, app: App) -> WSGIServer:
    host, port = parse_listen_address(address)
    if host == "":
        try:
            return _make(_Server6, "::", port, app)
        except OSError:
            return _make(_Server, "0.0.0.0", port, app)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if family == socket.AF_INET6:
        class _V6Only(_Server):
            address_family = socket.AF_INET6
        return _make(_V6Only, host, port, app)
    return _make(_Server, host, port, app)


def _make(cls: type[WSGIServer], host: str, port: int, app: App) -> WSGIServer:
    server = cls((host, port), _Handler)
    server.set_app(app)
    return server


class HttpServers:
    """One listening server per address, each served by a daemon thread."""

    def __init__(self, addresses: Iterable[str], app: App) -> None:
        self.servers: list[WSGIServer] = []
        try:
            for address in addresses:
                self.servers.append(_make_server(address, app))
        except OSError:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.5},
                             name=f"gpuwatch-http-{i}", daemon=True)
            for i, s in enumerate(self.servers)
        ]

    def bound(self) -> list[str]:
        result = []
        for server in self.servers:
            host, port = server.server_address[:2]
            result.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        return result

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        threads = getattr(self, "_threads", [None] * len(self.servers))
        for server, thread in zip(self.servers, threads):
            try:
                if thread is not None and thread.is_alive():
                    server.shutdown()
            finally:
                server.server_close()
