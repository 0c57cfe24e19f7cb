"""The data model: what a backend reports, in base units, with ``None`` meaning "not supported".

Everything here is a frozen value object. Backends build them, the poller stores them, the
rules and the exporter read them. Units are in the field names (``_celsius``, ``_watts``,
``_bytes``, ``_hertz``, ``_ratio``, ``_seconds``, ``_joules``); no field ever holds a sentinel
like 0 or NaN for "unavailable": absent readings are ``None`` or missing from their mapping.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

# Capabilities probed once per GPU and exported as gpuwatch_gpu_feature_supported{feature}.
FEATURES: tuple[str, ...] = (
    "clocks_event_reasons",
    "clocks_event_time",
    "ecc",
    "energy",
    "fan",
    "fan_rpm",
    "fan_target",
    "memory_temperature",
    "pcie",
    "power",
    "power_limit",
    "remapped_rows",
    "retired_pages",
    "temperature_margin",
    "utilization",
    "xid_events",
)

UTILIZATION_ENGINES: tuple[str, ...] = ("gpu", "memory", "encoder", "decoder")
CLOCKS: tuple[str, ...] = ("graphics", "sm", "memory", "video")
THRESHOLDS: tuple[str, ...] = ("shutdown", "slowdown", "gpu_max", "memory_max")
POWER_LIMITS: tuple[str, ...] = ("enforced", "default", "min", "max")

# Clock-event (throttle) reason bits, as in nvml.h (nvmlClocksEventReason*).
CLOCKS_EVENT_REASON_BITS: Mapping[str, int] = {
    "gpu_idle": 0x001,
    "applications_clocks_setting": 0x002,
    "sw_power_cap": 0x004,
    "hw_slowdown": 0x008,
    "sync_boost": 0x010,
    "sw_thermal_slowdown": 0x020,
    "hw_thermal_slowdown": 0x040,
    "hw_power_brake_slowdown": 0x080,
    "display_clock_setting": 0x100,
}

# Cumulative throttle-time counters (gpuwatch_clocks_event_seconds_total{reason}).
CLOCKS_EVENT_TIME_REASONS: tuple[str, ...] = (
    "sw_power_cap",
    "sync_boost",
    "board_limit",
    "low_utilization",
    "reliability",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "thermal",
)


def decode_clocks_event_reasons(mask: int, supported: int) -> Mapping[str, bool]:
    """Reason name -> active, for every reason bit the GPU supports.

    The result is shared and read-only (a ``types.MappingProxyType``, cached per ``(mask,
    supported)`` pair): a GPU's mask rarely changes, so consecutive samples, and the rule engine's
    history of them, share one mapping instead of holding a new dict each. ``dict(...)`` copies it.
    """
    known = _KNOWN_REASON_BITS  # other bits cannot change the result: one cache entry for them all
    return _decode_clocks_event_reasons(mask & supported & known, supported & known)


_KNOWN_REASON_BITS = sum(CLOCKS_EVENT_REASON_BITS.values())  # distinct bits: the sum is their union


@functools.lru_cache(maxsize=1024)
def _decode_clocks_event_reasons(mask: int, supported: int) -> Mapping[str, bool]:
    return types.MappingProxyType({
        name: bool(mask & bit)
        for name, bit in CLOCKS_EVENT_REASON_BITS.items()
        if supported & bit
    })


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Static facts, read once at discovery."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    serial: str | None = None
    minor_number: int | None = None
    vbios_version: str | None = None
    architecture: str | None = None


@dataclass(frozen=True, slots=True)
class DiscoveredGpu:
    """A GPU found by discovery, with its probed capabilities (feature -> supported)."""

    identity: GpuIdentity
    features: Mapping[str, bool]
    # Lowercase names of problems met while reading it (e.g. invalid_utf8: a text with bytes that are
    # not UTF-8, kept with U+FFFD in their place), counted in gpuwatch_poll_errors_total.
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DriverInfo:
    driver_version: str
    nvml_version: str
    cuda_driver_version: str
    errors: tuple[str, ...] = ()  # as DiscoveredGpu.errors


@dataclass(frozen=True, slots=True)
class FanReading:
    fan: int
    speed_ratio: float | None = None
    target_speed_ratio: float | None = None
    speed_rpm: float | None = None


@dataclass(frozen=True, slots=True)
class FastSample:
    """Readings of the fast tier (default every 2 s)."""

    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    temperature_margin_celsius: float | None = None
    fans: tuple[FanReading, ...] = ()
    power_watts: float | None = None
    energy_joules: float | None = None
    performance_state: int | None = None
    utilization_ratio: Mapping[str, float] = field(default_factory=dict)
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    clock_hertz: Mapping[str, float] = field(default_factory=dict)
    clocks_event_active: Mapping[str, bool] = field(default_factory=dict)
    clocks_event_seconds: Mapping[str, float] = field(default_factory=dict)
    # Lowercase NVML error names of queries that failed in this poll (not NOT_SUPPORTED probes).
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU, as NVML lists it (host PID)."""

    pid: int
    used_memory_bytes: int | None = None  # None: NVML cannot tell (e.g. Windows WDDM)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A GPU process attributed to a user and a workload (gpuwatch/attribution.py)."""

    pid: int
    used_memory_bytes: int | None
    user: str  # user name, or the numeric uid, or "" when the process is not visible
    scheduler: str  # slurm | kubernetes | systemd | none | unknown (PID not visible: another PID namespace, exited)
    job_id: str  # Slurm job id, pod UID, systemd unit, or ""
    container: str = ""  # Kubernetes container id, where known


@dataclass(frozen=True, slots=True)
class SlowSample:
    """Readings of the slow tier (default every 30 s): health counters, limits, thresholds."""

    temperature_threshold_celsius: Mapping[str, float] = field(default_factory=dict)
    temperature_margin_threshold_celsius: Mapping[str, float] = field(default_factory=dict)
    power_limit_watts: Mapping[str, float] = field(default_factory=dict)
    clock_max_hertz: Mapping[str, float] = field(default_factory=dict)
    # (error, counter) -> count, error in corrected|uncorrected, counter in volatile|aggregate
    ecc_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    remapped_rows: Mapping[str, int] = field(default_factory=dict)  # correctable|uncorrectable
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    retired_pages_pending: bool | None = None
    pcie_link_generation: Mapping[str, int] = field(default_factory=dict)  # current|max
    pcie_link_width: Mapping[str, int] = field(default_factory=dict)
    pcie_replays: int | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: not read (unsupported or not collected)
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class XidEvent:
    uuid: str
    xid: int
    timestamp: float  # wall-clock seconds


def fresh(taken: float | None, now: float, bound: float) -> bool:
    """The one freshness test: something taken at monotonic time ``taken`` (a reading, a completed
    poll) is fresh at ``now`` while it is at most ``bound`` seconds old (the staleness bound)."""
    return taken is not None and now - taken <= bound


def temperature_thresholds(fast: FastSample | None, slow: SlowSample | None) -> dict[str, float]:
    """The temperature thresholds on the absolute (°C) scale: the one definition that the exporter
    (gpuwatch_temperature_threshold_celsius), the rules, the live view and so the dashboards use.

    Where the GPU reports its T.Limit margin and T.Limit thresholds (Hopper and newer; nvidia-smi then
    prints only that scale), shutdown, slowdown and gpu_max are derived from them: absolute = current
    temperature + margin - T.Limit threshold (an H200 at 28 °C with margin 59 and slowdown T.Limit -2
    slows down at 89 °C), the scale the driver throttles by. Otherwise they are NVML's absolute
    thresholds. ``memory_max`` is always NVML's own: the GPU's margin says nothing about the memory.
    """
    result: dict[str, float] = dict(slow.temperature_threshold_celsius) if slow else {}
    if slow is None or fast is None:
        return result
    temp, margin = fast.temperature_celsius, fast.temperature_margin_celsius
    if temp is None or margin is None:
        return result
    for name, tlimit in slow.temperature_margin_threshold_celsius.items():
        if name != "memory_max":
            result[name] = temp + margin - tlimit
    return result


def slowdown_headroom(fast: FastSample | None, slow: SlowSample | None) -> tuple[float | None, float | None]:
    """(degrees left before the slowdown threshold, that threshold in °C), from temperature_thresholds;
    (None, None) when either is unknown."""
    if fast is None or fast.temperature_celsius is None:
        return None, None
    slowdown = temperature_thresholds(fast, slow).get("slowdown")
    if slowdown is None:
        return None, None
    return slowdown - fast.temperature_celsius, slowdown


@dataclass(frozen=True, slots=True)
class GpuState:
    """Everything the store knows about one GPU at one moment."""

    identity: GpuIdentity
    features: Mapping[str, bool]
    up: bool
    fast: FastSample | None = None
    fast_monotonic: float | None = None  # when ``fast`` was read
    slow: SlowSample | None = None
    slow_monotonic: float | None = None
    xid_counts: Mapping[int, int] = field(default_factory=dict)
    xid_last_timestamp: Mapping[int, float] = field(default_factory=dict)
    workloads: tuple[ProcessInfo, ...] = ()  # attributed processes of the last slow poll
    visible: bool = True  # False: not in the last discovery (kept so that it shows up as down)

    def fresh_fast(self, now: float, bound: float) -> FastSample | None:
        """The fast sample, if the GPU is up and the sample fresh; else None."""
        return self.fast if self.up and fresh(self.fast_monotonic, now, bound) else None

    def fresh_slow(self, now: float, bound: float) -> SlowSample | None:
        """The slow sample, if the GPU is up and the sample fresh; else None."""
        return self.slow if self.up and fresh(self.slow_monotonic, now, bound) else None


@dataclass(frozen=True, slots=True)
class TierState:
    """Outcome of the last poll of one tier (``fast`` or ``slow``)."""

    success: bool = False
    duration_seconds: float | None = None
    last_completed_wall: float | None = None
    last_completed_monotonic: float | None = None
    errors_total: Mapping[str, int] = field(default_factory=dict)
    in_flight_since: float | None = None  # monotonic start of a poll still running

    def completed_within(self, now: float, bound: float) -> bool:
        """A poll of the tier completed within the staleness bound (whether every GPU answered or not)."""
        return fresh(self.last_completed_monotonic, now, bound)

    def succeeded_within(self, now: float, bound: float) -> bool:
        """The last poll completed for every visible GPU, within the staleness bound (gpuwatch_poll_success)."""
        return self.success and self.completed_within(now, bound)


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """An immutable view of the whole node, handed to rules and the exporter."""

    generation: int
    backend: str
    backend_up: bool
    backend_reason: str | None
    driver: DriverInfo | None
    gpus: tuple[GpuState, ...]
    tiers: Mapping[str, TierState]
    visible_gpus: int
    taken_monotonic: float
    taken_wall: float
    anomalies: tuple[Anomaly, ...] = ()
    rule_onsets: Mapping[str, int] = field(default_factory=dict)  # enabled rule -> onsets on any GPU or the node
    rule_errors: Mapping[str, int] = field(default_factory=dict)  # enabled rule -> evaluations that raised

    def collecting(self, now: float, fast_bound: float) -> tuple[bool, str]:
        """Whether gpuwatch collects: the backend is up and a fast poll completed within the staleness
        bound, with a one-line reason. This is liveness (/healthz, the status document's ``fresh``,
        `gpuwatch check`): a lost GPU does not make it false (gpuwatch_gpu_up 0 and the gpu_lost rule
        say so), or a liveness probe would restart gpuwatch whenever a GPU falls off the bus."""
        if not self.backend_up:
            return False, f"backend {self.backend} down: {self.backend_reason or 'unknown reason'}"
        tier = self.tiers["fast"]
        if tier.last_completed_monotonic is None:
            return False, "no fast poll completed yet"
        age = now - tier.last_completed_monotonic
        if not tier.completed_within(now, fast_bound):
            return False, f"last fast poll completed {age:.1f} s ago (staleness bound {fast_bound:g} s)"
        return True, f"ok: {self.visible_gpus} GPUs, last fast poll {age:.1f} s ago"


SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")


@dataclass(frozen=True, slots=True)
class Observation:
    """What a rule sees at one instant: is its condition true, on what value against what threshold."""

    active: bool
    value: float | None = None
    threshold: float | None = None
    summary: str = ""


@dataclass(frozen=True, slots=True)
class Anomaly:
    """The engine's state for one (rule, GPU) pair, or (rule, node) when ``uuid`` is None."""

    rule: str
    severity: str
    uuid: str | None = None
    gpu: str | None = None  # NVML index as a string
    firing: bool = False
    since_wall: float | None = None  # when the current episode started firing
    onsets: int = 0
    value: float | None = None
    threshold: float | None = None
    summary: str = ""
