"""The exporter: the only package that imports prometheus_client."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Collection
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.utils import floatToGoString

from gpuwatch import __version__, groups, logs
from gpuwatch.clock import Clock
from gpuwatch.exporter.collector import Renderer, build_labels, encode, freshness_key
from gpuwatch.model import NodeSnapshot

OPENMETRICS_EOF = "# EOF\n"
GZIP_MIN_BYTES = 1024  # smaller bodies go uncompressed


class _ProcessMetrics:
    """prometheus_client's ProcessCollector (process_cpu_seconds_total, process_resident_memory_bytes,
    ...) in either format. Its families' headers come from prometheus_client's own encoders, once;
    after that a render formats only the values (the full encoder validates and escapes every name
    again, a quarter of an exposition's cost)."""

    def __init__(self) -> None:
        self._collector = ProcessCollector(registry=None)
        self._headers: dict[tuple[str, bool], str] = {}

    def lines(self, openmetrics: bool) -> str:
        out = []
        for family in self._collector.collect():
            if any(sample.labels or sample.timestamp is not None for sample in family.samples):
                out.append(self._encode(family, openmetrics))  # not what ProcessCollector yields today
                continue
            header = self._headers.get((family.name, openmetrics))
            if header is None:
                encoded = self._encode(family, openmetrics)
                header = self._headers[(family.name, openmetrics)] = "".join(
                    line + "\n" for line in encoded.splitlines() if line.startswith("#"))
            out.append(header)
            out.extend(f"{sample.name} {floatToGoString(sample.value)}\n" for sample in family.samples)
        return "".join(out)

    @staticmethod
    def _encode(family: Metric, openmetrics: bool) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_One(family))
        if openmetrics:
            return openmetrics_latest(registry).decode()[: -len(OPENMETRICS_EOF)]
        return generate_latest(registry).decode()


class _One:
    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family]


class Exposition:
    """/metrics from the store's snapshot: one render per snapshot, whatever the number of scrapers.

    The body of each format (text or OpenMetrics, gzip or not) is kept until the snapshot, the
    freshness of its readings, the count of dropped log lines or the second of the process_*
    metrics (gpuwatch's own CPU and memory, from prometheus_client's ProcessCollector) changes;
    concurrent scrapers of the same moment wait for one render and share its bytes.
    """

    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                 process_metrics: bool = True, enabled: Collection[str] = groups.DEFAULT_ENABLED,
                 per_pid_max: int = 0) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._staleness = staleness
        self._renderer = Renderer(staleness, build_labels(), enabled, per_pid_max)
        self._process = _ProcessMetrics() if process_metrics else None
        self._lock = threading.Lock()
        self._lines: tuple[Any, dict[str, list[str]]] | None = None
        self._bodies: dict[tuple[bool, bool], tuple[Any, bytes, bool]] = {}

    @staticmethod
    def content_type(accept: str) -> str:
        """The Content-Type to answer a request's Accept header with (OpenMetrics if it asks for it)."""
        return str(choose_encoder(accept)[1])

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
            if self._lines is None or self._lines[0] != state:
                self._lines = (state, self._renderer.render(snap, now, dropped))
            text = encode(self._lines[1], openmetrics)
            if self._process is not None:
                text += self._process.lines(openmetrics)
            body = (text + OPENMETRICS_EOF if openmetrics else text).encode()
            compressed = compress and len(body) >= GZIP_MIN_BYTES
            if compressed:
                body = gzip.compress(body, compresslevel=1)
            self._bodies[(openmetrics, compress)] = (key, body, compressed)
            return body, compressed


def build_exposition(snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                     process_metrics: bool = True, enabled: Collection[str] = groups.DEFAULT_ENABLED,
                     per_pid_max: int = 0) -> Exposition:
    return Exposition(snapshot, clock, staleness, process_metrics, enabled, per_pid_max)


__all__ = ["Exposition", "build_exposition", "__version__"]
