"""The exporter: the only package that imports prometheus_client."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

try:  # ISA-L's deflate (python-isal, x86-64 and ARM64): a body gzipped in a quarter of zlib's time, no larger
    from isal import isal_zlib as deflate
except ImportError:  # other machines (ppc64le), or isal not installed: the standard library's zlib
    import zlib as deflate  # type: ignore[no-redef]

from gpuwatch.deferred import parts_of

# prometheus_client's parts without its package __init__, whose HTTP servers and push client import ssl,
# hashlib and urllib.request: 5 MB of resident memory for code gpuwatch never runs (gpuwatch.deferred).
parts_of("prometheus_client")

from prometheus_client.openmetrics.exposition import ALLOWUTF8, DOTS, UNDERSCORES, VALUES  # noqa: E402
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE  # noqa: E402
from prometheus_client.utils import parse_version  # noqa: E402

from gpuwatch import __version__, logs  # noqa: E402
from gpuwatch.clock import Clock  # noqa: E402
from gpuwatch.exporter.process import OPENMETRICS_EOF, ProcessMetrics  # noqa: E402
from gpuwatch.exporter.render import Renderer, build_labels, freshness_key  # noqa: E402
from gpuwatch.groups.selection import Selection  # noqa: E402
from gpuwatch.model import NodeSnapshot  # noqa: E402

GZIP_MIN_BYTES = 1024  # smaller bodies go uncompressed
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_1_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
_ESCAPINGS = (ALLOWUTF8, UNDERSCORES, DOTS, VALUES)


def _accept_parameter(tokens: list[str], name: str) -> str:
    for token in tokens:
        if "=" in token:
            key, value = token.strip().split("=", 1)
            if key == name:
                return value
    return ""


def _at_least_1(version: str) -> bool:
    try:
        return bool(version) and parse_version(version) >= (1, 0, 0)
    except TypeError:  # "abc", "1.x": prometheus_client's choose_encoder raises here; not a version we have
        return False


def content_type(accept: str) -> str:
    """The Content-Type that answers a request's Accept header: prometheus_client's negotiation
    (``exposition.choose_encoder``, whose module gpuwatch does not load; tests/test_render.py holds the
    two equal): OpenMetrics where it is asked for, the text format otherwise, each with the escaping
    scheme the client names when it names a version it can have. A version that is not numbers
    (``version=abc``), on which choose_encoder raises, is passed over as one too old."""
    for accepted in (accept or "").split(","):
        tokens = accepted.split(";")
        kind = tokens[0].strip()
        if kind not in ("application/openmetrics-text", "text/plain"):
            continue
        version = _accept_parameter(tokens, "version")
        escaping = _accept_parameter(tokens, "escaping")
        escaping = escaping if escaping in _ESCAPINGS else UNDERSCORES
        if kind == "application/openmetrics-text":
            if not version:
                return OPENMETRICS_CONTENT_TYPE
            if _at_least_1(version):
                return f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}"
        elif _at_least_1(version):
            return f"{TEXT_1_CONTENT_TYPE}; escaping={escaping}"
    return TEXT_CONTENT_TYPE


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # RFC 1952: deflate, no name, no mtime, OS unknown


class _Part:
    """The families of one rendered state in one format, and their deflate stream, made once.

    The process_* metrics after them change every second; a scrape in another second of the same
    snapshot (a second Prometheus, an HA pair) compresses only those: the families' stream ends at a
    full flush (byte-aligned, no reference into what follows), the tail is a raw deflate stream of
    its own, and the two make one valid gzip member (one CRC-32 over both, chained).

    Once deflated, the uncompressed bytes are let go (0.6 MB at 64 GPUs; Prometheus asks for gzip):
    a request without gzip has the renderer spell them again (``raw is None``), and they are kept from
    then on."""

    __slots__ = ("raw", "size", "_deflated", "_crc")

    def __init__(self, raw: bytes) -> None:
        self.raw: bytes | None = raw
        self.size = len(raw)
        self._deflated: bytes | None = None
        self._crc = 0

    def gzip(self, tail: bytes) -> bytes:
        if self._deflated is None:
            raw = self.raw
            assert raw is not None  # let go only here, once deflated
            head = deflate.compressobj(1, deflate.DEFLATED, -15)
            self._deflated = head.compress(raw) + head.flush(deflate.Z_FULL_FLUSH)
            self._crc = deflate.crc32(raw)
            self.raw = None
        end = deflate.compressobj(1, deflate.DEFLATED, -15)
        rest = end.compress(tail) + end.flush(deflate.Z_FINISH)
        size = (self.size + len(tail)) & 0xFFFFFFFF
        return b"".join((_GZIP_HEADER, self._deflated, rest,
                         struct.pack("<II", deflate.crc32(tail, self._crc), size)))


class Exposition:
    """/metrics from the store's snapshot: one render per snapshot, whatever the number of scrapers.

    The families of each format (text or OpenMetrics) are encoded once per rendered state, and the
    gzip body of each kept until the snapshot, the freshness of its readings, the count of dropped
    log lines or the second of the process_* metrics (gpuwatch's own CPU and memory, from
    prometheus_client's ProcessCollector) changes; concurrent scrapers of the same moment wait for
    one render and share its bytes. An uncompressed body is the families' bytes and the process_*
    lines joined for each request (not kept twice).
    """

    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                 process_metrics: bool = True, selection: Selection | None = None) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._staleness = staleness
        self._renderer = Renderer(staleness, build_labels(), selection)
        self._process = ProcessMetrics() if process_metrics else None
        self._lock = threading.Lock()
        self._rendered: Any = None  # the state the renderer's body is of
        self._bodies: dict[tuple[bool, bool], tuple[Any, bytes, bool]] = {}
        self._parts: dict[bool, _Part] = {}  # per format, the families of the rendered state
        self._tails: dict[bool, tuple[int, bytes]] = {}  # per format, (second, the process_* lines)

    @staticmethod
    def content_type(accept: str) -> str:
        """The Content-Type to answer a request's Accept header with (OpenMetrics if it asks for it)."""
        return content_type(accept)

    def render(self, openmetrics: bool = False, compress: bool = False) -> tuple[bytes, bool]:
        """(body, gzip-compressed) of the format asked for; compressed only if asked and worth it."""
        snap = self._snapshot()
        now = self._clock.monotonic()
        dropped = logs.dropped_lines()
        state = (snap.generation, freshness_key(snap, now, self._staleness), dropped)
        key = (state, int(now) if self._process is not None else 0)
        kept = self._bodies.get((openmetrics, compress))
        if kept is not None and kept[0] == key:
            return kept[1], kept[2]
        with self._lock:
            kept = self._bodies.get((openmetrics, compress))
            if kept is not None and kept[0] == key:
                return kept[1], kept[2]
            if self._rendered != state:
                self._renderer.render(snap, now, dropped)
                self._rendered = state
                self._parts.clear()
            part = self._parts.get(openmetrics)
            if part is None:
                part = self._parts[openmetrics] = _Part(self._renderer.encode(openmetrics))
            tail = self._tails.get(openmetrics)
            if tail is None or tail[0] != key[1]:  # the process_* metrics: read once a second per format
                lines = self._process.lines(openmetrics) if self._process is not None else ""
                tail = self._tails[openmetrics] = (key[1], (lines + OPENMETRICS_EOF if openmetrics else lines).encode())
            tail_bytes = tail[1]
            compressed = compress and part.size + len(tail_bytes) >= GZIP_MIN_BYTES
            if not compressed:  # not kept: it would be a second copy of part.raw (0.5 MB at 64 GPUs)
                if part.raw is None:  # let go once deflated: the renderer still holds this state
                    part.raw = self._renderer.encode(openmetrics)
                return part.raw + tail_bytes, False
            body = part.gzip(tail_bytes)
            self._bodies[(openmetrics, compress)] = (key, body, compressed)
            return body, compressed


def build_exposition(snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                     process_metrics: bool = True, selection: Selection | None = None) -> Exposition:
    return Exposition(snapshot, clock, staleness, process_metrics, selection)


__all__ = ["Exposition", "build_exposition", "content_type", "__version__"]
