"""fabric: the GPU's registration with the NVSwitch fabric (HGX / DGX systems) and its health.

The registration's status (success, or the error it completed with) is read too: the rule
fabric_not_ready fires on an error status and its summary names it (no series of its own: the
contract's series budget). So is the health mask's incorrect-configuration field (which
misconfiguration: a wrong system GUID or chassis serial, no partition, too few NVLinks, ...): the rule
fabric_degraded fires on it and names it (no series of its own either: at defaults an NVL72 GPU is at
the 100-series budget).

Slow tier: nvmlDeviceGetGpuFabricInfoV with the v3 structure (R570 and newer: the health summary,
healthy / unhealthy / limited capacity, exported as gpuwatch_fabric_health_summary), else the v2
structure (the health mask only), else nvmlDeviceGetGpuFabricInfo on older drivers. On an NVSwitch
system the fabric manager registers every GPU at boot; until the state is "completed" with status
success, CUDA fails with "system not yet initialized" (the classic HGX failure: nvidia-fabricmanager
is not running). PCIe cards answer NOT_SUPPORTED (or the state NOT_SUPPORTED): no fabric (no series, no
feature series: a class of hardware), never
called again. A state or health summary NVML does not define (a newer driver's, or garbage) is counted as
``implausible_value`` (``Query.plausible``, readings fabric_state and fabric_health) and logged once per GPU, not
silently dropped: no gpuwatch_fabric_state series (or no summary) while the GPU answers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec

STATES: Mapping[int, str] = {1: "not_started", 2: "in_progress", 3: "completed"}  # 0: not supported
_NOT_SUPPORTED = 0  # the state's and the health summary's "not supported" (absent, not implausible)
# health-mask fields (NVML_GPU_FABRIC_HEALTH_MASK_*): issue -> shift; 2 bits each, 1 = true, 2 = false,
# 0 = not supported by this GPU or driver (absent)
HEALTH: Mapping[str, int] = {"degraded_bandwidth": 0, "route_recovery": 2, "route_unhealthy": 4,
                             "access_timeout_recovery": 6}
# the incorrect-configuration field (NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_*): 4 bits at shift 8,
# 0 not supported, 1 none, else which misconfiguration
_CONFIG_SHIFT, _CONFIG_WIDTH = 8, 0xF
CONFIGURATION: Mapping[int, str] = {
    1: "none", 2: "incorrect_sysguid", 3: "incorrect_chassis_sn", 4: "no_partition", 5: "insufficient_nvlinks",
    6: "incompatible_gpu_fw", 7: "invalid_location", 8: "gpu_state_invalid",
}
# the health summary of the v3 structure (NVML_GPU_FABRIC_HEALTH_SUMMARY_*): 0 not supported (absent)
SUMMARIES: Mapping[int, str] = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}


@dataclass(frozen=True, slots=True)
class Fabric:
    fabric_state: str | None = None  # not_started | in_progress | completed
    fabric_status: str | None = None  # the registration's NVML status when completed: "success" or an error name
    fabric_health: Mapping[str, bool] = field(default_factory=dict)  # issue -> present
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    # the driver's verdict (v3 structure): healthy | unhealthy | limited_capacity; None: not reported
    fabric_health_summary: str | None = None
    # which misconfiguration the mask reports ("none" when none; "unknown (N)" for a value not in NVML's list)
    fabric_configuration: str | None = None


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.info = dev.first(dev.call("nvmlDeviceGetGpuFabricInfoV"), dev.call("nvmlDeviceGetGpuFabricInfo"))
        if self.info is not None:
            answer = dev.probe(self.info)
            if answer is not None and answer.get("state") == 0:  # NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
                self.info = None
        dev.feature("fabric", True if self.info is not None else None)  # NOT_SUPPORTED: no fabric

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> Fabric:
        info = q(self.info) if self.info is not None else None
        if info is None:
            return Fabric()
        raw = info["state"]
        state = STATES.get(raw)
        if state is None and raw != _NOT_SUPPORTED:  # an enum value NVML does not define: no state, counted
            q.plausible(raw, 0, max(STATES), "fabric_state", whole=True)
        mask = info.get("health_mask")
        health = {}
        configuration = None
        if mask is not None:
            for issue, shift in HEALTH.items():
                bits = (mask >> shift) & 0x3
                if bits in (1, 2):
                    health[issue] = bits == 1
            config = (mask >> _CONFIG_SHIFT) & _CONFIG_WIDTH
            if config:
                configuration = CONFIGURATION.get(config, f"unknown ({config})")
        raw_summary = info.get("health_summary") or _NOT_SUPPORTED
        summary = SUMMARIES.get(raw_summary)
        if summary is None and raw_summary != _NOT_SUPPORTED:  # as the state's
            q.plausible(raw_summary, 0, max(SUMMARIES), "fabric_health", whole=True)
        return Fabric(state, info["status"] if state == "completed" else None, health,
                      _uuid(info["cluster_uuid"]), int(info["clique_id"]), summary, configuration)


def render(emit: Emit, fast: None, slow: Fabric | None) -> None:
    if slow is None or slow.fabric_state is None:
        return
    # one series: the current state, with the cluster and clique (a state set's 0 series and an info series of its
    # own would cost three more a GPU for nothing: `== 1` reads it)
    emit("gpuwatch_fabric_state", (slow.fabric_state, slow.fabric_cluster_uuid or "",
                                   "" if slow.fabric_clique_id is None else str(slow.fabric_clique_id)), 1)
    for issue, present in slow.fabric_health.items():  # sparse, like gpuwatch_anomaly: only while reported
        if present:
            emit("gpuwatch_fabric_health_issue", (issue,), 1)
    summary = next((value for value, name in SUMMARIES.items() if name == slow.fabric_health_summary), None)
    emit("gpuwatch_fabric_health_summary", (), summary)


GROUP = Group(
    name="fabric",
    help="NVSwitch fabric registration state and health (HGX/DGX; slow tier)",
    features=("fabric",),
    hardware=("fabric",),
    slow="fabric",
    nvml=Nvml,
    render=render,
    specs=(
        Spec("gpuwatch_fabric_state", "gauge", G + ("state", "cluster_uuid", "clique_id"),
             "Always 1, one series: the GPU's current fabric registration state (not_started, in_progress, "
             "completed), with the fabric cluster and clique it belongs to (nvmlDeviceGetGpuFabricInfoV; 'Fabric "
             "State', 'ClusterUUID', 'CliqueId'). Not completed: CUDA fails with 'system not yet initialized' (is "
             "nvidia-fabricmanager running?)."),
        Spec("gpuwatch_fabric_health_issue", "gauge", G + ("issue",),
             "1 while the fabric reports the health issue (degraded_bandwidth, route_recovery, route_unhealthy, "
             "access_timeout_recovery); absent otherwise, like gpuwatch_anomaly (whether the driver reports health "
             "at all: gpuwatch_fabric_health_summary) (nvmlDeviceGetGpuFabricInfoV healthMask; 'Fabric Health')."),
        Spec("gpuwatch_fabric_health_summary", "gauge", G,
             "The driver's fabric health summary, as NVML's number: 1 healthy, 2 unhealthy, 3 limited capacity; "
             "absent where the driver does not report one (nvmlDeviceGetGpuFabricInfoV v3 healthSummary, R570+). "
             "2 or 3: the rule fabric_degraded fires."),
    ),
)
