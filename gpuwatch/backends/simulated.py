"""A simulated node: GPUs whose readings come from a small, deterministic physics model.

Used by the demo (``gpuwatch --simulate``), by the contract tests and by anyone who wants to see the
exporter and the anomaly rules work without a GPU. Nothing here touches NVML.

Determinism. Each GPU's state is integrated on a fixed grid of ``STEP_SECONDS`` steps counted from
the first ``open()`` (read from the injected clock). A read advances that GPU's state up to the
last grid point at or before ``clock.monotonic()`` and reports the state there, so a reading
depends only on the seed, the profile, the faults and the elapsed time, never on how often or in
which order the GPUs were polled. Jitter comes from per-GPU random generators that are consumed a
fixed amount per step.

The model, per GPU and step:

- load: a seeded sequence of jobs (60–100 % utilization for 2.5–15 minutes, idle gaps of
  20 s–4 min; a GPU may already be busy at start). Memory used ramps up when a job starts and is
  freed when it ends; memory-engine utilization is GPU utilization times a per-job intensity.
- power = idle + utilization × (full-load demand − idle) × clock factor, capped at the enforced
  limit. At the cap the clocks are lowered so that the draw equals the limit and ``sw_power_cap``
  is active.
- temperature: first order toward ambient + power × thermal resistance; with fans the resistance
  falls linearly from its "fans stopped" value to its "fans at 100 %" value.
- fans: target from a fan curve (30 % up to 40 °C, 100 % from 85 °C); the measured speed follows
  the target with a time constant of a few seconds; RPM = speed × maximum RPM.
- thermal throttling: ``sw_thermal_slowdown`` from the max-operating temperature (clocks down to
  75 %), ``hw_thermal_slowdown`` + ``hw_slowdown`` from the slowdown threshold (clocks halved, and
  lowered further as the temperature approaches shutdown), each with hysteresis.
- counters: energy integrates power; each throttle-time counter integrates the time its reason was
  active.

Faults (``Fault``) change the inputs of that model for one GPU during a time window; each kind is
one small entry of ``FAULT_KINDS``, so a new anomaly scenario is one more entry. A few kinds act on
the backend itself rather than on a GPU's physics: ``backend_down`` (every call raises
BackendUnavailable), ``hang`` (reads block, like a wedged driver) and ``unlisted`` (a GPU gone from
the bus and from discovery).

Profiles: ``rtx6000`` (RTX 6000 Ada: one blower fan, absolute thresholds), ``h200`` (passively
cooled, T.Limit thresholds, row remapping; after the H200 capture) and ``t4`` (Tesla T4: passive,
70 W, page retirement instead of row remapping).

``scenarios()`` names one scripted situation per anomaly rule, plus a healthy node per profile, for
the demo and the scenario tests.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.model import (
    CLOCKS,
    CLOCKS_EVENT_REASON_BITS,
    CLOCKS_EVENT_TIME_REASONS,
    FEATURES,
    DiscoveredGpu,
    DriverInfo,
    FanReading,
    FastSample,
    GpuIdentity,
    SlowSample,
    XidEvent,
    decode_clocks_event_reasons,
)

#: Integration step of the physics, in seconds. Readings are the state at the last step boundary.
STEP_SECONDS = 1.0
#: The simulated driver, as ``open()`` reports it (the H200 capture's versions).
DRIVER_INFO = DriverInfo(
    driver_version="590.48.01", nvml_version="13.590.48.01", cuda_driver_version="13.1"
)
MAX_GPUS = 256
_MIB = 1024 * 1024
_ALL_REASONS = sum(CLOCKS_EVENT_REASON_BITS.values())
# Longest real-time slice of a wait_events wait, so that events coming due are seen promptly.
_EVENT_POLL_SECONDS = 0.25
# Real-time re-check period of a read blocked by a "hang" fault.
_HANG_POLL_SECONDS = 0.005


# --------------------------------------------------------------------------------------- profiles


@dataclass(frozen=True, slots=True)
class Profile:
    """Static facts and physics constants of one simulated GPU model."""

    key: str
    name: str
    architecture: str
    vbios_version: str
    serial_prefix: str
    memory_total_mib: int
    memory_reserved_mib: int
    idle_watts: float
    full_load_watts: float  # draw at 100 % utilization and full clocks, before the power cap
    power_limit_watts: Mapping[str, float]  # enforced, default, min, max
    clock_max_mhz: Mapping[str, float]
    clock_idle_mhz: Mapping[str, float]
    busy_pstate: int
    idle_pstate: int
    ambient_celsius: float
    thermal_time_constant_seconds: float
    resistance_fans_stopped: float  # °C/W; the only value for a passively cooled GPU
    resistance_fans_full: float  # °C/W at 100 % fan
    fan_count: int
    fan_max_rpm: float
    fan_time_constant_seconds: float
    gpu_max_celsius: float  # max operating temperature (T.Limit 0)
    slowdown_celsius: float
    shutdown_celsius: float
    threshold_scale: str  # "absolute" (NVML thresholds in °C) or "tlimit" (margin scale)
    memory_max_tlimit: float | None  # memory max-operating threshold on the T.Limit scale
    memory_temperature: tuple[float, float] | None  # (offset, slope) of memory vs GPU temperature
    pcie_max_generation: int
    pcie_idle_generation: int
    pcie_width: int
    clocks_event_time_reasons: tuple[str, ...]
    ecc: bool
    remapped_rows: bool
    retired_pages: bool

    @property
    def features(self) -> dict[str, bool]:
        """Feature -> supported, exactly what the samples of this profile contain."""
        supported = {
            "clocks_event_reasons": True,
            "clocks_event_time": bool(self.clocks_event_time_reasons),
            "ecc": self.ecc,
            "energy": True,
            "fan": self.fan_count > 0,
            "fan_rpm": self.fan_count > 0,
            "fan_target": self.fan_count > 0,
            "memory_temperature": self.memory_temperature is not None,
            "pcie": True,
            "power": True,
            "power_limit": True,
            "remapped_rows": self.remapped_rows,
            "retired_pages": self.retired_pages,
            "temperature_margin": self.threshold_scale == "tlimit",
            "utilization": True,
            "xid_events": True,
        }
        return {feature: supported[feature] for feature in FEATURES}


RTX6000 = Profile(
    key="rtx6000",
    name="NVIDIA RTX 6000 Ada Generation",
    architecture="ada",  # as the NVML backend names NVML_DEVICE_ARCH_ADA
    vbios_version="95.02.5D.00.01",
    serial_prefix="1325",
    # 48 GB GDDR6 with ECC enabled, as the L40S (same AD102 board) reports it.
    memory_total_mib=46068,
    memory_reserved_mib=609,
    idle_watts=24.0,
    full_load_watts=330.0,
    power_limit_watts={"enforced": 300.0, "default": 300.0, "min": 100.0, "max": 300.0},
    clock_max_mhz={"graphics": 2505.0, "sm": 2505.0, "memory": 10001.0, "video": 1965.0},
    clock_idle_mhz={"graphics": 210.0, "sm": 210.0, "memory": 405.0, "video": 1185.0},
    busy_pstate=0,
    idle_pstate=8,
    ambient_celsius=25.0,
    thermal_time_constant_seconds=60.0,
    resistance_fans_stopped=0.21,
    resistance_fans_full=0.10,
    fan_count=1,  # one blower
    fan_max_rpm=4800.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=90.0,
    slowdown_celsius=95.0,
    shutdown_celsius=100.0,
    threshold_scale="absolute",
    memory_max_tlimit=None,
    memory_temperature=None,
    pcie_max_generation=4,
    pcie_idle_generation=1,
    pcie_width=16,
    clocks_event_time_reasons=(
        "sw_power_cap",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "thermal",
    ),
    ecc=True,
    remapped_rows=False,
    retired_pages=False,
)

H200 = Profile(
    key="h200",
    name="NVIDIA H200",
    architecture="hopper",
    vbios_version="96.00.A5.00.03",
    serial_prefix="1654",
    memory_total_mib=143771,
    memory_reserved_mib=614,
    idle_watts=77.0,
    full_load_watts=740.0,
    power_limit_watts={"enforced": 700.0, "default": 700.0, "min": 200.0, "max": 700.0},
    clock_max_mhz={"graphics": 1980.0, "sm": 1980.0, "memory": 3201.0, "video": 1545.0},
    clock_idle_mhz={"graphics": 345.0, "sm": 345.0, "memory": 3201.0, "video": 765.0},
    busy_pstate=0,
    idle_pstate=0,  # the capture shows P0 at idle too
    ambient_celsius=25.0,
    thermal_time_constant_seconds=60.0,
    # 28 °C at 77 W and 52 °C at 628 W in the capture: about 25 °C + 0.044 °C/W.
    resistance_fans_stopped=0.044,
    resistance_fans_full=0.044,
    fan_count=0,
    fan_max_rpm=0.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=87.0,
    slowdown_celsius=89.0,
    shutdown_celsius=95.0,
    threshold_scale="tlimit",
    memory_max_tlimit=0.0,
    memory_temperature=(21.5, 0.375),  # 28 -> 32 °C idle, 52 -> 41 °C under load
    pcie_max_generation=5,
    pcie_idle_generation=5,  # the capture shows gen 5 at idle
    pcie_width=16,
    clocks_event_time_reasons=CLOCKS_EVENT_TIME_REASONS,
    ecc=True,
    remapped_rows=True,
    retired_pages=False,
)

# A passively cooled 70 W Turing card: the one profile with page retirement (pre-Ampere GPUs
# retire pages; A100 and newer remap rows instead) and with a GDDR memory that has no sensor. No
# capture of a T4 is on file: the values are the board's published ones (70 W, 16 GB GDDR6, PCIe
# gen 3) and the thresholds nvidia-smi prints for it (shutdown 96, slowdown 93, max operating 85 C).
T4 = Profile(
    key="t4",
    name="Tesla T4",
    architecture="turing",
    vbios_version="90.04.38.00.03",
    serial_prefix="1322",
    memory_total_mib=15360,
    memory_reserved_mib=257,
    idle_watts=10.0,
    full_load_watts=76.0,
    power_limit_watts={"enforced": 70.0, "default": 70.0, "min": 60.0, "max": 70.0},
    clock_max_mhz={"graphics": 1590.0, "sm": 1590.0, "memory": 5001.0, "video": 1470.0},
    clock_idle_mhz={"graphics": 300.0, "sm": 300.0, "memory": 405.0, "video": 540.0},
    busy_pstate=0,
    idle_pstate=8,
    ambient_celsius=25.0,
    thermal_time_constant_seconds=50.0,
    # about 30 C idle and 60 C at 70 W in a server with adequate airflow
    resistance_fans_stopped=0.5,
    resistance_fans_full=0.5,
    fan_count=0,
    fan_max_rpm=0.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=85.0,
    slowdown_celsius=93.0,
    shutdown_celsius=96.0,
    threshold_scale="absolute",
    memory_max_tlimit=None,
    memory_temperature=None,
    pcie_max_generation=3,
    pcie_idle_generation=1,
    pcie_width=16,
    clocks_event_time_reasons=RTX6000.clocks_event_time_reasons,
    ecc=True,
    remapped_rows=False,
    retired_pages=True,
)

PROFILES: Mapping[str, Profile] = {p.key: p for p in (RTX6000, H200, T4)}


def _fan_curve(temperature: float) -> float:
    """Target fan speed ratio: 30 % up to 40 °C, linear to 100 % at 85 °C."""
    return min(1.0, max(0.30, 0.30 + 0.70 * (temperature - 40.0) / 45.0))


# ----------------------------------------------------------------------------------------- faults


@dataclass(slots=True)
class Conditions:
    """Inputs of one physics step of one GPU; fault kinds modify them while active."""

    utilization: float
    memory_fraction: float  # of the usable frame buffer the running job wants
    memory_intensity: float  # memory-engine utilization per unit of GPU utilization
    resistance_factor: float = 1.0
    fan_stalled: bool = False
    power_brake: bool = False
    hw_slowdown: bool = False  # HW slowdown that is neither thermal nor a power brake
    clock_cap: float = 1.0
    lost: bool = False
    fan_ratio: float = 1.0  # the fan reaches this share of its target
    pcie_width: int | None = None  # link trained down to this many lanes
    pcie_generation: int | None = None  # link trained down to this generation
    replays_per_second: float = 0.0


@dataclass(slots=True)
class Health:
    """Health counters of one GPU that fault onsets and ends change."""

    ecc: dict[tuple[str, str], int]
    remapped_rows: dict[str, int]
    remapped_rows_pending: bool = False
    remapped_rows_failed: bool = False
    retired_pages_pending: bool = False
    pcie_replays: float = 0.0


@dataclass(frozen=True, slots=True)
class FaultKind:
    """What one kind of fault does. Every hook is optional."""

    description: str
    params: Mapping[str, float] = field(default_factory=dict)  # name -> default
    requires: tuple[str, ...] = ()  # features the GPU must support
    # every step while active: (fault, conditions, seconds since this occurrence began)
    during: Callable[[Fault, Conditions, float], None] | None = None
    onset: Callable[[Fault, Health, Profile], None] | None = None
    end: Callable[[Fault, Health, Profile], None] | None = None
    # XID code emitted through wait_events at each onset (None or 0: none)
    xid: Callable[[Fault], int | None] | None = None
    # What it does to the backend itself rather than to one GPU's physics: "unavailable" (every
    # call raises BackendUnavailable, node-wide), "hang" (reads block, node-wide) or "unlisted"
    # (the GPU is left out of discovery and its reads raise DeviceLost).
    backend: str | None = None

    @property
    def node_level(self) -> bool:
        """Node-wide kinds ignore the fault's ``gpu`` (use 0)."""
        return self.backend in ("unavailable", "hang")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault on one GPU, active from ``start_seconds`` to ``end_seconds`` after ``open()``.

    ``end_seconds=None`` means it never ends. With ``repeat_seconds`` the window recurs every that
    many seconds (occurrence n covers [start + n·repeat, end + n·repeat)). ``params`` override the
    kind's defaults (see ``FAULT_KINDS``).
    """

    kind: str
    gpu: int
    start_seconds: float
    end_seconds: float | None = None
    params: Mapping[str, float] = field(default_factory=dict, hash=False)
    repeat_seconds: float | None = None

    def __post_init__(self) -> None:
        spec = FAULT_KINDS.get(self.kind)
        if spec is None:
            raise ValueError(
                f"unknown fault kind {self.kind!r}; known kinds: {', '.join(sorted(FAULT_KINDS))}"
            )
        if not isinstance(self.gpu, int) or isinstance(self.gpu, bool) or self.gpu < 0:
            raise ValueError(f"fault {self.kind}: gpu must be a GPU index >= 0, got {self.gpu!r}")
        if not _is_number(self.start_seconds) or self.start_seconds < 0:
            raise ValueError(f"fault {self.kind}: start_seconds must be >= 0")
        if self.end_seconds is not None and (
            not _is_number(self.end_seconds) or self.end_seconds <= self.start_seconds
        ):
            raise ValueError(f"fault {self.kind}: end_seconds must be after start_seconds")
        if self.repeat_seconds is not None:
            if not _is_number(self.repeat_seconds) or self.repeat_seconds <= 0:
                raise ValueError(f"fault {self.kind}: repeat_seconds must be > 0")
            if self.end_seconds is None:
                raise ValueError(f"fault {self.kind}: a repeating fault needs end_seconds")
            if self.end_seconds - self.start_seconds > self.repeat_seconds:
                raise ValueError(f"fault {self.kind}: its window is longer than repeat_seconds")
        unknown = set(self.params) - set(spec.params)
        if unknown:
            allowed = ", ".join(sorted(spec.params)) or "none"
            raise ValueError(
                f"fault {self.kind}: unknown params {sorted(unknown)}; allowed: {allowed}"
            )
        for name, value in self.params.items():
            if not _is_number(value):
                raise ValueError(f"fault {self.kind}: param {name} must be a number")
        object.__setattr__(self, "params", {**spec.params, **self.params})

    def since_onset(self, t: float) -> float | None:
        """Seconds since the current occurrence began, or None when not active at ``t``."""
        if t < self.start_seconds:
            return None
        local = t - self.start_seconds
        if self.repeat_seconds is not None:
            local %= self.repeat_seconds
        end = math.inf if self.end_seconds is None else self.end_seconds - self.start_seconds
        return local if local < end else None

    def onsets_between(self, after: float, until: float) -> list[float]:
        """Onset times ``o`` with ``after < o <= until``."""
        if self.repeat_seconds is None:
            return [self.start_seconds] if after < self.start_seconds <= until else []
        n = max(0, math.floor((after - self.start_seconds) / self.repeat_seconds) + 1)
        onsets = []
        while (onset := self.start_seconds + n * self.repeat_seconds) <= until:
            if onset > after:
                onsets.append(onset)
            n += 1
        return onsets


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _load(fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = fault.params["utilization"]
    c.memory_fraction = fault.params["memory_fraction"] if c.utilization > 0 else 0.0
    c.memory_intensity = 0.35


def _idle_allocation(fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = 0.0
    c.memory_fraction = fault.params["memory_fraction"]
    c.memory_intensity = 0.0


def _fan_stall(_fault: Fault, c: Conditions, _since: float) -> None:
    c.fan_stalled = True


def _cooling_failure(fault: Fault, c: Conditions, since: float) -> None:
    ramp = fault.params["ramp_seconds"]
    progress = 1.0 if ramp <= 0 else min(1.0, since / ramp)
    c.resistance_factor *= 1.0 + (fault.params["factor"] - 1.0) * progress


def _fell_off_bus(_fault: Fault, c: Conditions, _since: float) -> None:
    c.lost = True


def _power_brake(fault: Fault, c: Conditions, _since: float) -> None:
    c.power_brake = True
    c.clock_cap = min(c.clock_cap, fault.params["clock_factor"])


def _ecc_onset(fault: Fault, health: Health, profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("uncorrected", "volatile")] += count
    health.ecc[("uncorrected", "aggregate")] += count
    if profile.remapped_rows:
        health.remapped_rows["uncorrectable"] += 1
        health.remapped_rows_pending = True


def _ecc_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    # The end of the window is the GPU reset that applies the remap: pending clears and the
    # volatile counters start again from 0, the aggregate ones keep the count.
    health.remapped_rows_pending = False
    health.ecc[("corrected", "volatile")] = 0
    health.ecc[("uncorrected", "volatile")] = 0


def _xid_param(fault: Fault) -> int | None:
    return int(fault.params["xid"]) or None


def _fan_lag(fault: Fault, c: Conditions, _since: float) -> None:
    c.fan_ratio = min(c.fan_ratio, fault.params["ratio"])


def _hw_slowdown(fault: Fault, c: Conditions, _since: float) -> None:
    c.hw_slowdown = True
    c.clock_cap = min(c.clock_cap, fault.params["clock_factor"])


def _pcie_downtrain(fault: Fault, c: Conditions, _since: float) -> None:
    width, generation = int(fault.params["width"]), int(fault.params["generation"])
    if width > 0:
        c.pcie_width = width if c.pcie_width is None else min(c.pcie_width, width)
    if generation > 0:
        c.pcie_generation = generation if c.pcie_generation is None else min(c.pcie_generation, generation)


def _pcie_replays(fault: Fault, c: Conditions, _since: float) -> None:
    c.replays_per_second += fault.params["per_minute"] / 60.0


def _pcie_replays_end(fault: Fault, health: Health, _profile: Profile) -> None:
    if fault.params["reset_at_end"]:
        health.pcie_replays = 0.0


def _row_remap_pending_onset(fault: Fault, health: Health, profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("corrected", "volatile")] += count
    health.ecc[("corrected", "aggregate")] += count
    health.remapped_rows["correctable"] += 1
    health.remapped_rows_pending = True


def _row_remap_failure_onset(_fault: Fault, health: Health, _profile: Profile) -> None:
    health.remapped_rows_failed = True


def _row_remap_failure_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    health.remapped_rows_failed = False


def _retired_pages_onset(fault: Fault, health: Health, _profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("corrected", "volatile")] += count
    health.ecc[("corrected", "aggregate")] += count
    health.retired_pages_pending = True


def _reset_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    # The end of the window is the GPU reset (or reboot) that applies the remap or retirement:
    # pending clears and the volatile counters start again from 0.
    health.remapped_rows_pending = False
    health.retired_pages_pending = False
    health.ecc[("corrected", "volatile")] = 0
    health.ecc[("uncorrected", "volatile")] = 0


#: kind -> what it does. Add a scenario by adding an entry.
FAULT_KINDS: dict[str, FaultKind] = {
    "load": FaultKind(
        "Scenario shaping, not an anomaly: force the utilization (default 1.0 = a burn job; 0 = "
        "idle) and the share of the frame buffer in use.",
        params={"utilization": 1.0, "memory_fraction": 0.4},
        during=_load,
    ),
    "idle_allocation": FaultKind(
        "A job holds the GPU and its memory but computes nothing (a notebook left open, a job "
        "waiting on I/O or a lock): utilization 0 with the frame buffer in use.",
        params={"memory_fraction": 0.3},
        during=_idle_allocation,
    ),
    "fan_stall": FaultKind(
        "The fans stop: speed and RPM fall to 0 within seconds while the target keeps following "
        "the (rising) temperature; cooling falls to its fans-stopped value.",
        requires=("fan",),
        during=_fan_stall,
    ),
    "cooling_failure": FaultKind(
        "Clogged heatsink or failed chassis fan: thermal resistance rises to `factor` times normal "
        "over `ramp_seconds`. Under load the GPU reaches its slowdown threshold and throttles.",
        params={"factor": 4.0, "ramp_seconds": 60.0},
        during=_cooling_failure,
    ),
    "fell_off_bus": FaultKind(
        "The GPU falls off the bus: reads raise DeviceLost, XID 79 at onset, its job dies; at the "
        "end it answers again.",
        during=_fell_off_bus,
        xid=lambda _fault: 79,
    ),
    "xid": FaultKind(
        "One XID event with code `xid` at onset; nothing else changes.",
        params={"xid": 13.0},
        requires=("xid_events",),
        xid=_xid_param,
    ),
    "power_brake": FaultKind(
        "External power brake: hw_power_brake_slowdown and hw_slowdown active, clocks cut to "
        "`clock_factor` of maximum, power falls.",
        params={"clock_factor": 0.3},
        during=_power_brake,
    ),
    "ecc_uncorrectable": FaultKind(
        "`count` uncorrectable ECC errors at onset (volatile and aggregate) and, where supported, "
        "one uncorrectable remapped row pending until the end of the window (the GPU reset, which "
        "also zeroes the volatile counters). XID `xid` at onset (94, contained ECC error; "
        "0: none).",
        params={"count": 2.0, "xid": 94.0},
        requires=("ecc",),
        onset=_ecc_onset,
        end=_ecc_end,
        xid=_xid_param,
    ),
    "fan_lag": FaultKind(
        "Worn fan bearing or a failing fan controller: the fan reaches only `ratio` of its target "
        "speed (RPM likewise); it keeps turning, and the GPU runs hotter.",
        params={"ratio": 0.4},
        requires=("fan",),
        during=_fan_lag,
    ),
    "hw_slowdown": FaultKind(
        "HW slowdown that is neither thermal nor a power brake (the fast-trigger over-power "
        "protection, EDPp): hw_slowdown active, clocks cut to `clock_factor` of maximum. A short "
        "repeating window makes the brief flashes seen during clock changes.",
        params={"clock_factor": 0.5},
        during=_hw_slowdown,
    ),
    "pcie_downtrain": FaultKind(
        "The PCIe link trains below its maximum (a bad riser, a dirty slot): current width "
        "`width` lanes and, when `generation` > 0, that generation, whether busy or idle (0: "
        "unchanged).",
        params={"width": 8.0, "generation": 0.0},
        requires=("pcie",),
        during=_pcie_downtrain,
    ),
    "pcie_replays": FaultKind(
        "A marginal PCIe link: the replay counter grows by `per_minute` replays a minute. With "
        "`reset_at_end` (1) the end of the window is the GPU reset after reseating the card, which "
        "zeroes the counter; with 0 the counter just stops growing.",
        params={"per_minute": 30.0, "reset_at_end": 1.0},
        requires=("pcie",),
        during=_pcie_replays,
        end=_pcie_replays_end,
    ),
    "row_remap_pending": FaultKind(
        "A row is remapped after `count` correctable errors in it (XID `xid`, 63: recording "
        "event): remapped rows correctable +1 and a remap pending until the end of the window "
        "(the GPU reset, which also zeroes the volatile counters). No uncorrectable error.",
        params={"count": 3.0, "xid": 63.0},
        requires=("ecc", "remapped_rows"),
        onset=_row_remap_pending_onset,
        end=_reset_end,
        xid=_xid_param,
    ),
    "row_remap_failure": FaultKind(
        "A row remapping fails (no spare rows left in the bank): remapped_rows_failed from onset "
        "to the end of the window (the end stands for the repair), XID `xid` (64) at onset.",
        params={"xid": 64.0},
        requires=("remapped_rows",),
        onset=_row_remap_failure_onset,
        end=_row_remap_failure_end,
        xid=_xid_param,
    ),
    "retired_pages_pending": FaultKind(
        "Pre-Ampere page retirement: after `count` correctable errors on one page it is marked for "
        "retirement at the next reboot (XID `xid`, 63); pending until the end of the window (the "
        "reboot, which also zeroes the volatile counters).",
        params={"count": 3.0, "xid": 63.0},
        requires=("ecc", "retired_pages"),
        onset=_retired_pages_onset,
        end=_reset_end,
        xid=_xid_param,
    ),
    "backend_down": FaultKind(
        "Node-wide (gpu is ignored, use 0): the driver is unloaded or reloading. open(), "
        "discover(), the reads and wait_events raise BackendUnavailable(driver_not_loaded) while "
        "active; afterwards the node answers again.",
        backend="unavailable",
    ),
    "hang": FaultKind(
        "Node-wide (gpu is ignored, use 0): NVML calls hang, as with a wedged driver. read_fast and "
        "read_slow block until the window is over by the injected clock (re-checked every few "
        "milliseconds of real time) or close(). With a FakeClock, run the poll on another thread.",
        backend="hang",
    ),
    "unlisted": FaultKind(
        "The GPU drops off the PCI bus without a trace: its reads raise DeviceLost and discovery "
        "leaves it out while active. The poller notices the smaller count at its next discovery, "
        "so combine it with a short backend_down (a driver reload) at both ends of the window.",
        backend="unlisted",
    ),
}

#: How long the demo tour takes before everything is back to normal.
DEMO_TOUR_SECONDS = 330.0


def demo_tour(
    period_seconds: float = 600.0, gpu_count: int = 8, profile: str = "rtx6000"
) -> list[Fault]:
    """The scripted tour of the demo, repeating every ``period_seconds``.

    ====================  =========================================================================
    0–20 s                all GPUs run their normal jobs
    20–210 s   (GPU 2)    a burn job; its fan stalls at 30 s (speed → 0 while the target climbs
                          and the GPU heats) and spins again at 200 s. Fanless profiles get a
                          power brake at 30–120 s instead.
    100–330 s  (GPU 5)    a burn job; its cooling fails from 110 s (4× thermal resistance, ramped
                          over 60 s): it reaches its slowdown threshold and throttles, clocks
                          halved, until the cooling comes back at 320 s
    240–330 s  (GPU 7)    falls off the bus: XID 79 at 240 s, DeviceLost until it returns at 330 s
    330 s–period          everything normal again
    ====================  =========================================================================

    With fewer than 8 GPUs the last three GPUs play these parts.
    """
    if not _is_number(period_seconds) or period_seconds < DEMO_TOUR_SECONDS:
        raise ValueError(f"demo tour period must be at least {DEMO_TOUR_SECONDS:.0f} s")
    if not isinstance(gpu_count, int) or gpu_count < 3:
        raise ValueError("the demo tour needs at least 3 GPUs")
    if profile not in PROFILES:
        raise ValueError(_unknown_profile(profile))
    if gpu_count >= 8:
        fan_gpu, hot_gpu, lost_gpu = 2, 5, 7
    else:
        fan_gpu, hot_gpu, lost_gpu = gpu_count - 3, gpu_count - 2, gpu_count - 1
    p = period_seconds

    def f(kind: str, gpu: int, start: float, end: float, **params: float) -> Fault:
        return Fault(kind, gpu, start, end, params=params, repeat_seconds=p)

    if PROFILES[profile].fan_count:
        first = [f("load", fan_gpu, 20, 210), f("fan_stall", fan_gpu, 30, 200)]
    else:
        first = [f("load", fan_gpu, 20, 210), f("power_brake", fan_gpu, 30, 120)]
    return [
        *first,
        f("load", hot_gpu, 100, 330),
        f("cooling_failure", hot_gpu, 110, 320),
        f("fell_off_bus", lost_gpu, 240, 330),
    ]


# -------------------------------------------------------------------------------------- scenarios


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named, scripted situation: one anomaly rule's textbook case, or a healthy node.

    The node runs ``faults`` (times in seconds after ``open()``) for ``duration_seconds``. With
    ``rule`` set, that rule is expected to start firing on GPU ``gpu`` (for a node rule: on the
    node, ``gpu`` being the GPU whose anomalies are its expected consequences, or None) once the
    fault has begun (``onset_seconds``), its condition has had time to appear (``latency_seconds``:
    the physics and the polling, e.g. minutes for a GPU to heat up, up to one 30 s slow poll for a
    health flag, half a window for a windowed share) and the rule's hold time has passed; and to
    resolve once the cause is gone (``end_seconds``, then ``recovery_seconds`` until the condition
    is false) and its clear time has passed. Other warning/critical anomalies may follow on that
    same GPU (a hot GPU is also throttled), never on another one. A healthy scenario (``rule``
    None) fires nothing of severity warning or critical.
    """

    name: str
    description: str
    profile: str
    gpu_count: int
    faults: tuple[Fault, ...]
    duration_seconds: float
    rule: str | None = None
    gpu: int | None = None
    onset_seconds: float = 0.0
    latency_seconds: float = 0.0
    end_seconds: float | None = None
    recovery_seconds: float = 0.0
    seed: int = 0

    def backend(self, clock: Clock) -> SimulatedBackend:
        """A fresh simulated node playing this scenario."""
        return SimulatedBackend(
            clock, gpu_count=self.gpu_count, profile=self.profile, faults=self.faults, seed=self.seed
        )

    def fires_by(self, hold_seconds: float, poll_seconds: float = 2.0) -> float | None:
        """Latest time (s after open) the expected anomaly may start firing: onset + latency + hold
        + two polls (one to see the condition, one of rounding to the poll grid)."""
        if self.rule is None:
            return None
        return self.onset_seconds + self.latency_seconds + hold_seconds + 2 * poll_seconds

    def resolves_by(self, clear_seconds: float, poll_seconds: float = 2.0) -> float | None:
        """Latest time the expected anomaly may still be firing: end + recovery + clear + two polls."""
        if self.rule is None or self.end_seconds is None:
            return None
        return self.end_seconds + self.recovery_seconds + clear_seconds + 2 * poll_seconds


def _burn(gpu: int, start: float, end: float | None, utilization: float = 1.0) -> Fault:
    return Fault("load", gpu, start, end, params={"utilization": utilization})


def _healthy(profile: str, gpu_count: int) -> Scenario:
    slow_cap = {"rtx6000": 0.6, "h200": 0.7, "t4": 0.6}[profile]
    return Scenario(
        name=f"healthy-{profile}",
        description=(
            f"A healthy {PROFILES[profile].name} node for 30 minutes: GPU 0 idles for 5 minutes, "
            "then runs a burn job at its power cap for 10 minutes, then idles; GPU 1 runs a job "
            "below the cap for 20 minutes; GPU 2 idles for 15 minutes (PCIe downshifts where the "
            "board does that); GPU 3 runs its normal jobs with a 2 s hw_slowdown flash every "
            "minute (clock changes). Only info anomalies (power_capped) may fire."
        ),
        profile=profile,
        gpu_count=gpu_count,
        faults=(
            _burn(0, 0, 300, 0.0),
            _burn(0, 300, 900),
            _burn(0, 900, 1200, 0.0),
            _burn(1, 0, 1200, slow_cap),
            _burn(2, 0, 900, 0.0),
            Fault("hw_slowdown", 3, 45, 47, repeat_seconds=60),
        ),
        duration_seconds=1800.0,
    )


def scenarios() -> dict[str, Scenario]:
    """Every scenario by name: one per anomaly rule (named after it) and a healthy one per profile."""
    def one(rule: str, description: str, profile: str, faults: Sequence[Fault], *, gpu: int | None,
            latency: float, end: float | None, recovery: float = 0.0, onset: float = 120.0,
            gpu_count: int = 4, duration: float | None = None) -> Scenario:
        if duration is None:
            duration = (end or onset) + recovery + 240.0
        return Scenario(rule, description, profile, gpu_count, tuple(faults), duration, rule, gpu,
                        onset, latency, end, recovery)

    cases = [
        _healthy("rtx6000", 4),
        _healthy("h200", 4),
        _healthy("t4", 4),
        one("fan_stalled",
            "GPU 2 runs a burn job; at 2 min its fan stops (0 RPM) while the driver keeps asking for "
            "more and the GPU heats; it spins again at 6 min.",
            "rtx6000", [_burn(2, 0, 600), Fault("fan_stall", 2, 120, 360)],
            gpu=2, latency=4, end=360, recovery=4),
        one("fan_not_tracking",
            "GPU 1 runs a burn job; from 2 min its worn fan reaches only 40 % of its target speed "
            "(it turns, but far too slowly) until 8 min.",
            "rtx6000", [_burn(1, 0, 720), Fault("fan_lag", 1, 120, 480, params={"ratio": 0.4})],
            gpu=1, latency=25, end=480, recovery=25),
        one("fan_at_max",
            "GPU 1 runs a burn job; from 2 min its heatsink clogs (2.1× thermal resistance): the fan "
            "runs at 100 % and the GPU still sits a few degrees under its slowdown threshold, until "
            "the heatsink is cleaned at 10 min.",
            "rtx6000", [_burn(1, 0, 900),
                        Fault("cooling_failure", 1, 120, 600, params={"factor": 2.1, "ramp_seconds": 60})],
            gpu=1, latency=150, end=600, recovery=90),
        one("overheating",
            "Passively cooled H200s: GPU 1 runs a burn job; from 2 min its airflow halves (2× "
            "thermal resistance): it settles within 5 °C of its slowdown threshold (T.Limit scale) "
            "until the airflow is back at 10 min.",
            "h200", [_burn(1, 0, 900),
                     Fault("cooling_failure", 1, 120, 600, params={"factor": 2.0, "ramp_seconds": 60})],
            gpu=1, latency=200, end=600, recovery=90),
        one("thermal_runaway",
            "H200 GPU 2 runs a burn job; from 2 min its cooling degrades steadily over 5 minutes "
            "(to 2.5× thermal resistance): the temperature climbs toward slowdown at several °C a "
            "minute, the GPU throttles, and the cooling is restored at 10 min.",
            "h200", [_burn(2, 0, 900),
                     Fault("cooling_failure", 2, 120, 600, params={"factor": 2.5, "ramp_seconds": 300})],
            gpu=2, latency=200, end=600, recovery=60),
        one("thermal_throttling",
            "RTX 6000 GPU 0 runs a burn job; at 2 min its cooling fails (4× thermal resistance): it "
            "reaches slowdown within a minute and the HW and SW thermal slowdowns hold the clocks "
            "down until the cooling is back at 8 min.",
            "rtx6000", [_burn(0, 0, 900), Fault("cooling_failure", 0, 120, 480)],
            gpu=0, latency=70, end=480, recovery=90),
        one("thermal_outlier",
            "Four passively cooled H200s all run burn jobs at their 700 W cap; from 2 min GPU 2's "
            "airflow is partly blocked (1.7× thermal resistance): it runs about 20 °C hotter than "
            "its peers, still well below slowdown, until 16 min.",
            "h200", [*(_burn(g, 0, 1300) for g in range(4)),
                     Fault("cooling_failure", 2, 120, 960, params={"factor": 1.7, "ramp_seconds": 60})],
            gpu=2, latency=150, end=960, recovery=90),
        one("power_brake",
            "H200 GPU 1 runs a burn job; from 2 to 6 min the PSU asserts the external power brake: "
            "clocks cut to 30 %.",
            "h200", [_burn(1, 0, 600), Fault("power_brake", 1, 120, 360)],
            gpu=1, latency=2, end=360, recovery=30),
        one("hw_slowdown",
            "H200 GPU 3 runs a burn job; from 2 to 6 min HW slowdown holds its clocks at half "
            "without a thermal or power-brake reason (fast-trigger over-power protection).",
            "h200", [_burn(3, 0, 600), Fault("hw_slowdown", 3, 120, 360)],
            gpu=3, latency=16, end=360, recovery=16),
        one("power_capped",
            "RTX 6000 GPU 0 idles, runs a burn job from 2 to 8 min at its 300 W cap, and idles again "
            "(info only: this is normal at full load).",
            "rtx6000", [_burn(0, 0, 120, 0.0), _burn(0, 120, 480), _burn(0, 480, None, 0.0),
                        _burn(1, 0, 600, 0.0)],
            gpu=0, latency=32, end=480, recovery=32, gpu_count=2),
        one("gpu_lost",
            "H200 GPU 1 falls off the bus at 2 min (XID 79, every query answers GPU_IS_LOST) and is "
            "back at 6 min.",
            "h200", [Fault("fell_off_bus", 1, 120, 360)],
            gpu=1, latency=2, end=360, recovery=2),
        one("xid_critical",
            "H200 GPU 2 reports XID 48 (double-bit ECC error) at 2 min; GPUs 0, 1 and 3 report the "
            "application faults XID 13, 31 and 43, which never fire. The anomaly ends 15 minutes "
            "after the event (the rule's lookback).",
            "h200", [Fault("xid", 2, 120, params={"xid": 48}), Fault("xid", 0, 100, params={"xid": 13}),
                     Fault("xid", 1, 110, params={"xid": 31}), Fault("xid", 3, 130, params={"xid": 43})],
            gpu=2, latency=2, end=1020, recovery=2, duration=1140),
        one("ecc_uncorrectable",
            "H200 GPU 0 sees 2 uncorrectable ECC errors at 2 min (XID 94, contained; a row remap "
            "becomes pending); the GPU is reset at 8 min, which zeroes the volatile counters.",
            "h200", [Fault("ecc_uncorrectable", 0, 120, 480)],
            gpu=0, latency=30, end=480, recovery=30),
        one("row_remap_failed",
            "H200 GPU 1 fails to remap a memory row at 2 min (XID 64); the board is repaired at 8 min.",
            "h200", [Fault("row_remap_failure", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("row_remap_pending",
            "H200 GPU 2 remaps a row after correctable errors at 2 min (XID 63, no uncorrectable "
            "error); the remap is pending until the GPU is reset at 8 min.",
            "h200", [Fault("row_remap_pending", 2, 120, 480)],
            gpu=2, latency=30, end=480, recovery=30),
        one("retired_pages_pending",
            "Tesla T4 GPU 1 marks a page for retirement after correctable errors at 2 min (XID 63); "
            "it is retired at the reboot at 8 min.",
            "t4", [Fault("retired_pages_pending", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("pcie_link_degraded",
            "RTX 6000 GPU 3 runs a burn job with its PCIe link trained down to x8 from 2 to 8 min; "
            "GPU 1, idle, has the same x8 link and its usual idle downshift to gen 1, which never "
            "fires.",
            "rtx6000", [_burn(3, 0, 720), Fault("pcie_downtrain", 3, 120, 480),
                        _burn(1, 0, 720, 0.0), Fault("pcie_downtrain", 1, 120, 480)],
            gpu=3, latency=30, end=480, recovery=30),
        one("pcie_replays_rising",
            "H200 GPU 0's PCIe link replays 30 times a minute from 2 min; the card is reseated and "
            "reset at 8 min; the replay rate over the 5-minute lookback falls below 8/min some 4 minutes later.",
            "h200", [Fault("pcie_replays", 0, 120, 480)],
            gpu=0, latency=110, end=480, recovery=240),
        one("allocated_idle",
            "RTX 6000 GPU 1 is held by a job that keeps 30 % of the frame buffer but computes nothing "
            "from 2 to 36 min (a notebook left open); the others run their normal jobs.",
            "rtx6000", [Fault("idle_allocation", 1, 120, 2160)],
            gpu=1, latency=60, end=2160, recovery=10),
        one("backend_down",
            "The driver of a 2-GPU H200 node is unloaded from 2 to 4 min: NVML cannot be used; the "
            "poller retries with capped exponential backoff and recovers by itself.",
            "h200", [Fault("backend_down", 0, 120, 240)],
            gpu=None, latency=2, end=240, recovery=60, gpu_count=2),
        one("collection_stalled",
            "NVML hangs on an H200 node from 2 to 3 min (a wedged driver): the fast poll in flight "
            "blocks, no poll completes, and the readings go stale.",
            "h200", [Fault("hang", 0, 120, 180)],
            gpu=None, latency=8, end=180, recovery=2),
        one("gpu_missing",
            "H200 GPU 3 drops off the PCI bus at 2 min and the driver is reloaded (4 s): the node now "
            "lists 3 GPUs of 4 (gpu_lost also fires on GPU 3, which stays listed as down). At 8 min "
            "it is back and a second reload lists it again.",
            "h200", [Fault("unlisted", 3, 120, 480), Fault("backend_down", 0, 120, 124),
                     Fault("backend_down", 0, 480, 484)],
            gpu=3, latency=8, end=480, recovery=8),
    ]
    return {case.name: case for case in cases}


# ---------------------------------------------------------------------------------------- physics


def _derive_seed(*parts: object) -> int:
    text = ":".join(str(p) for p in ("gpuwatch-simulated", *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True, slots=True)
class _Job:
    start: float
    end: float
    utilization: float
    memory_fraction: float
    memory_intensity: float


class _JobSchedule:
    """A GPU's seeded sequence of jobs, generated lazily. Queried with non-decreasing times."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._jobs: deque[_Job] = deque()
        self._horizon = self._rng.uniform(-240.0, 90.0)  # start of the next job to generate

    def at(self, t: float) -> _Job | None:
        while self._horizon <= t:
            rng = self._rng
            start = self._horizon
            end = start + rng.uniform(150.0, 900.0)
            self._jobs.append(
                _Job(
                    start,
                    end,
                    utilization=rng.uniform(0.6, 1.0),
                    memory_fraction=rng.uniform(0.1, 0.85),
                    memory_intensity=rng.uniform(0.05, 0.6),
                )
            )
            self._horizon = end + rng.uniform(20.0, 240.0)
        while self._jobs and self._jobs[0].end <= t:
            self._jobs.popleft()
        if self._jobs and self._jobs[0].start <= t:
            return self._jobs[0]
        return None


@dataclass(slots=True)
class _Gpu:
    """The evolving state of one simulated GPU."""

    index: int
    uuid: str
    profile: Profile
    faults: tuple[Fault, ...]
    jobs: _JobSchedule
    noise: random.Random
    ambient: float
    temperature: float
    energy: float
    health: Health
    step: int = -1
    fan_speed: float = 0.0
    fan_target: float = 0.0
    power: float = 0.0
    utilization: float = 0.0
    memory_utilization: float = 0.0
    memory_used_mib: float = 0.0
    clock_factor: float = 1.0
    busy: bool = False
    capped: bool = False
    sw_thermal: bool = False
    hw_thermal: bool = False
    power_brake: bool = False
    hw_slowdown: bool = False
    lost: bool = False
    pcie_width: int | None = None  # trained-down link (faults), else the profile's
    pcie_generation: int | None = None
    active_faults: set[int] = field(default_factory=set)
    event_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(CLOCKS_EVENT_TIME_REASONS, 0.0)
    )


def _new_gpu(index: int, uuid: str, profile: Profile, faults: tuple[Fault, ...], seed: int) -> _Gpu:
    rng = random.Random(_derive_seed(seed, index, "init"))
    ambient = profile.ambient_celsius + rng.uniform(-2.0, 3.0)
    idle_resistance = profile.resistance_fans_stopped
    if profile.fan_count:
        speed = _fan_curve(ambient)
        idle_resistance -= (profile.resistance_fans_stopped - profile.resistance_fans_full) * speed
    gpu = _Gpu(
        index=index,
        uuid=uuid,
        profile=profile,
        faults=faults,
        jobs=_JobSchedule(_derive_seed(seed, index, "jobs")),
        noise=random.Random(_derive_seed(seed, index, "noise")),
        ambient=ambient,
        temperature=ambient + profile.idle_watts * idle_resistance,
        energy=rng.uniform(1e7, 5e8),  # joules since the (simulated) driver load
        health=Health(
            ecc=dict.fromkeys(
                [(e, c) for e in ("corrected", "uncorrected") for c in ("volatile", "aggregate")], 0
            ),
            remapped_rows={"correctable": 0, "uncorrectable": 0},
        ),
    )
    if profile.fan_count:
        gpu.fan_target = gpu.fan_speed = _fan_curve(gpu.temperature)
    _step(gpu, 0.0, 0.0)
    gpu.step = 0
    return gpu


def _step(g: _Gpu, t: float, dt: float) -> None:
    """Advance ``g`` to time ``t`` (seconds since open) over a step of ``dt`` seconds."""
    p = g.profile
    jitter_util, jitter_power = g.noise.uniform(-1.0, 1.0), g.noise.uniform(-1.0, 1.0)

    job = g.jobs.at(t)
    if job is None:
        c = Conditions(utilization=0.0, memory_fraction=0.0, memory_intensity=0.0)
    else:
        c = Conditions(
            utilization=min(1.0, max(0.0, job.utilization + 0.03 * jitter_util)),
            memory_fraction=job.memory_fraction,
            memory_intensity=job.memory_intensity,
        )
    for i, fault in enumerate(g.faults):
        kind = FAULT_KINDS[fault.kind]
        since = fault.since_onset(t)
        if since is not None and i not in g.active_faults:
            g.active_faults.add(i)
            if kind.onset:
                kind.onset(fault, g.health, p)
        elif since is None and i in g.active_faults:
            g.active_faults.discard(i)
            if kind.end:
                kind.end(fault, g.health, p)
        if since is not None and kind.during:
            kind.during(fault, c, since)
    if c.lost:  # its processes died with it
        c.utilization = c.memory_fraction = 0.0

    util = min(1.0, max(0.0, c.utilization))
    busy = util > 0.0
    temp = g.temperature

    # thermal protection, with hysteresis
    if temp >= p.gpu_max_celsius:
        g.sw_thermal = True
    elif temp < p.gpu_max_celsius - 2.0:
        g.sw_thermal = False
    if temp >= p.slowdown_celsius:
        g.hw_thermal = True
    elif temp < p.slowdown_celsius - 5.0:
        g.hw_thermal = False
    factor = 1.0
    if g.sw_thermal:
        over = (temp - p.gpu_max_celsius) / (p.slowdown_celsius - p.gpu_max_celsius)
        factor = min(factor, 1.0 - 0.25 * min(1.0, max(0.0, over)))
    if g.hw_thermal:
        over = (temp - p.slowdown_celsius) / (p.shutdown_celsius - p.slowdown_celsius)
        factor = min(factor, 0.5 * min(1.0, max(0.3, 1.0 - 0.6 * over)))
    if c.power_brake or c.hw_slowdown:
        factor = min(factor, c.clock_cap)

    # power, capped at the enforced limit
    idle = p.idle_watts * (1.0 + 0.02 * jitter_power)
    dynamic = util * (p.full_load_watts - p.idle_watts) * factor * (1.0 + 0.015 * jitter_power)
    limit = p.power_limit_watts["enforced"]
    capped = busy and idle + dynamic > limit
    if capped:
        factor *= (limit - idle) / dynamic
        power = limit
    else:
        power = idle + dynamic

    # fans and temperature
    resistance = p.resistance_fans_stopped
    if p.fan_count:
        g.fan_target = _fan_curve(temp)
        goal = 0.0 if c.fan_stalled else g.fan_target * c.fan_ratio
        tau = 1.0 if c.fan_stalled else p.fan_time_constant_seconds
        g.fan_speed += (goal - g.fan_speed) * (1.0 - math.exp(-dt / tau))
        resistance -= (p.resistance_fans_stopped - p.resistance_fans_full) * g.fan_speed
    steady = g.ambient + power * resistance * c.resistance_factor
    g.temperature += (steady - temp) * (1.0 - math.exp(-dt / p.thermal_time_constant_seconds))

    # memory: allocations ramp up over ~10 s, frees are immediate
    usable = p.memory_total_mib - p.memory_reserved_mib
    wanted = usable * c.memory_fraction
    if wanted > g.memory_used_mib:
        g.memory_used_mib += (wanted - g.memory_used_mib) * (1.0 - math.exp(-dt / 10.0))
    else:
        g.memory_used_mib = wanted

    g.energy += power * dt
    active = {
        "sw_power_cap": capped,
        "sw_thermal_slowdown": g.sw_thermal,
        "hw_thermal_slowdown": g.hw_thermal,
        "hw_power_brake_slowdown": c.power_brake,
        "thermal": g.sw_thermal or g.hw_thermal,
        "low_utilization": not busy,
    }
    for reason, on in active.items():
        if on:
            g.event_seconds[reason] += dt
    g.power, g.utilization, g.busy, g.capped = power, util, busy, capped
    g.memory_utilization = min(1.0, util * c.memory_intensity * (1.0 + 0.1 * jitter_util))
    g.clock_factor, g.power_brake, g.lost = factor, c.power_brake, c.lost
    g.hw_slowdown = c.hw_slowdown
    g.pcie_width, g.pcie_generation = c.pcie_width, c.pcie_generation
    g.health.pcie_replays += c.replays_per_second * dt


def _fast_sample(g: _Gpu) -> FastSample:
    p = g.profile
    temperature = float(round(g.temperature))  # NVML reports whole degrees
    fans: tuple[FanReading, ...] = ()
    if p.fan_count:
        speed = round(g.fan_speed * 100) / 100
        fans = tuple(
            FanReading(
                fan=i,
                speed_ratio=speed,
                target_speed_ratio=round(g.fan_target * 100) / 100,
                speed_rpm=float(round(g.fan_speed * p.fan_max_rpm)),
            )
            for i in range(p.fan_count)
        )
    if g.busy:  # memory clock stays at max; the others follow the throttle factor
        clocks = {
            name: p.clock_max_mhz[name]
            if name == "memory"
            else max(p.clock_idle_mhz[name], _round_to(p.clock_max_mhz[name] * g.clock_factor, 15))
            for name in CLOCKS
        }
    else:
        clocks = {name: p.clock_idle_mhz[name] for name in CLOCKS}
    mask = 0
    for reason, on in (
        ("gpu_idle", not g.busy),
        ("sw_power_cap", g.capped),
        ("sw_thermal_slowdown", g.sw_thermal),
        ("hw_thermal_slowdown", g.hw_thermal),
        ("hw_power_brake_slowdown", g.power_brake),
        ("hw_slowdown", g.hw_thermal or g.power_brake or g.hw_slowdown),
    ):
        if on:
            mask |= CLOCKS_EVENT_REASON_BITS[reason]
    used = round(g.memory_used_mib)
    memory_temperature = None
    if p.memory_temperature is not None:
        offset, slope = p.memory_temperature
        memory_temperature = float(round(offset + slope * g.temperature))
    return FastSample(
        temperature_celsius=temperature,
        memory_temperature_celsius=memory_temperature,
        temperature_margin_celsius=(
            p.gpu_max_celsius - temperature if p.threshold_scale == "tlimit" else None
        ),
        fans=fans,
        power_watts=round(g.power, 3),
        energy_joules=round(g.energy, 3),
        performance_state=p.busy_pstate if g.busy else p.idle_pstate,
        utilization_ratio={
            "gpu": round(g.utilization * 100) / 100,
            "memory": round(g.memory_utilization * 100) / 100,
            "encoder": 0.0,
            "decoder": 0.0,
        },
        memory_total_bytes=p.memory_total_mib * _MIB,
        memory_used_bytes=used * _MIB,
        memory_free_bytes=(p.memory_total_mib - p.memory_reserved_mib - used) * _MIB,
        memory_reserved_bytes=p.memory_reserved_mib * _MIB,
        clock_hertz={name: mhz * 1e6 for name, mhz in clocks.items()},
        clocks_event_active=decode_clocks_event_reasons(mask, _ALL_REASONS),
        clocks_event_seconds={r: g.event_seconds[r] for r in p.clocks_event_time_reasons},
    )


def _slow_sample(g: _Gpu) -> SlowSample:
    p = g.profile
    absolute = {
        "shutdown": p.shutdown_celsius,
        "slowdown": p.slowdown_celsius,
        "gpu_max": p.gpu_max_celsius,
    }
    thresholds: dict[str, float] = {}
    margin_thresholds: dict[str, float] = {}
    if p.threshold_scale == "absolute":
        thresholds = absolute
    else:
        margin_thresholds = {name: p.gpu_max_celsius - value for name, value in absolute.items()}
        if p.memory_max_tlimit is not None:
            margin_thresholds["memory_max"] = p.memory_max_tlimit
    h = g.health
    generation = p.pcie_max_generation if g.busy else p.pcie_idle_generation
    if g.pcie_generation is not None:
        generation = min(generation, g.pcie_generation)
    width = p.pcie_width if g.pcie_width is None else min(p.pcie_width, g.pcie_width)
    return SlowSample(
        temperature_threshold_celsius=thresholds,
        temperature_margin_threshold_celsius=margin_thresholds,
        power_limit_watts=dict(p.power_limit_watts),
        clock_max_hertz={name: mhz * 1e6 for name, mhz in p.clock_max_mhz.items()},
        ecc_errors=dict(h.ecc) if p.ecc else {},
        remapped_rows=dict(h.remapped_rows) if p.remapped_rows else {},
        remapped_rows_pending=h.remapped_rows_pending if p.remapped_rows else None,
        remapped_rows_failed=h.remapped_rows_failed if p.remapped_rows else None,
        retired_pages_pending=h.retired_pages_pending if p.retired_pages else None,
        pcie_link_generation={"current": generation, "max": p.pcie_max_generation},
        pcie_link_width={"current": width, "max": p.pcie_width},
        pcie_replays=int(h.pcie_replays),
    )


def _round_to(value: float, quantum: float) -> float:
    return float(round(value / quantum) * quantum)


# ---------------------------------------------------------------------------------------- backend


def _unknown_profile(profile: object) -> str:
    return f"unknown simulated GPU profile {profile!r}; choose one of: {', '.join(PROFILES)}"


def _identity(seed: int, index: int, profile: Profile) -> GpuIdentity:
    digest = hashlib.sha256(f"gpuwatch-simulated:{seed}:{index}".encode()).digest()
    serial = int.from_bytes(digest[16:24], "big") % 10**9
    return GpuIdentity(
        index=index,
        uuid="GPU-" + str(uuidlib.UUID(bytes=digest[:16], version=4)),
        name=profile.name,
        pci_bus_id=f"{index // 16:08X}:{0x18 + 0x0E * (index % 16):02X}:00.0",
        serial=f"{profile.serial_prefix}{serial:09d}",
        minor_number=index,
        vbios_version=profile.vbios_version,
        architecture=profile.architecture,
    )


class SimulatedBackend:
    """A node of simulated GPUs (see the module docstring for the model).

    Time zero is the first ``open()``; ``close()`` then ``open()`` reconnects to the same running
    node (like re-initialising NVML, not like a driver reload), so counters keep going.

    ``wait_events`` returns the XID events that came due (by the injected clock) since the last
    call at once; when none are due it waits in *real* time on a ``threading.Event``, re-checking
    every 0.25 s, up to ``timeout_seconds`` or until ``close()``. With a FakeClock, call it with a
    timeout of 0 (or a small one) after advancing the clock.
    """

    name = "simulated"

    def __init__(
        self,
        clock: Clock,
        gpu_count: int = 8,
        profile: str = "rtx6000",
        faults: Sequence[Fault] | None = None,
        seed: int = 0,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(_unknown_profile(profile))
        if not isinstance(gpu_count, int) or isinstance(gpu_count, bool) or not (
            1 <= gpu_count <= MAX_GPUS
        ):
            raise ValueError(
                f"gpu_count must be an integer from 1 to {MAX_GPUS}, got {gpu_count!r}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self._profile = PROFILES[profile]
        faults = tuple(faults or ())
        features = self._profile.features
        for fault in faults:
            if not isinstance(fault, Fault):
                raise ValueError(f"faults must be Fault objects, got {fault!r}")
            if fault.gpu >= gpu_count:
                raise ValueError(
                    f"fault {fault.kind} is on GPU {fault.gpu}, but the node has {gpu_count} GPUs"
                )
            missing = [f for f in FAULT_KINDS[fault.kind].requires if not features[f]]
            if missing:
                raise ValueError(
                    f"fault {fault.kind} needs {', '.join(missing)}, which profile "
                    f"{profile!r} does not have"
                )
        self._clock = clock
        self._seed = seed
        self._faults = faults
        self._backend_faults = tuple(f for f in faults if FAULT_KINDS[f.kind].backend)
        self._identities = [_identity(seed, i, self._profile) for i in range(gpu_count)]
        self._index_by_uuid = {ident.uuid: ident.index for ident in self._identities}
        self._lock = threading.Lock()
        self._open = False
        self._closed = threading.Event()
        self._t0: float | None = None
        self._gpus: list[_Gpu] = []
        self._events_until = -1.0  # XID onsets up to this elapsed time have been delivered
        self._blocked = 0  # reads waiting in a hang

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def gpu_count(self) -> int:
        return len(self._identities)

    @property
    def hung_reads(self) -> int:
        """Reads blocked right now by a hang fault that is still active by the clock.

        For harnesses that run polls on threads under a FakeClock: a poll is either finished,
        running, or hung, and this tells the last apart without waiting in real time.
        """
        with self._lock:
            return self._blocked if self._effect("hang") else 0

    def open(self) -> DriverInfo:
        with self._lock:
            if self._t0 is None:
                self._t0 = self._clock.monotonic()
                self._gpus = [
                    _new_gpu(
                        ident.index,
                        ident.uuid,
                        self._profile,
                        tuple(f for f in self._faults if f.gpu == ident.index),
                        self._seed,
                    )
                    for ident in self._identities
                ]
            self._check_available()
            self._open = True
            self._closed = threading.Event()
            return DRIVER_INFO

    def close(self) -> None:
        with self._lock:
            self._open = False
            self._closed.set()

    def discover(self) -> list[DiscoveredGpu]:
        with self._lock:
            self._check_open()
            features = self._profile.features
            return [
                DiscoveredGpu(identity=i, features=dict(features))
                for i in self._identities
                if not self._effect("unlisted", i.index)
            ]

    def read_fast(self, uuid: str) -> FastSample:
        self._wait_out_hang()
        with self._lock:
            return _fast_sample(self._current(uuid))

    def read_slow(self, uuid: str) -> SlowSample:
        self._wait_out_hang()
        with self._lock:
            return _slow_sample(self._current(uuid))

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        remaining = max(0.0, float(timeout_seconds))
        while True:
            with self._lock:
                self._check_open()
                events = self._due_events()
                closed = self._closed
            if events or remaining <= 0.0:
                return events
            wait = min(remaining, _EVENT_POLL_SECONDS)
            if closed.wait(wait):
                return []
            remaining -= wait

    # -- internals (called with the lock held)

    def _check_open(self) -> None:
        if not self._open:
            raise BackendUnavailable(
                "not_open",
                "the simulated backend is not open",
                "call open() first (the poller does this on start and after errors)",
            )
        self._check_available()

    def _check_available(self) -> None:
        if self._effect("unavailable"):
            raise BackendUnavailable(
                "driver_not_loaded",
                "the simulated driver is not loaded (backend_down fault)",
                "wait for the fault window to end; the poller retries by itself",
            )

    def _effect(self, effect: str, index: int | None = None) -> bool:
        """Whether a backend-level fault of that effect (on GPU ``index``) is active now."""
        if self._t0 is None or not self._backend_faults:
            return False
        t = math.floor(self._elapsed() / STEP_SECONDS + 1e-6) * STEP_SECONDS
        return any(
            FAULT_KINDS[f.kind].backend == effect
            and (index is None or f.gpu == index)
            and f.since_onset(t) is not None
            for f in self._backend_faults
        )

    def _wait_out_hang(self) -> None:
        """Block, like a wedged NVML call, while a hang fault is active (until close())."""
        with self._lock:
            if not self._open or not self._effect("hang"):
                return
            self._blocked += 1
            closed = self._closed
        try:
            while not closed.wait(_HANG_POLL_SECONDS):
                with self._lock:
                    if not self._open or not self._effect("hang"):
                        return
        finally:
            with self._lock:
                self._blocked -= 1

    def _elapsed(self) -> float:
        assert self._t0 is not None
        return max(0.0, self._clock.monotonic() - self._t0)

    def _current(self, uuid: str) -> _Gpu:
        self._check_open()
        index = self._index_by_uuid.get(uuid)
        if index is None:
            raise DeviceLost(uuid, f"no simulated GPU has UUID {uuid}")
        g = self._gpus[index]
        target = math.floor(self._elapsed() / STEP_SECONDS + 1e-6)
        while g.step < target:
            g.step += 1
            _step(g, g.step * STEP_SECONDS, STEP_SECONDS)
        if g.lost:
            raise DeviceLost(uuid, f"simulated GPU {index} has fallen off the bus")
        if self._effect("unlisted", index):
            raise DeviceLost(uuid, f"simulated GPU {index} is no longer on the PCI bus")
        return g

    def _due_events(self) -> list[XidEvent]:
        now = self._elapsed()
        wall = self._clock.wall()
        due: list[tuple[float, int, XidEvent]] = []
        for order, fault in enumerate(self._faults):
            code_of = FAULT_KINDS[fault.kind].xid
            code = code_of(fault) if code_of else None
            if not code:
                continue
            uuid = self._identities[fault.gpu].uuid
            for onset in fault.onsets_between(self._events_until, now):
                due.append((onset, order, XidEvent(uuid, code, wall - (now - onset))))
        self._events_until = now
        return [event for _, _, event in sorted(due, key=lambda d: (d[0], d[1]))]
