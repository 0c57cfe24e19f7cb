"""The data model: what a backend reports, in base units, with ``None`` meaning "not supported".

Everything here is a frozen value object. Backends build them, the poller stores them, the
rules and the exporter read them. Units are in the field names (``_celsius``, ``_watts``,
``_bytes``, ``_hertz``, ``_ratio``, ``_seconds``, ``_joules``); no field ever holds a sentinel
like 0 or NaN for "unavailable": absent readings are ``None`` or missing from their mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuwatch.frozen import quick
from gpuwatch.groups import (  # noqa: F401 - the samples are part of the model
    FEATURES,
    FastSample,
    GpuHost,
    HostSample,
    SlowSample,
)
from gpuwatch.groups.clocks import (  # noqa: F401
    CLOCKS,
    CLOCKS_EVENT_REASON_BITS,
    CLOCKS_EVENT_TIME_REASONS,
    decode_clocks_event_reasons,
)
from gpuwatch.groups.fans import FanReading  # noqa: F401
from gpuwatch.groups.processes import GpuProcess, ProcessInfo  # noqa: F401
from gpuwatch.groups.thermal import thresholds as _thresholds
from gpuwatch.groups.utilization import ENGINES as UTILIZATION_ENGINES  # noqa: F401
from gpuwatch.groups.xid import XidEvent  # noqa: F401

THRESHOLDS: tuple[str, ...] = ("shutdown", "slowdown", "gpu_max", "memory_max")
POWER_LIMITS: tuple[str, ...] = ("enforced", "default", "min", "max")


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


def fresh(taken: float | None, now: float, bound: float) -> bool:
    """The one freshness test: something taken at monotonic time ``taken`` (a reading, a completed
    poll) is fresh at ``now`` while it is at most ``bound`` seconds old (the staleness bound)."""
    return taken is not None and now - taken <= bound


def temperature_thresholds(fast: FastSample | None, slow: SlowSample | None) -> dict[str, float]:
    """The temperature thresholds on the absolute (°C) scale, from the samples of a GPU: the one
    definition (gpuwatch.groups.thermal.thresholds) the exporter, the rules and the live view use."""
    return _thresholds(None if fast is None else fast.thermal, None if slow is None else slow.thermal)


def slowdown_headroom(fast: FastSample | None, slow: SlowSample | None) -> tuple[float | None, float | None]:
    """(degrees left before the slowdown threshold, that threshold in °C), from temperature_thresholds;
    (None, None) when either is unknown."""
    if fast is None or fast.thermal.temperature_celsius is None:
        return None, None
    slowdown = temperature_thresholds(fast, slow).get("slowdown")
    if slowdown is None:
        return None, None
    return slowdown - fast.thermal.temperature_celsius, slowdown


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
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
    host: GpuHost | None = None  # its allocations, from the last read of the host groups
    host_monotonic: float | None = None  # when that read ended

    def fresh_fast(self, now: float, bound: float) -> FastSample | None:
        """The fast sample, if the GPU is up and the sample fresh; else None."""
        return self.fast if self.up and fresh(self.fast_monotonic, now, bound) else None

    def fresh_slow(self, now: float, bound: float) -> SlowSample | None:
        """The slow sample, if the GPU is up and the sample fresh; else None."""
        return self.slow if self.up and fresh(self.slow_monotonic, now, bound) else None

    def fresh_host(self, now: float, bound: float) -> GpuHost | None:
        """Its allocations, if the host read is fresh (a lost GPU stays allocated to its job); else None."""
        return self.host if fresh(self.host_monotonic, now, bound) else None


@dataclass(frozen=True, slots=True)
class TierState:
    """Outcome of the last poll of one tier (``fast`` or ``slow``)."""

    success: bool = False
    duration_seconds: float | None = None
    last_completed_wall: float | None = None
    last_completed_monotonic: float | None = None
    errors_total: Mapping[str, int] = field(default_factory=dict)
    in_flight_since: float | None = None  # monotonic start of a poll still running
    groups: Mapping[str, tuple[float, bool]] = field(default_factory=dict)  # group -> (seconds, succeeded)

    def completed_within(self, now: float, bound: float) -> bool:
        """A poll of the tier completed within the staleness bound (whether every GPU answered or not)."""
        return fresh(self.last_completed_monotonic, now, bound)

    def succeeded_within(self, now: float, bound: float) -> bool:
        """The last poll completed for every visible GPU, within the staleness bound (gpuwatch_poll_success)."""
        return self.success and self.completed_within(now, bound)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Where the node stands in the facility (``--node.rack``, ``.row``, ``.room``, ``.pdu``: for sites
    whose Prometheus targets carry no such labels) and what its supplies can deliver to the GPUs after
    redundancy (``--node.power-budget-watts``; None: not declared)."""

    rack: str = ""
    row: str = ""
    room: str = ""
    pdu: str = ""
    power_budget_watts: float | None = None


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
    events_ok: bool | None = None  # the XID events thread's last wait worked (None: not started)
    host: HostSample | None = None  # the last read of the host groups (gpuwatch/hostside/)
    host_monotonic: float | None = None
    host_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (group, error) -> count
    node: NodeInfo = NodeInfo()

    def fresh_host(self, now: float, bound: float) -> HostSample | None:
        """The last host read, while it is fresh (the slow tier's staleness bound)."""
        return self.host if fresh(self.host_monotonic, now, bound) else None

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


class Observation:
    """What a rule sees at one instant: is its condition true, on what value against what threshold.

    ``summary`` may be given as a function of no arguments returning the text: it is called only
    when someone reads ``summary`` (an anomaly that fires or resolves, a test), once. A rule is
    evaluated on every GPU at every poll while its summary is read a few times per episode, so
    rules pass ``lambda: f"..."`` rather than format a sentence nobody reads.
    """

    __slots__ = ("active", "value", "threshold", "_summary")

    def __init__(self, active: bool, value: float | None = None, threshold: float | None = None,
                 summary: str | Callable[[], str] = "") -> None:
        self.active = active
        self.value = value
        self.threshold = threshold
        self._summary = summary

    @property
    def summary(self) -> str:
        text = self._summary
        if not isinstance(text, str):
            text = self._summary = text()
        return text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Observation):
            return NotImplemented
        return (self.active, self.value, self.threshold, self.summary) == (
            other.active, other.value, other.threshold, other.summary)

    __hash__ = None  # type: ignore[assignment]  # mutable cache of the summary: not hashable

    def __repr__(self) -> str:
        return f"Observation({self.active!r}, {self.value!r}, {self.threshold!r}, {self.summary!r})"


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
