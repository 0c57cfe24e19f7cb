"""The exporter: the only package that imports prometheus_client."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from gpuwatch import __version__, logs
from gpuwatch.clock import Clock
from gpuwatch.exporter.collector import build_labels, freshness_key, render
from gpuwatch.model import NodeSnapshot

OPENMETRICS_EOF = "# EOF\n"


class Exposition:
    """Renders /metrics from the store's snapshot, cached per snapshot and freshness.

    Between two polls every scrape (and every one of several concurrent scrapers) gets the same
    bytes without rendering again; process_* metrics about gpuwatch itself are appended fresh.
    """

    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                 process_metrics: bool = True, max_processes: int = 0) -> None:
        self._snapshot = snapshot
        self._max_processes = max_processes
        self._clock = clock
        self._staleness = staleness
        self._build = build_labels()
        self._process: CollectorRegistry | None = None
        if process_metrics:
            self._process = CollectorRegistry(auto_describe=False)
            ProcessCollector(registry=self._process)
        self._lock = threading.Lock()
        self._cache: dict[bool, tuple[object, str]] = {}

    def _gpuwatch(self, openmetrics: bool) -> str:
        snap = self._snapshot()
        now = self._clock.monotonic()
        dropped = logs.dropped_lines()
        key = (snap.generation, freshness_key(snap, now, self._staleness), dropped)
        with self._lock:
            cached = self._cache.get(openmetrics)
        if cached is not None and cached[0] == key:
            return cached[1]
        text = render(snap, now, self._staleness, self._build, self._max_processes, dropped).encode(openmetrics)
        with self._lock:
            self._cache[openmetrics] = (key, text)
        return text

    def render(self, openmetrics: bool = False) -> bytes:
        body = self._gpuwatch(openmetrics).encode()
        if self._process is not None:
            if openmetrics:
                body += openmetrics_latest(self._process)[: -len(OPENMETRICS_EOF)]
            else:
                body += generate_latest(self._process)
        if openmetrics:
            body += OPENMETRICS_EOF.encode()
        return body


def build_exposition(snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                     process_metrics: bool = True, max_processes: int = 0) -> Exposition:
    return Exposition(snapshot, clock, staleness, process_metrics, max_processes)


__all__ = ["Exposition", "build_exposition", "__version__"]
