"""power: power draw, P-state (fast); the energy counter and the power limits (slow).

Fast tier: the average power draw from field 185 (NVML_FI_DEV_POWER_AVERAGE, scope GPU, R535+) in the
tier's one field-values batch, else nvmlDeviceGetPowerUsage; the P-state from
nvmlDeviceGetPerformanceState. The energy counter (field 83) is a slow reading (``PowerLimits``, so the
slow tier's staleness bound applies to it): on a real H200 (R580, GSP firmware) that one field costs
about 3 ms of CPU per read, three times everything else a fast poll reads (docs/hardware.md), and a
counter read every 30 s gives rate() over 5 minutes all it needs (dcgm-exporter collects it every 30 s).
The simulated backend and older traces carry it in the fast reading; either is rendered.
Slow tier: nvmlDeviceGetEnforcedPowerLimit,
GetPowerManagementDefaultLimit and GetPowerManagementLimitConstraints (these two kept once answered plausibly,
until the next discovery: Device.constant); on Blackwell boards with power
smoothing, the smoothing circuitry's remaining lifetime in percent (field
NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING, whose id depends on the driver branch:
258 on R570 and R580.126+, 263 on R575/R580.65; groups/fieldids.py). A lifetime outside 0-100 % is
not exported (logged once): on a branch newer than gpuwatch's table that id may mean something else; at
discovery the field is then not read, at a poll the value is left out and counted (Query.plausible), as
a power draw, module power or limit beyond 0..20 kW, an energy counter beyond 0..MAX_COUNTER mJ (a
negative, NaN, 0xFF..FF) and a P-state beyond 0-15 (32, NVML_PSTATE_UNKNOWN, is left out uncounted).

Grace-coupled GPUs (GH200, GB200): where the GPU answers field 185 with scopeId 1
(NVML_POWER_SCOPE_MODULE: GPU + Grace CPU + memory), probed once at discovery, the module's power is
read in the same batch: gpuwatch_module_power_watts. On those GPUs the energy counter (field 83)
covers the module too (ml-energy/zeus#172): rate(energy) matches the module's power, not the GPU's.
The module power's presence is the sign of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.frozen import quick
from gpuwatch.groups import fieldids
from gpuwatch.groups.base import MAX_COUNTER, Device, Emit, G, Group, Query, Spec, within

_ENERGY = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ
_POWER_AVERAGE = 185  # NVML_FI_DEV_POWER_AVERAGE, mW (what nvmlDeviceGetPowerUsage reports on Ampere and newer)
MODULE_POWER = (_POWER_AVERAGE, 1)  # scopeId NVML_POWER_SCOPE_MODULE
_MODULE = MODULE_POWER
# What a board can draw or be limited to (Query.plausible), in mW: 0..20 kW. Beyond it (0xFFFFFFFF mW), NaN, a negative
# or an energy counter beyond MAX_COUNTER (mJ) is left out and counted, never exported
_MAX_MW = 20_000_000
_LIMIT_WHAT = {"enforced": "power_limit_watts{limit=enforced}", "default": "power_limit_watts{limit=default}"}
_PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Power:
    power_watts: float | None = None
    energy_joules: float | None = None  # since the driver was loaded
    performance_state: int | None = None  # 0-15, 0 = maximum performance
    module_power_watts: float | None = None  # GPU + Grace CPU + memory (Grace-coupled GPUs only)


def history(power: Power) -> Power:
    """The rules look back at the power draw only (energy, P-state and module power: the latest sample)."""
    if power.energy_joules is not None or power.performance_state is not None:
        return Power(power.power_watts)
    return power


@dataclass(frozen=True, slots=True)
class PowerLimits:
    power_limit_watts: Mapping[str, float] = field(default_factory=dict)  # enforced, default, min, max
    power_smoothing_lifetime_ratio: float | None = None  # remaining lifetime of the smoothing circuitry, 0-1
    energy_joules: float | None = None  # since the driver was loaded (NVML: here, not in the fast reading)


def _percent(value: float | int | None) -> float | None:
    """A percentage NVML reported, as a ratio; None when it is not one (0-100)."""
    if value is None or not 0 <= value <= 100:
        return None
    return float(value) / 100.0


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.average = dev.field(_POWER_AVERAGE, "fast")
        usage = dev.call("nvmlDeviceGetPowerUsage")
        self.usage = usage if not self.average and dev.supported(usage) else None
        self.energy = dev.field(_ENERGY, "slow")
        self.module = bool(dev.values([_MODULE])) and dev.field(_MODULE, "fast")
        pstate = dev.call("nvmlDeviceGetPerformanceState")
        self.pstate = pstate if dev.supported(pstate) else None
        limits = (("enforced", dev.call("nvmlDeviceGetEnforcedPowerLimit")),
                  ("default", dev.constant(dev.call("nvmlDeviceGetPowerManagementDefaultLimit"), within(0, _MAX_MW))),
                  ("constraints", dev.constant(dev.call("nvmlDeviceGetPowerManagementLimitConstraints"),
                                               within(0, _MAX_MW))))
        self.limits = tuple((name, call) for name, call in limits if dev.supported(call))
        self.rejected = False
        self.lifetime = self._lifetime(dev)
        dev.feature("power", self.average or self.usage is not None)
        dev.feature("energy", self.energy)
        dev.feature("power_limit", any(name == "enforced" for name, _ in self.limits))
        # the field answered but implausibly (rejected): 0; no such field: nothing
        dev.feature("power_smoothing", True if self.lifetime is not None else (False if self.rejected else None))

    def _lifetime(self, dev: Device) -> int | None:
        """The field id of the smoothing circuitry's lifetime, where the GPU answers it plausibly."""
        fid = dev.field_id(fieldids.POWER_SMOOTHING_LIFETIME)
        if fid is None or not dev.has_field(fid):
            return None
        value = dev.values([fid]).get(fid)
        if value is None and dev.refused(fid):  # answered in the discovery's batch of every field, NOT_SUPPORTED
            return None                         # alone (an H200 on R580.159); a transient failure: polled
        if value is not None and _percent(value) is None:
            dev.reject(f"power smoothing lifetime (field {fid})", f"answered {value!r}, not a percentage 0-100")
            self.rejected = True
            return None
        if not dev.numbering_known and not _numbering_holds(dev):
            # a 0/1 flag under a renumbering would pass for a percentage: read it only where the branch's
            # throttle counters still answer where the newest numbering puts them
            dev.reject(f"power smoothing lifetime (field {fid})",
                       "a driver branch newer than gpuwatch's table whose throttle-time counters do not answer "
                       "where the newest numbering puts them: the lifetime's id cannot be trusted either")
            self.rejected = True
            return None
        return fid if dev.field(fid, "slow") else None

    def read_fast(self, q: Query) -> Power:
        plausible = q.plausible
        mw = q.field(_POWER_AVERAGE) if self.average else (q(self.usage) if self.usage is not None else None)
        mw = plausible(mw, 0, _MAX_MW, "power_watts")
        pstate = q(self.pstate) if self.pstate is not None else None
        if pstate is not None:  # 0-15, or 32: NVML_PSTATE_UNKNOWN (left out, not an implausible answer)
            pstate = None if pstate == _PSTATE_UNKNOWN else plausible(pstate, 0, 15, "performance_state")
        module = plausible(q.field(_MODULE), 0, _MAX_MW, "module_power_watts") if self.module else None
        return Power(None if mw is None else mw / 1000.0, None, None if pstate is None else int(pstate),
                     None if module is None else module / 1000.0)

    def read_slow(self, q: Query) -> PowerLimits:
        plausible = q.plausible
        limits: dict[str, float] = {}
        for name, call in self.limits:
            value = q(call)
            if value is None:
                continue
            if name == "constraints":
                low = plausible(value[0], 0, _MAX_MW, "power_limit_watts{limit=min}")
                high = plausible(value[1], 0, _MAX_MW, "power_limit_watts{limit=max}")
                if low is not None:
                    limits["min"] = low / 1000.0
                if high is not None:
                    limits["max"] = high / 1000.0
            elif (mw := plausible(value, 0, _MAX_MW, _LIMIT_WHAT[name])) is not None:
                limits[name] = mw / 1000.0
        lifetime = None
        if self.lifetime is not None:
            percent = plausible(q.field(self.lifetime), 0, 100, "power_smoothing_lifetime")
            lifetime = None if percent is None else percent / 100.0
        mj = plausible(q.field(_ENERGY), 0, MAX_COUNTER, "energy_joules") if self.energy else None
        return PowerLimits(limits, lifetime, None if mj is None else mj / 1000.0)


def _numbering_holds(dev: Device) -> bool:
    """On a branch newer than the table: the SW thermal throttle counter answers where the newest numbering
    puts it, as an unsigned 64-bit count (evidence that the power-smoothing ids moved with it, or not at all)."""
    sw = dev.field_id(fieldids.SW_THERMAL_NS)
    if sw is None:
        return False
    dev.values([sw])
    return dev.value_type(sw) == fieldids.VALUE_TYPE_UNSIGNED_LONG_LONG


def render(emit: Emit, fast: Power | None, slow: PowerLimits | None) -> None:
    energy = fast.energy_joules if fast is not None else None
    if energy is None and slow is not None:
        energy = slow.energy_joules
    emit("gpuwatch_energy_joules_total", (), energy)
    if fast is not None:
        emit("gpuwatch_power_watts", (), fast.power_watts)
        emit("gpuwatch_performance_state", (), fast.performance_state)
        emit("gpuwatch_module_power_watts", (), fast.module_power_watts)
    if slow is not None:
        for name, watts in slow.power_limit_watts.items():
            emit("gpuwatch_power_limit_watts", (name,), watts)
        emit("gpuwatch_power_smoothing_lifetime_remaining_ratio", (), slow.power_smoothing_lifetime_ratio)


GROUP = Group(
    name="power",
    history=history,
    help="power draw, energy counter, P-state and power limits",
    features=("energy", "power", "power_limit", "power_smoothing"),
    hardware=("power_smoothing",),
    fast="power",
    slow="power",
    nvml=Nvml,
    fields={_ENERGY: "energy", _POWER_AVERAGE: "average power",
            fieldids.POWER_SMOOTHING_LIFETIME: "power smoothing circuitry lifetime remaining"},
    render=render,
    specs=(
        Spec("gpuwatch_power_watts", "gauge", G,
             "Power draw in watts, a 1 s average on Ampere and newer (field NVML_FI_DEV_POWER_AVERAGE, else "
             "nvmlDeviceGetPowerUsage; 'Average Power Draw'). The GPU alone, also on a Grace-coupled GPU "
             "(GH200, GB200), whose energy counter covers the module: see gpuwatch_module_power_watts."),
        Spec("gpuwatch_module_power_watts", "gauge", G,
             "Power draw of the whole module in watts, a 1 s average: GPU + Grace CPU + memory, on Grace-coupled "
             "GPUs (GH200, GB200) where the GPU reports it (field NVML_FI_DEV_POWER_AVERAGE with scopeId "
             "NVML_POWER_SCOPE_MODULE; 'Module Power Readings'). Where it exists, gpuwatch_energy_joules_total "
             "covers the module too: its rate is the module's power, not the GPU's."),
        Spec("gpuwatch_power_limit_watts", "gauge", G + ("limit",),
             "Power limits in watts: enforced (nvmlDeviceGetEnforcedPowerLimit; 'Current Power Limit'), default, "
             "min and max (nvmlDeviceGetPowerManagementLimitConstraints)."),
        Spec("gpuwatch_energy_joules_total", "counter", G,
             "Energy consumed since the driver was loaded, in joules; resets on driver reload "
             "(field NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, read by the slow tier). On a Grace-coupled GPU "
             "(GH200, GB200: where gpuwatch_module_power_watts exists) it covers the whole module: GPU + Grace "
             "CPU + memory."),
        Spec("gpuwatch_power_smoothing_lifetime_remaining_ratio", "gauge", G,
             "Remaining lifetime of the power-smoothing circuitry, 1 = new (Blackwell; field "
             "NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING, id by driver branch; XIDs 164/165)."),
        Spec("gpuwatch_performance_state", "gauge", G,
             "Performance state 0-15, 0 = maximum performance (nvmlDeviceGetPerformanceState; 'Performance State')."),
    ),
)
