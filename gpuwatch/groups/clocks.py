"""clocks: current and maximum clocks, the clock-event (throttle) reasons and their time counters.

Fast tier: nvmlDeviceGetClockInfo for the graphics, SM and memory clocks; the reason mask from
nvmlDeviceGetCurrentClocksEventReasons (GetCurrentClocksThrottleReasons on older drivers), decoded
against the supported mask read once; the cumulative throttle-time counters from the tier's field
batch. Slow tier: the video clock and the maximum clocks (nvmlDeviceGetMaxClockInfo, asked until
answered plausibly, then kept until the next discovery: Device.constant).

The time counters by default are the five nvidia-smi prints ("Clocks Event Reasons Counters"):
sw_power_cap (74), sync_boost (76) and sw/hw_thermal_slowdown and hw_power_brake_slowdown, whose
ids depend on the driver branch (groups/fieldids.py: 251-253 on R575 and R580 before 580.126,
269-271 on R570 and R580.126+; none before R570). Where the branch has no SW thermal counter the
thermal one is the perf-policy counter 75 (``thermal``), which NVIDIA maps to it: with the SW thermal
counter there, 75 is not read (the same counter twice). On a branch newer than the table, a counter
whose id does not answer an unsigned 64-bit value is left out (logged once), never read as time.
The other perf-policy counters (board_limit 77, low_utilization 78, reliability 79) come with
``--collector.clocks.policy-counters``.

Every value passes ``Query.plausible`` before it is converted: a clock outside 0..100000 MHz (0xFFFFFFFF
is NVML's "not available"), a time counter outside 0..MAX_COUNTER ns (2**64-1, -1 in a signed field, NaN)
or a reason mask of all ones (NVML's "not available", not every reason at once) is left out, counted
(implausible_value) and logged once; the group's other readings stay.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatch.frozen import quick
from gpuwatch.groups import fieldids
from gpuwatch.groups.base import MAX_COUNTER, Call, Device, Emit, G, Group, Query, Spec, within

CLOCKS: tuple[str, ...] = ("graphics", "sm", "memory", "video")
_CLOCK_TYPES = {"graphics": 0, "sm": 1, "memory": 2, "video": 3}  # nvmlClockType_t
_FAST_CLOCKS = ("graphics", "sm", "memory")  # the video clock is read in the slow tier
MAX_CLOCK_MHZ = 100_000  # no GPU clock reaches 100 GHz: above it (0xFFFFFFFF) is a sentinel, left out
# the clock-event reason mask: all 64 bits set is NVML's "not available"; other unknown bits are new reasons
_MAX_REASONS = 2**64 - 2

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
_KNOWN_REASON_BITS = sum(CLOCKS_EVENT_REASON_BITS.values())  # distinct bits: the sum is their union

# Throttle-time counters (gpuwatch_clocks_event_seconds_total{reason}), in ns: the field (an id, or the
# name of an id that moved between driver branches) -> reason.
COUNTERS: Mapping[int | str, str] = {74: "sw_power_cap", 76: "sync_boost",
                                     fieldids.SW_THERMAL_NS: "sw_thermal_slowdown",
                                     fieldids.HW_THERMAL_NS: "hw_thermal_slowdown",
                                     fieldids.HW_POWER_BRAKE_NS: "hw_power_brake_slowdown"}
_THERMAL = 75  # NVML_FI_DEV_PERF_POLICY_THERMAL: read where the branch has no SW thermal counter
_LEGACY_THERMAL: Mapping[int | str, str] = {_THERMAL: "thermal"}
POLICY_COUNTERS: Mapping[int | str, str] = {77: "board_limit", 78: "low_utilization", 79: "reliability"}
ALL_COUNTERS: Mapping[int | str, str] = {**COUNTERS, **_LEGACY_THERMAL, **POLICY_COUNTERS}
CLOCKS_EVENT_TIME_REASONS: tuple[str, ...] = tuple(ALL_COUNTERS.values())


def decode_clocks_event_reasons(mask: int, supported: int) -> Mapping[str, bool]:
    """Reason name -> active, for every reason bit the GPU supports.

    The result is shared and read-only (a ``types.MappingProxyType``, cached per ``(mask,
    supported)`` pair): a GPU's mask rarely changes, so consecutive samples, and the rule engine's
    history of them, share one mapping instead of holding a new dict each. ``dict(...)`` copies it.
    """
    known = _KNOWN_REASON_BITS  # other bits cannot change the result: one cache entry for them all
    return _decode(mask & supported & known, supported & known)


@functools.lru_cache(maxsize=1024)
def _decode(mask: int, supported: int) -> Mapping[str, bool]:
    return types.MappingProxyType({
        name: bool(mask & bit) for name, bit in CLOCKS_EVENT_REASON_BITS.items() if supported & bit})


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Clocks:
    clock_hertz: Mapping[str, float] = field(default_factory=dict)  # graphics, sm, memory (video: slow)
    clocks_event_active: Mapping[str, bool] = field(default_factory=dict)  # reason -> set now
    clocks_event_seconds: Mapping[str, float] = field(default_factory=dict)  # reason -> cumulative seconds


_NO_CLOCKS: Mapping[str, float] = MappingProxyType({})


def history(clocks: Clocks) -> Clocks:
    """The rules look back at the clock events (reasons and their time counters), not at the clocks."""
    return Clocks(_NO_CLOCKS, clocks.clocks_event_active, clocks.clocks_event_seconds) if clocks.clock_hertz else clocks


@dataclass(frozen=True, slots=True)
class ClockLimits:
    clock_hertz: Mapping[str, float] = field(default_factory=dict)  # video
    clock_max_hertz: Mapping[str, float] = field(default_factory=dict)


class Nvml:
    def __init__(self, dev: Device) -> None:
        def clocks(function: str, names: tuple[str, ...], kind: str,
                   constant: bool = False) -> tuple[tuple[str, Call, str], ...]:
            calls = ((name, dev.call(function, _CLOCK_TYPES[name])) for name in names)
            if constant:
                calls = ((name, dev.constant(call, within(0, MAX_CLOCK_MHZ))) for name, call in calls)
            # (name, call, the reading's name for Query.plausible)
            return tuple((name, call, f"{name} {kind}") for name, call in calls if dev.supported(call))

        self.clocks = clocks("nvmlDeviceGetClockInfo", _FAST_CLOCKS, "clock")
        self.video = clocks("nvmlDeviceGetClockInfo", ("video",), "clock")
        self.max_clocks = clocks("nvmlDeviceGetMaxClockInfo", CLOCKS, "max clock", constant=True)
        self.reasons = dev.first(dev.call("nvmlDeviceGetCurrentClocksEventReasons"),
                                 dev.call("nvmlDeviceGetCurrentClocksThrottleReasons"))
        self.supported_reasons = 0
        if self.reasons is not None:
            mask = dev.first(dev.call("nvmlDeviceGetSupportedClocksEventReasons"),
                             dev.call("nvmlDeviceGetSupportedClocksThrottleReasons"))
            try:
                value = dev.probe(mask) if mask is not None else None
            except Exception:  # Unsupported, or an error: assume every reason, as nvidia-smi does
                value = None
            self.supported_reasons = int(value) if value is not None else _KNOWN_REASON_BITS
        wanted = dict(COUNTERS)
        if dev.option("policy-counters"):
            wanted.update(POLICY_COUNTERS)
        counters: list[tuple[int, str]] = []
        for key, reason in ALL_COUNTERS.items():
            fid = dev.field_id(key) if isinstance(key, str) else key
            if key not in wanted or fid is None or not dev.has_field(fid):
                continue
            if isinstance(key, str) and not dev.numbering_known and \
                    dev.value_type(fid) != fieldids.VALUE_TYPE_UNSIGNED_LONG_LONG:
                dev.reject(f"{reason} throttle time (field {fid})",
                           f"answered value type {dev.value_type(fid)}, not an unsigned 64-bit count of nanoseconds")
                continue
            counters.append((fid, reason))
        if not any(reason == "sw_thermal_slowdown" for _, reason in counters) and dev.has_field(_THERMAL):
            counters.append((_THERMAL, _LEGACY_THERMAL[_THERMAL]))
        # (field id, reason, the reading's name for Query.plausible)
        self.counters = tuple((fid, reason, f"{reason} throttle time") for fid, reason in counters
                              if dev.field(fid, "fast"))
        dev.feature("clocks_event_reasons", self.reasons is not None)
        dev.feature("clocks_event_time", bool(self.counters))

    def read_fast(self, q: Query) -> Clocks:
        plausible = q.plausible
        hertz = {}
        for name, call, what in self.clocks:
            mhz = plausible(q(call), 0, MAX_CLOCK_MHZ, what)
            if mhz is not None:
                hertz[name] = mhz * 1e6
        active: Mapping[str, bool] = {}
        if self.reasons is not None:
            mask = plausible(q(self.reasons), 0, _MAX_REASONS, "clocks event reasons")
            if mask is not None:
                active = decode_clocks_event_reasons(int(mask), self.supported_reasons)
        seconds = {}
        for fid, reason, what in self.counters:
            ns = plausible(q.field(fid), 0, MAX_COUNTER, what)
            if ns is not None:
                seconds[reason] = ns / 1e9
        return Clocks(hertz, active, seconds)

    def read_slow(self, q: Query) -> ClockLimits:
        def read(calls: tuple[tuple[str, Call, str], ...]) -> dict[str, float]:
            out = {}
            for name, call, what in calls:
                mhz = q.plausible(q(call), 0, MAX_CLOCK_MHZ, what)
                if mhz is not None:
                    out[name] = mhz * 1e6
            return out

        return ClockLimits(read(self.video), read(self.max_clocks))


def render(emit: Emit, fast: Clocks | None, slow: ClockLimits | None) -> None:
    current: dict[str, float] = {}
    if fast is not None:
        current.update(fast.clock_hertz)
    if slow is not None:
        current.update(slow.clock_hertz)
        for clock, hz in slow.clock_max_hertz.items():
            emit("gpuwatch_clock_max_hertz", (clock,), hz)
    for clock, hz in current.items():
        emit("gpuwatch_clock_hertz", (clock,), hz)
    if fast is not None:
        for reason, on in fast.clocks_event_active.items():
            emit("gpuwatch_clocks_event_active", (reason,), on)
        for reason, seconds in fast.clocks_event_seconds.items():
            emit("gpuwatch_clocks_event_seconds_total", (reason,), seconds)


GROUP = Group(
    name="clocks",
    history=history,
    help="current and maximum clocks, clock-event (throttle) reasons and their time counters",
    features=("clocks_event_reasons", "clocks_event_time"),
    options={"policy-counters": (False, "also the perf-policy throttle-time counters board_limit, "
                                        "low_utilization and reliability (NVML fields 77-79; nvidia-smi no longer "
                                        "prints them)")},
    fast="clocks",
    slow="clocks",
    nvml=Nvml,
    fields={key: f"{reason} throttle time" for key, reason in ALL_COUNTERS.items()},
    render=render,
    specs=(
        Spec("gpuwatch_clock_hertz", "gauge", G + ("clock",),
             "Current clock in hertz (nvmlDeviceGetClockInfo; 'Clocks'); the video clock is read in the slow tier."),
        Spec("gpuwatch_clock_max_hertz", "gauge", G + ("clock",),
             "Maximum clock in hertz (nvmlDeviceGetMaxClockInfo; 'Max Clocks')."),
        Spec("gpuwatch_clocks_event_active", "gauge", G + ("reason",),
             "1 while the clock-event (throttle) reason is active, 0 otherwise; one series per reason the GPU "
             "supports (nvmlDeviceGetCurrentClocksEventReasons; 'Clocks Event Reasons')."),
        Spec("gpuwatch_clocks_event_seconds_total", "counter", G + ("reason",),
             "Cumulative seconds clocks were held down for the reason (NVML throttle-time counters, fields "
             "NVML_FI_DEV_CLOCKS_EVENT_REASON_* and NVML_FI_DEV_PERF_POLICY_*; 'Clocks Event Reasons Counters')."),
    ),
)
