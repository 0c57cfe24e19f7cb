"""thermal: GPU and memory temperature, the T.Limit margin, and the driver's thresholds.

Fast tier: nvmlDeviceGetTemperatureV (GetTemperature on older drivers), the margin
(nvmlDeviceGetMarginTemperature) and the memory temperature (field 82). Slow tier: the absolute
thresholds (nvmlDeviceGetTemperatureThreshold) and the T.Limit thresholds (fields 193-196).
The absolute thresholds gpuwatch exports and the rules use are one derivation of both
(model.temperature_thresholds). A reading no GPU can have (a sentinel, NaN, a temperature beyond
-60..250 °C, a T.Limit value beyond -250..250 °C) is left out and counted (Query.plausible), so no
threshold is derived from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.frozen import quick
from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec, within

_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU
# nvmlTemperatureThresholds_t
_THRESHOLDS = {"shutdown": 0, "slowdown": 1, "memory_max": 2, "gpu_max": 3}
_MEMORY_TEMPERATURE = 82  # NVML_FI_DEV_MEMORY_TEMP
_TLIMIT = {193: "shutdown", 194: "slowdown", 195: "memory_max", 196: "gpu_max"}  # NVML_FI_DEV_TEMPERATURE_*_TLIMIT
# What a GPU can read (Query.plausible): an absolute temperature or threshold -60..250 °C, the T.Limit margin and
# thresholds -250..250 °C; beyond it is a sentinel (0xFFFFFFFF read unsigned, INT_MIN), NaN or garbage: left out
_COLDEST, _HOTTEST = -60, 250
_MARGIN = 250  # -250..250
_THRESHOLD_WHAT = {name: f"temperature_threshold_celsius{{threshold={name}}}" for name in _THRESHOLDS}
_TLIMIT_WHAT = {name: f"temperature_margin_threshold_celsius{{threshold={name}}}" for name in _TLIMIT.values()}


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Temperatures:
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    temperature_margin_celsius: float | None = None  # degrees left to the max operating temperature


@dataclass(frozen=True, slots=True)
class TemperatureLimits:
    temperature_threshold_celsius: Mapping[str, float] = field(default_factory=dict)  # NVML's absolute ones
    temperature_margin_threshold_celsius: Mapping[str, float] = field(default_factory=dict)  # T.Limit scale


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.temperature = dev.first(dev.call("nvmlDeviceGetTemperatureV", _TEMPERATURE_GPU),
                                     dev.call("nvmlDeviceGetTemperature", _TEMPERATURE_GPU))
        margin = dev.call("nvmlDeviceGetMarginTemperature")
        self.margin = margin if dev.supported(margin) else None
        self.memory = dev.field(_MEMORY_TEMPERATURE, "fast")
        self.thresholds = tuple((name, call, _THRESHOLD_WHAT[name]) for name, kind in _THRESHOLDS.items()
                                if dev.supported(call := dev.constant(dev.call("nvmlDeviceGetTemperatureThreshold",
                                                                               kind), within(_COLDEST, _HOTTEST))))
        self.tlimit = tuple((fid, name, _TLIMIT_WHAT[name]) for fid, name in _TLIMIT.items() if dev.field(fid, "slow"))
        dev.feature("temperature_margin", self.margin is not None)
        dev.feature("memory_temperature", self.memory)

    def read_fast(self, q: Query) -> Temperatures:
        plausible = q.plausible
        t = m = mem = None
        if self.temperature is not None:
            t = plausible(q(self.temperature), _COLDEST, _HOTTEST, "temperature_celsius")
        if self.margin is not None:
            m = plausible(q(self.margin), -_MARGIN, _MARGIN, "temperature_margin_celsius")
        if self.memory:
            mem = plausible(q.field(_MEMORY_TEMPERATURE), _COLDEST, _HOTTEST, "memory_temperature_celsius")
        return Temperatures(None if t is None else float(t), None if mem is None else float(mem),
                            None if m is None else float(m))

    def read_slow(self, q: Query) -> TemperatureLimits:
        plausible = q.plausible
        absolute = {}
        for name, call, what in self.thresholds:
            value = plausible(q(call), _COLDEST, _HOTTEST, what)
            if value is not None:
                absolute[name] = float(value)
        tlimit = {}
        for fid, name, what in self.tlimit:
            value = plausible(q.field(fid), -_MARGIN, _MARGIN, what)
            if value is not None:
                tlimit[name] = float(value)
        return TemperatureLimits(absolute, tlimit)


def thresholds(fast: Temperatures | None, slow: TemperatureLimits | None) -> dict[str, float]:
    """The temperature thresholds on the absolute (°C) scale: the one definition that the exporter
    (gpuwatch_temperature_threshold_celsius), the rules, the live view and so the dashboards use.

    Where the GPU reports its T.Limit margin and T.Limit thresholds (Hopper and newer; nvidia-smi then
    prints only that scale), shutdown, slowdown and gpu_max are derived from them: absolute = current
    temperature + margin - T.Limit threshold (an H200 at 28 °C with margin 59 and slowdown T.Limit -2
    slows down at 89 °C), the scale the driver throttles by. Otherwise they are NVML's absolute
    thresholds. ``memory_max`` is always NVML's own: the GPU's margin says nothing about the memory.
    """
    result: dict[str, float] = dict(slow.temperature_threshold_celsius) if slow is not None else {}
    if slow is None or fast is None:
        return result
    temp, margin = fast.temperature_celsius, fast.temperature_margin_celsius
    if temp is None or margin is None:
        return result
    for name, tlimit in slow.temperature_margin_threshold_celsius.items():
        if name != "memory_max":
            result[name] = temp + margin - tlimit
    return result


def render(emit: Emit, fast: Temperatures | None, slow: TemperatureLimits | None) -> None:
    if fast is not None:
        emit("gpuwatch_temperature_celsius", ("gpu",), fast.temperature_celsius)
        emit("gpuwatch_temperature_celsius", ("memory",), fast.memory_temperature_celsius)
        emit("gpuwatch_temperature_margin_celsius", (), fast.temperature_margin_celsius)
    if slow is not None:
        for name, celsius in thresholds(fast, slow).items():
            emit("gpuwatch_temperature_threshold_celsius", (name,), celsius)
        for name, celsius in slow.temperature_margin_threshold_celsius.items():
            emit("gpuwatch_temperature_margin_threshold_celsius", (name,), celsius)


GROUP = Group(
    name="thermal",
    help="GPU and memory temperature, T.Limit margin and thresholds",
    features=("memory_temperature", "temperature_margin"),
    fast="thermal",
    slow="thermal",
    nvml=Nvml,
    fields={_MEMORY_TEMPERATURE: "memory temperature",
            **{fid: f"{name} T.Limit threshold" for fid, name in _TLIMIT.items()}},
    render=render,
    specs=(
        Spec("gpuwatch_temperature_celsius", "gauge", G + ("sensor",),
             "Current temperature in degrees Celsius; sensor gpu (nvmlDeviceGetTemperatureV; 'GPU Current Temp') "
             "or memory (field NVML_FI_DEV_MEMORY_TEMP; 'Memory Current Temp')."),
        Spec("gpuwatch_temperature_threshold_celsius", "gauge", G + ("threshold",),
             "Temperature thresholds in degrees Celsius, on the scale of the current temperature: derived from "
             "the T.Limit margin where the GPU reports one ('GPU Slowdown T.Limit Temp'), else the driver's "
             "absolute ones (nvmlDeviceGetTemperatureThreshold; 'GPU Slowdown Temp')."),
        Spec("gpuwatch_temperature_margin_celsius", "gauge", G,
             "Degrees Celsius left before the maximum operating temperature (nvmlDeviceGetMarginTemperature; "
             "'GPU T.Limit Temp')."),
        Spec("gpuwatch_temperature_margin_threshold_celsius", "gauge", G + ("threshold",),
             "Temperature thresholds on the T.Limit scale in degrees Celsius (fields "
             "NVML_FI_DEV_TEMPERATURE_*_TLIMIT; 'GPU Slowdown T.Limit Temp')."),
    ),
)
