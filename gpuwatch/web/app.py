"""The WSGI application: ``/`` landing page, the metrics path, ``/healthz``, ``/api/v1/status``.

Nothing here touches a backend: every answer is built from the store's latest snapshot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from gpuwatch import __version__
from gpuwatch.exporter import Exposition
from gpuwatch.model import NodeSnapshot
from gpuwatch.status import status_document

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
STATUS_PATH = "/api/v1/status"


LANDING = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpuwatch</title></head>
<body><h1>gpuwatch {version}</h1>
<p>NVIDIA GPU node monitor.</p>
<ul><li><a href="{path}">{path}</a> Prometheus metrics</li>
<li><a href="/healthz">/healthz</a> health of the collection</li>
<li><a href="/api/v1/status">/api/v1/status</a> current anomalies and per-GPU state (JSON)</li></ul>
</body></html>
"""


def escape(text: str) -> str:
    """html.escape(text): the package ``html`` imports its table of 2,231 named entities (0.6 MB) for unescape."""
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("'", "&#x27;"))


class App:
    """The WSGI application."""

    def __init__(self, exposition: Exposition, snapshot: Callable[[], NodeSnapshot],
                 monotonic: Callable[[], float], telemetry_path: str, staleness: Callable[[str], float]) -> None:
        self._exposition = exposition
        self._snapshot = snapshot
        self._monotonic = monotonic
        self._path = telemetry_path
        # PATH_INFO holds the request's bytes as ISO-8859-1 characters (PEP 3333): a path that is not ASCII
        # (/métriques, sent as /m%C3%A9triques) compares as its UTF-8 bytes so spelt
        self._wsgi_path = telemetry_path.encode("utf-8").decode("iso-8859-1")
        self._staleness = staleness
        self._fast_bound = staleness("fast")
        self._landing = LANDING.format(version=__version__, path=escape(telemetry_path)).encode()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return reply(start_response, "405 Method Not Allowed", b"only GET and HEAD are allowed\n",
                          extra=[("Allow", "GET, HEAD")])
        if path == self._wsgi_path:
            return self._metrics(environ, start_response, method)
        if path == "/healthz":
            ok, reason = self._snapshot().collecting(self._monotonic(), self._fast_bound)
            return reply(start_response, "200 OK" if ok else "503 Service Unavailable", reason.encode() + b"\n",
                          head=method == "HEAD")
        if path == STATUS_PATH:
            document = status_document(self._snapshot(), self._monotonic(), self._staleness)
            try:  # JSON has no NaN or Infinity: never emitted (a reading that slipped through is null)
                body = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
            except ValueError:
                body = json.dumps(finite(document), separators=(",", ":"), allow_nan=False).encode()
            return reply(start_response, "200 OK", body, "application/json", head=method == "HEAD")
        if path == "/":
            return reply(start_response, "200 OK", self._landing, "text/html; charset=utf-8", head=method == "HEAD")
        return reply(start_response, "404 Not Found", f"not found; metrics are at {self._path}\n".encode(),
                      head=method == "HEAD")

    def _metrics(self, environ: dict[str, Any], start_response: StartResponse, method: str) -> Iterable[bytes]:
        content_type = self._exposition.content_type(environ.get("HTTP_ACCEPT", ""))
        body, compressed = self._exposition.render(openmetrics=content_type.startswith("application/openmetrics-text"),
                                                   compress=accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")))
        extra = [("Content-Encoding", "gzip")] if compressed else []
        return reply(start_response, "200 OK", body, content_type, extra=extra, head=method == "HEAD")


def finite(document: Any) -> Any:
    """A copy of a JSON document with every non-finite float (NaN, the infinities) replaced by None (null)."""
    if isinstance(document, float):
        return document if math.isfinite(document) else None
    if isinstance(document, dict):
        return {key: finite(value) for key, value in document.items()}
    if isinstance(document, (list, tuple)):
        return [finite(value) for value in document]
    return document


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header (RFC 9110 12.5.3) lets the answer be gzip: a "gzip" (or "x-gzip", any
    case) or a "*" with a q-value above 0, gzip not refused by name. "gzip;q=0" refuses it, "x-nogzip" is
    another coding (a substring test took both for gzip)."""
    if header == "gzip":  # Prometheus, vmagent: at once
        return True
    star = None
    for item in header.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip(" \t").lower()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        name, _, value = params.strip(" \t").partition("=")
        if name.strip(" \t").lower() == "q":
            try:
                q = float(value.strip(" \t")) if value.strip(" \t")[:1] in "01" else 0.0
            except ValueError:
                q = 0.0  # "q=x": not a q-value; read as a refusal rather than a wish
        if coding == "*":
            star = q > 0
        else:
            return q > 0
    return bool(star)


def reply(start_response: StartResponse, status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
           extra: list[tuple[str, str]] | None = None, head: bool = False) -> list[bytes]:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))] + (extra or [])
    start_response(status, headers)
    return [] if head else [body]
