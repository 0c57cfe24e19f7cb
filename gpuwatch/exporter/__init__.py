"""The exporter: the only package that imports prometheus_client."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from gpuwatch.clock import Clock
from gpuwatch.exporter.collector import GpuwatchCollector
from gpuwatch.model import NodeSnapshot


def build_registry(snapshot: Callable[[], NodeSnapshot], clock: Clock, staleness: Callable[[str], float],
                   process_metrics: bool = True) -> CollectorRegistry:
    """A private registry: gpuwatch's collector, plus process_* metrics about gpuwatch itself."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuwatchCollector(snapshot, clock, staleness))
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


def text_exposition(registry: CollectorRegistry) -> bytes:
    """The classic text format (what promtool and node_exporter's textfile collector read)."""
    return generate_latest(registry)
