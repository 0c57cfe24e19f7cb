"""gpm: the profiling metrics of Hopper and newer GPUs (GPM: GPU performance monitoring).

"Utilization 100 %" only says a kernel was resident during the sample period; GPM says how much of
the GPU worked: the share of SMs busy, the warps resident, the tensor and FP pipes, the DRAM
bandwidth, the PCIe traffic. Fast tier; ``nvmlGpmQueryDeviceSupport`` is probed once per GPU. The
funnel keeps two GPM samples per GPU (allocated once, swapped): each poll takes one
(``nvmlGpmSampleGet``) and asks for every metric over the pair with one ``nvmlGpmMetricsGet``:
2 NVML calls per GPU per poll. Each metric's own return code is checked (a metric the GPU lacks is
absent, the others stay). The ratios are the averages over the last fast interval; the PCIe byte
counters are integrated from the GPM rates (MiB/s x seconds between the samples) and start at zero
when gpuwatch discovers the GPU.

Each value is checked (``Query.plausible``): a percentage from 0 to 105 (GPM's sampling overshoots 100 a little:
exported as it is, up to 1.05), a rate finite from 0 to 10**13 bytes/s; anything else (NaN, an infinity, a sentinel)
is left out, counted as ``implausible_value`` and logged once per GPU and reading. Only a plausible rate is
integrated: a PCIe counter skips that interval and is left out for that poll (it never becomes +Inf).

GPM and DCGM's profiling module (dcgm-exporter's DCGM_FI_PROF_* fields) or Nsight Compute / CUPTI
read the same hardware counters: run one of them. Switch GPM off here with ``--no-collector.gpm``
on nodes where DCGM profiling or Nsight runs (docs/groups.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatch.frozen import quick
from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec, Unsupported

# NVML_GPM_METRIC_* ids (values in %, PCIe in MiB/s)
_GRAPHICS = 1
_SM_ACTIVE = 2
_SM_OCCUPANCY = 3
_DRAM = 10
PIPES: Mapping[str, int] = {"tensor": 5, "fp64": 11, "fp32": 12, "fp16": 13, "integer": 4}
_PCIE: Mapping[str, int] = {"tx": 20, "rx": 21}
# At defaults what dcgm-exporter exports by default (SM activity aside, which it makes opt-in and which is
# the one that answers "is this GPU busy"): SM activity, the tensor pipe, DRAM bandwidth, PCIe traffic
# (5 series per GPU). --collector.gpm.detail adds occupancy, the graphics engine (much what "utilization"
# says) and the fp64/fp32/fp16/integer pipes (6 more), within the contract's series budget.
METRICS: tuple[int, ...] = (_SM_ACTIVE, PIPES["tensor"], _DRAM, *_PCIE.values())
DETAIL: tuple[int, ...] = (_SM_OCCUPANCY, _GRAPHICS, *(m for p, m in PIPES.items() if p != "tensor"))
_MIB = 1024 * 1024
MAX_PERCENT = 105.0  # the largest plausible GPM percentage (sampling overshoots 100 slightly)
MAX_RATE = 1e13  # the largest plausible rate, bytes/s (10 TB/s)
_MAX_PCIE_MIBPS = MAX_RATE / _MIB  # the same in GPM's PCIe unit, MiB/s
# the readings' names for Query.plausible
_WHAT = {_SM_ACTIVE: "gpm_sm_active", _SM_OCCUPANCY: "gpm_sm_occupancy", _GRAPHICS: "gpm_graphics_engine_active",
         _DRAM: "gpm_dram_bandwidth", **{m: f"gpm_{p}_pipe_active" for p, m in PIPES.items()},
         **{m: f"gpm_pcie_{d}_rate" for d, m in _PCIE.items()}}


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Gpm:
    sm_active_ratio: float | None = None  # share of SMs with at least one warp, averaged over the interval
    sm_occupancy_ratio: float | None = None  # resident warps / the maximum
    graphics_engine_active_ratio: float | None = None
    pipe_active_ratio: Mapping[str, float] = field(default_factory=dict)  # pipe -> 0..1
    dram_bandwidth_ratio: float | None = None
    pcie_traffic_bytes: Mapping[str, float] = field(default_factory=dict)  # tx | rx, integrated since discovery



_NONE: Mapping[str, float] = MappingProxyType({})
# Immutable: one for every poll without readings, and FastSample's default (the sample of a GPU without GPM)
NOTHING = Gpm(pipe_active_ratio=_NONE, pcie_traffic_bytes=_NONE)


def history(gpm: Gpm) -> Gpm:
    """The rules look back at SM activity only."""
    return Gpm(gpm.sm_active_ratio, None, None, _NONE, None, _NONE) if gpm.pcie_traffic_bytes else gpm

class Nvml:
    def __init__(self, dev: Device) -> None:
        transient = False
        try:
            answer = dev.probe(dev.call("nvmlGpmQueryDeviceSupport"))
            transient = answer is None  # a transient error: whether the GPU has GPM is not known now
        except Unsupported:
            answer = None
        self.metrics = None
        if answer is not None and getattr(answer, "isSupportedDevice", False):
            metrics = dev.call("nvmlGpmMetricsGet", METRICS + (DETAIL if dev.option("detail") else ()))
            # the probe takes the first sample of the pair: the first poll already has an interval
            self.metrics = metrics if dev.supported(metrics) else None
        self.pcie = {"tx": 0.0, "rx": 0.0}
        # supported by the device but its metrics cannot be read: 0; not a GPM device: nothing
        supported_device = answer is not None and bool(getattr(answer, "isSupportedDevice", False))
        self.idle_fast = self.metrics is None  # NvmlReader: NOTHING (FastSample's default) every poll
        dev.feature("gpm", True if self.metrics is not None else (False if supported_device or transient else None))

    def read_fast(self, q: Query) -> Gpm:
        got = q(self.metrics) if self.metrics is not None else None
        if got is None:  # no GPM, failed (counted), or the first sample of a new pair
            return NOTHING
        values, seconds = got
        plausible = q.plausible
        pcie, traffic = self.pcie, {}
        for direction, metric in _PCIE.items():
            rate = plausible(values.get(metric), 0, _MAX_PCIE_MIBPS, _WHAT[metric])
            if rate is not None:  # only a plausible rate is integrated (an implausible one: the counter left out)
                traffic[direction] = pcie[direction] = pcie[direction] + rate * _MIB * seconds
        return Gpm(
            sm_active_ratio=percent_ratio(q, values.get(_SM_ACTIVE), _WHAT[_SM_ACTIVE]),
            sm_occupancy_ratio=percent_ratio(q, values.get(_SM_OCCUPANCY), _WHAT[_SM_OCCUPANCY]),
            graphics_engine_active_ratio=percent_ratio(q, values.get(_GRAPHICS), _WHAT[_GRAPHICS]),
            pipe_active_ratio={pipe: r for pipe, m in PIPES.items()
                               if m in values and (r := percent_ratio(q, values[m], _WHAT[m])) is not None},
            dram_bandwidth_ratio=percent_ratio(q, values.get(_DRAM), _WHAT[_DRAM]),
            pcie_traffic_bytes=traffic,
        )

    def read_slow(self, q: Query) -> None:
        return None


def percent_ratio(q: Query, percent: float | None, what: str) -> float | None:
    """A GPM percentage as a ratio: 0..105 % (one ``Query.plausible`` call), else None, counted and logged by it."""
    value = q.plausible(percent, 0, MAX_PERCENT, what)
    return None if value is None else value / 100.0


def render(emit: Emit, fast: Gpm | None, slow: None) -> None:
    if fast is None:
        return
    emit("gpuwatch_sm_active_ratio", (), fast.sm_active_ratio)
    emit("gpuwatch_sm_occupancy_ratio", (), fast.sm_occupancy_ratio)
    emit("gpuwatch_graphics_engine_active_ratio", (), fast.graphics_engine_active_ratio)
    for pipe, ratio in fast.pipe_active_ratio.items():
        emit("gpuwatch_pipe_active_ratio", (pipe,), ratio)
    emit("gpuwatch_dram_bandwidth_ratio", (), fast.dram_bandwidth_ratio)
    for direction, total in fast.pcie_traffic_bytes.items():
        emit("gpuwatch_pcie_traffic_bytes_total", (direction,), total)


GROUP = Group(
    name="gpm",
    history=history,
    help="profiling metrics (GPM, Hopper and newer): SM activity and occupancy, pipes, DRAM bandwidth, PCIe traffic",
    features=("gpm",),
    hardware=("gpm",),
    fast="gpm",
    nvml=Nvml,
    render=render,
    options={"detail": (False, "also SM occupancy, the graphics engine and the fp64/fp32/fp16/integer pipes "
                               "(6 series per GPU more; dcgm-exporter leaves them off too)")},
    specs=(
        Spec("gpuwatch_sm_active_ratio", "gauge", G,
             "Share of the SMs that had at least one warp resident, averaged over the last fast interval "
             "(GPM NVML_GPM_METRIC_SM_UTIL; DCGM DCGM_FI_PROF_SM_ACTIVE). Says how busy a 'utilization 100 %' GPU is."),
        Spec("gpuwatch_sm_occupancy_ratio", "gauge", G,
             "Resident warps over the maximum the SMs can hold, averaged over the last fast interval "
             "(GPM NVML_GPM_METRIC_SM_OCCUPANCY; DCGM DCGM_FI_PROF_SM_OCCUPANCY); with --collector.gpm.detail."),
        Spec("gpuwatch_graphics_engine_active_ratio", "gauge", G,
             "Share of the interval the graphics/compute engine was active "
             "(GPM NVML_GPM_METRIC_GRAPHICS_UTIL; DCGM DCGM_FI_PROF_GR_ENGINE_ACTIVE); with --collector.gpm.detail."),
        Spec("gpuwatch_pipe_active_ratio", "gauge", G + ("pipe",),
             "Share of the interval the SMs' pipe was busy: tensor (any tensor op); fp64, fp32, fp16, integer with "
             "--collector.gpm.detail (GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL, FP64/FP32/FP16/INTEGER_UTIL; "
             "DCGM DCGM_FI_PROF_PIPE_*_ACTIVE)."),
        Spec("gpuwatch_dram_bandwidth_ratio", "gauge", G,
             "DRAM bandwidth used over the theoretical maximum, averaged over the last fast interval "
             "(GPM NVML_GPM_METRIC_DRAM_BW_UTIL; DCGM DCGM_FI_PROF_DRAM_ACTIVE)."),
        Spec("gpuwatch_pcie_traffic_bytes_total", "counter", G + ("direction",),
             "PCIe bytes sent (tx) and received (rx) by the GPU since gpuwatch discovered it, integrated from "
             "the GPM rates (NVML_GPM_METRIC_PCIE_TX/RX_PER_SEC; DCGM DCGM_FI_PROF_PCIE_TX/RX_BYTES)."),
    ),
)
