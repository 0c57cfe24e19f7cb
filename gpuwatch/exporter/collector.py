"""The Prometheus collector: a stateless view over the latest store snapshot.

A scrape never calls NVML. Readings older than the staleness bound are dropped (the
``gpuwatch_last_poll_timestamp_seconds`` gauges still say when data was last fresh); unsupported
readings are absent, never 0 or NaN. Output is sorted by family, then labels.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from importlib import metadata

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpuwatch import __version__
from gpuwatch.clock import Clock
from gpuwatch.exporter.catalogue import CATALOGUE
from gpuwatch.model import FEATURES, GpuState, NodeSnapshot, fresh, temperature_thresholds

LabelValues = tuple[str, ...]


def _sort_key(values: LabelValues) -> tuple:
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in values)


class Samples:
    """Accumulates samples per family name; every name must be in the catalogue."""

    def __init__(self) -> None:
        self._data: dict[str, list[tuple[LabelValues, float]]] = {}

    def add(self, name: str, labels: LabelValues, value: float | int | bool | None) -> None:
        if value is None:
            return
        self._data.setdefault(name, []).append((labels, float(value)))

    def encode(self, openmetrics: bool = False) -> str:
        """The text exposition (0.0.4, or OpenMetrics without the final ``# EOF``).

        Byte for byte what prometheus_client's encoders make of ``families()`` (a test holds it to
        that), but several times faster: label names are sorted once per family, not per sample,
        and nothing is validated again at scrape time (the catalogue was, at import).
        """
        out: list[str] = []
        append = out.append
        for name in sorted(self._data):
            spec = CATALOGUE[name]
            counter = spec.type == "counter"
            family = name[:-6] if counter and openmetrics else name
            help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
            if openmetrics:
                help_text = help_text.replace('"', r'\"')
            append(f"# HELP {family} {help_text}\n# TYPE {family} {spec.type}\n")
            order = sorted(range(len(spec.labels)), key=spec.labels.__getitem__)
            keys = [f'{spec.labels[i]}="' for i in order]
            rows = sorted(self._data[name], key=lambda item: _sort_key(item[0]))
            for labels, value in rows:
                if keys:
                    parts = []
                    for key, i in zip(keys, order):
                        text = labels[i]
                        if "\\" in text or '"' in text or "\n" in text:
                            text = text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
                        parts.append(key + text + '"')
                    append(f"{name}{{{','.join(parts)}}} {floatToGoString(value)}\n")
                else:
                    append(f"{name} {floatToGoString(value)}\n")
        return "".join(out)

    def families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name in sorted(self._data):
            spec = CATALOGUE[name]
            cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
            family = cls(name, spec.help, labels=spec.labels)
            for labels, value in sorted(self._data[name], key=lambda item: _sort_key(item[0])):
                family.add_metric(labels, value)
            yield family


def binding_version() -> str:
    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_labels() -> LabelValues:
    """Label values of gpuwatch_build_info."""
    return (__version__, platform.python_version(), binding_version())


def freshness_key(snap: NodeSnapshot, now: float, staleness: Callable[[str], float]) -> tuple:
    """What, besides the snapshot itself, decides the exposition: which readings are still fresh."""
    fast_bound, slow_bound = staleness("fast"), staleness("slow")
    tiers = tuple(tier.succeeded_within(now, staleness(name)) for name, tier in snap.tiers.items())
    gpus = tuple((fresh(g.fast_monotonic, now, fast_bound), fresh(g.slow_monotonic, now, slow_bound)) for g in snap.gpus)
    return tiers, gpus


class GpuwatchCollector(Collector):
    """The same exposition as a prometheus_client Collector, for use in another registry."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock,
                 staleness: Callable[[str], float]) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._staleness = staleness
        self._build = build_labels()

    def describe(self) -> list:
        return []  # never collect at registration time

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return render(self._snapshot(), self._clock.monotonic(), self._staleness, self._build).families()


def render(snap: NodeSnapshot, now: float, staleness: Callable[[str], float], build: LabelValues,
           max_processes: int = 0, log_dropped: int = 0) -> Samples:
    """The samples of one scrape; ``max_processes`` > 0 adds per-process series, at most that many."""
    out = Samples()
    out.add("gpuwatch_build_info", build, 1)
    out.add("gpuwatch_log_dropped_total", (), log_dropped)
    out.add("gpuwatch_backend_up", (snap.backend,), snap.backend_up)
    out.add("gpuwatch_gpus", (), snap.visible_gpus)
    if snap.driver is not None:
        d = snap.driver
        out.add("gpuwatch_driver_info", (d.driver_version, d.nvml_version, d.cuda_driver_version), 1)
    for tier_name, tier in snap.tiers.items():
        t = (tier_name,)
        out.add("gpuwatch_poll_success", t, tier.succeeded_within(now, staleness(tier_name)))
        out.add("gpuwatch_poll_duration_seconds", t, tier.duration_seconds)
        out.add("gpuwatch_last_poll_timestamp_seconds", t, tier.last_completed_wall)
        for error, count in tier.errors_total.items():
            out.add("gpuwatch_poll_errors_total", (tier_name, error), count)
    fast_bound, slow_bound = staleness("fast"), staleness("slow")
    budget = max_processes
    for gpu in snap.gpus:
        _render_gpu(out, gpu, now, fast_bound, slow_bound)
        if gpu.fresh_slow(now, slow_bound) is not None:
            budget = _render_workloads(out, gpu, budget)
    for anomaly in snap.anomalies:
        if not anomaly.firing:  # sparse, like ALERTS: quiet rules have no series (contract v2)
            continue
        if anomaly.uuid is None:
            out.add("gpuwatch_node_anomaly", (anomaly.rule, anomaly.severity), 1)
            continue
        g = (anomaly.gpu or "", anomaly.uuid)
        out.add("gpuwatch_anomaly", g + (anomaly.rule, anomaly.severity), 1)
        out.add("gpuwatch_anomaly_since_timestamp_seconds", g + (anomaly.rule,), anomaly.since_wall)
    for rule, count in snap.rule_onsets.items():
        out.add("gpuwatch_anomaly_onsets_total", (rule,), count)
    for rule, count in snap.rule_errors.items():
        out.add("gpuwatch_rule_evaluation_errors_total", (rule,), count)
    return out


def _render_workloads(out: Samples, gpu: GpuState, budget: int) -> int:
    g = (str(gpu.identity.index), gpu.identity.uuid)
    memory: dict[tuple[str, str], int] = {}
    jobs = set()
    for p in gpu.workloads:
        jobs.add((p.scheduler, p.job_id, p.user))
        if p.used_memory_bytes is not None:
            memory[(p.scheduler, p.job_id)] = memory.get((p.scheduler, p.job_id), 0) + p.used_memory_bytes
        if budget > 0 and p.pid:
            out.add("gpuwatch_process_memory_used_bytes", g + (str(p.pid), p.scheduler, p.job_id, p.user),
                    p.used_memory_bytes)
            budget -= 1
    for job in jobs:
        out.add("gpuwatch_gpu_job_info", g + job, 1)
    for key, used in memory.items():
        out.add("gpuwatch_workload_memory_used_bytes", g + key, used)
    return budget


def _render_gpu(out: Samples, gpu: GpuState, now: float, fast_bound: float, slow_bound: float) -> None:
    ident = gpu.identity
    g = (str(ident.index), ident.uuid)
    out.add("gpuwatch_gpu_info", g + (
        ident.name, ident.pci_bus_id, ident.serial or "",
        "" if ident.minor_number is None else str(ident.minor_number),
        ident.vbios_version or "", ident.architecture or "",
    ), 1)
    out.add("gpuwatch_gpu_up", g, gpu.up)
    for feature in FEATURES:
        if feature in gpu.features:
            out.add("gpuwatch_gpu_feature_supported", g + (feature,), gpu.features[feature])
    if gpu.features.get("xid_events") or gpu.xid_counts:
        out.add("gpuwatch_xid_events_total", g, sum(gpu.xid_counts.values()))
    for xid, count in gpu.xid_counts.items():  # a code's series appears with its first event
        out.add("gpuwatch_xid_errors_total", g + (str(xid),), count)
    for xid, ts in gpu.xid_last_timestamp.items():
        out.add("gpuwatch_xid_last_timestamp_seconds", g + (str(xid),), ts)
    if not gpu.up:
        return
    fast = gpu.fresh_fast(now, fast_bound)
    slow = gpu.fresh_slow(now, slow_bound)
    if fast is not None:
        out.add("gpuwatch_temperature_celsius", g + ("gpu",), fast.temperature_celsius)
        out.add("gpuwatch_temperature_celsius", g + ("memory",), fast.memory_temperature_celsius)
        out.add("gpuwatch_temperature_margin_celsius", g, fast.temperature_margin_celsius)
        for fan in fast.fans:
            f = g + (str(fan.fan),)
            out.add("gpuwatch_fan_speed_ratio", f, fan.speed_ratio)
            out.add("gpuwatch_fan_target_speed_ratio", f, fan.target_speed_ratio)
            out.add("gpuwatch_fan_speed_rpm", f, fan.speed_rpm)
        out.add("gpuwatch_power_watts", g, fast.power_watts)
        out.add("gpuwatch_energy_joules_total", g, fast.energy_joules)
        out.add("gpuwatch_performance_state", g, fast.performance_state)
        for engine, ratio in fast.utilization_ratio.items():
            out.add("gpuwatch_utilization_ratio", g + (engine,), ratio)
        out.add("gpuwatch_memory_total_bytes", g, fast.memory_total_bytes)
        out.add("gpuwatch_memory_used_bytes", g, fast.memory_used_bytes)
        out.add("gpuwatch_memory_free_bytes", g, fast.memory_free_bytes)
        out.add("gpuwatch_memory_reserved_bytes", g, fast.memory_reserved_bytes)
        for clock, hz in fast.clock_hertz.items():
            out.add("gpuwatch_clock_hertz", g + (clock,), hz)
        for reason, active in fast.clocks_event_active.items():
            out.add("gpuwatch_clocks_event_active", g + (reason,), active)
        for reason, seconds in fast.clocks_event_seconds.items():
            out.add("gpuwatch_clocks_event_seconds_total", g + (reason,), seconds)
    if slow is not None:
        for name, celsius in temperature_thresholds(fast, slow).items():
            out.add("gpuwatch_temperature_threshold_celsius", g + (name,), celsius)
        for name, celsius in slow.temperature_margin_threshold_celsius.items():
            out.add("gpuwatch_temperature_margin_threshold_celsius", g + (name,), celsius)
        for name, watts in slow.power_limit_watts.items():
            out.add("gpuwatch_power_limit_watts", g + (name,), watts)
        for clock, hz in slow.clock_max_hertz.items():
            out.add("gpuwatch_clock_max_hertz", g + (clock,), hz)
        for (error, counter), count in slow.ecc_errors.items():
            out.add("gpuwatch_ecc_errors_total", g + (error, counter), count)
        for error, count in slow.remapped_rows.items():
            out.add("gpuwatch_remapped_rows_total", g + (error,), count)
        out.add("gpuwatch_remapped_rows_pending", g, slow.remapped_rows_pending)
        out.add("gpuwatch_remapped_rows_failed", g, slow.remapped_rows_failed)
        out.add("gpuwatch_retired_pages_pending", g, slow.retired_pages_pending)
        for link, gen in slow.pcie_link_generation.items():
            out.add("gpuwatch_pcie_link_generation", g + (link,), gen)
        for link, width in slow.pcie_link_width.items():
            out.add("gpuwatch_pcie_link_width", g + (link,), width)
        out.add("gpuwatch_pcie_replays_total", g, slow.pcie_replays)
