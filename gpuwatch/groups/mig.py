"""mig: the MIG instances of a MIG-enabled GPU (A100, H100, H200, B200 in MIG mode).

Probed once per GPU: nvmlDeviceGetMigMode (NOT_SUPPORTED on GPUs without MIG; MIG off: feature 0).
Slow tier: the MIG devices are enumerated again every slow poll (nvmlDeviceGetMaxMigDeviceCount,
GetMigDeviceHandleByIndex, and per device its GPU/compute instance ids, UUID and name, whose suffix
is the profile, e.g. "3g.40gb"), and at once on NVML's MIG configuration-change event (the events
thread registers nvmlEventMigConfigChange on MIG-enabled GPUs; log event mig_config_changed): the
fast tier reads a created instance from its next poll, the instance list follows at the next slow poll.
Fast tier, per instance: its frame buffer (nvmlDeviceGetMemoryInfo on the MIG handle) and its GPM
metrics over the last interval (nvmlGpmMigSampleGet with the GPU instance id, then
nvmlGpmMetricsGet: SM activity, DRAM bandwidth, the tensor pipe). On a MIG-enabled GPU NVML has no
utilization (and no remapped rows) for the parent: those readings are absent there, with their
features 0; the per-instance SM activity says how busy each instance is.

Each value is checked (``Query.plausible``): the frame buffer's total from 0 to MAX_COUNTER bytes (2**64-1 is a
sentinel), its used bytes from 0 to that total, a GPM percentage from 0 to 105 (as the gpm group's); anything else
(NaN, a negative, a sentinel) is left out, counted as ``implausible_value`` and logged once per GPU and reading, and
the instance's other readings stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatch.frozen import quick
from gpuwatch.groups.base import MAX_COUNTER, Device, Emit, G, Group, Query, Spec, Unsupported
from gpuwatch.groups.gpm import percent_ratio

_SM_ACTIVE, _TENSOR, _DRAM = 2, 5, 10  # NVML_GPM_METRIC_SM_UTIL, ANY_TENSOR_UTIL, DRAM_BW_UTIL
METRICS = (_SM_ACTIVE, _TENSOR, _DRAM)


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG device as enumerated (slow tier)."""

    gpu_instance: int
    compute_instance: int = 0
    mig_uuid: str = ""
    profile: str = ""  # "3g.40gb"


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class MigReading:
    """One MIG instance's readings of a fast poll."""

    gpu_instance: int
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    sm_active_ratio: float | None = None
    dram_bandwidth_ratio: float | None = None
    tensor_active_ratio: float | None = None


MIG_CONFIG_CHANGE = 0x100  # nvmlEventMigConfigChange: an instance was created or destroyed


class Nvml:
    def __init__(self, dev: Device) -> None:
        transient = False
        try:
            mode = dev.probe(dev.call("nvmlDeviceGetMigMode"))
            transient = mode is None  # a transient error: whether MIG is on is not known now
        except Unsupported:
            mode = None
        self.devices: Any = None
        if mode is not None and int(mode[0]) == 1:  # NVML_DEVICE_MIG_ENABLE
            devices: Any = dev.call("gpuwatch.mig", METRICS)
            # enumerate now, and take the first GPM sample of each instance: the first poll has values
            if devices is not None and dev.supported(devices.instances):
                dev.supported(devices.readings)
                self.devices = devices
                dev.events(MIG_CONFIG_CHANGE, handler=devices.on_event)  # enumerated again at once
        # MIG enabled but its devices cannot be enumerated: 0; MIG off or not a MIG GPU: nothing
        enabled = (mode is not None and int(mode[0]) == 1) or transient
        self.idle_fast = self.devices is None  # NvmlReader: FastSample's default, (), every poll
        dev.feature("mig", True if self.devices is not None else (False if enabled else None))

    def read_fast(self, q: Query) -> tuple[MigReading, ...]:
        got = q(self.devices.readings) if self.devices is not None else None
        if not got:
            return ()
        plausible = q.plausible
        out = []
        for r in got:
            gpm = r["metrics"] or {}
            total = plausible(r["memory_total"], 0, MAX_COUNTER, "mig_memory_total")
            used = plausible(r["memory_used"], 0, MAX_COUNTER if total is None else total, "mig_memory_used")
            out.append(MigReading(r["gpu_instance"], None if total is None else int(total),
                                  None if used is None else int(used),
                                  percent_ratio(q, gpm.get(_SM_ACTIVE), "mig_sm_active"),
                                  percent_ratio(q, gpm.get(_DRAM), "mig_dram_bandwidth"),
                                  percent_ratio(q, gpm.get(_TENSOR), "mig_tensor_pipe_active")))
        return tuple(out)

    def read_slow(self, q: Query) -> tuple[MigInstance, ...]:
        got = q(self.devices.instances) if self.devices is not None else None
        if not got:
            return ()
        return tuple(MigInstance(i["gpu_instance"], i["compute_instance"], i["mig_uuid"], i["profile"]) for i in got)


def render(emit: Emit, fast: tuple[MigReading, ...] | None, slow: tuple[MigInstance, ...] | None) -> None:
    for inst in slow or ():
        emit("gpuwatch_mig_instance_info",
             (str(inst.gpu_instance), str(inst.compute_instance), inst.mig_uuid, inst.profile), 1)
    for r in fast or ():
        gi = (str(r.gpu_instance),)
        emit("gpuwatch_mig_memory_total_bytes", gi, r.memory_total_bytes)
        emit("gpuwatch_mig_memory_used_bytes", gi, r.memory_used_bytes)
        emit("gpuwatch_mig_sm_active_ratio", gi, r.sm_active_ratio)
        emit("gpuwatch_mig_dram_bandwidth_ratio", gi, r.dram_bandwidth_ratio)
        emit("gpuwatch_mig_pipe_active_ratio", (*gi, "tensor"), r.tensor_active_ratio)


GI = G + ("gpu_instance",)

GROUP = Group(
    name="mig",
    events=True,
    help="MIG instances: enumerated in the slow tier, frame buffer and GPM activity per instance in the fast tier",
    features=("mig",),
    hardware=("mig",),
    fast="mig",
    slow="mig",
    nvml=Nvml,
    render=render,
    specs=(
        Spec("gpuwatch_mig_instance_info", "gauge", G + ("gpu_instance", "compute_instance", "mig_uuid", "profile"),
             "Always 1: a MIG device of the GPU, its GPU and compute instance ids, UUID and profile "
             "(nvmlDeviceGetMigDeviceHandleByIndex; 'nvidia-smi -L' MIG lines)."),
        Spec("gpuwatch_mig_memory_total_bytes", "gauge", GI,
             "Frame buffer of the MIG instance in bytes (nvmlDeviceGetMemoryInfo on the MIG handle; "
             "'Shared FB Memory Usage Total')."),
        Spec("gpuwatch_mig_memory_used_bytes", "gauge", GI,
             "Frame buffer used in the MIG instance in bytes ('Shared FB Memory Usage Used')."),
        Spec("gpuwatch_mig_sm_active_ratio", "gauge", GI,
             "Share of the instance's SMs with work, averaged over the last fast interval "
             "(nvmlGpmMigSampleGet, NVML_GPM_METRIC_SM_UTIL; DCGM DCGM_FI_PROF_SM_ACTIVE per GPU instance)."),
        Spec("gpuwatch_mig_dram_bandwidth_ratio", "gauge", GI,
             "DRAM bandwidth the instance used over its maximum (GPM DRAM_BW_UTIL; DCGM DCGM_FI_PROF_DRAM_ACTIVE)."),
        Spec("gpuwatch_mig_pipe_active_ratio", "gauge", GI + ("pipe",),
             "Share of the interval the instance's tensor pipe was busy (pipe=tensor; GPM ANY_TENSOR_UTIL)."),
    ),
)
