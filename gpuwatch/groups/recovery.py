"""recovery: the recovery action the driver asks for (R570 and newer).

Slow tier, one entry of the tier's field-values batch: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230,
nvidia-smi -q "GPU Recovery Action"), which replaces the deprecated reset-status fields 226/227. After
an uncorrectable error the driver says what it takes to get the GPU back: nothing, a GPU reset, a node
reboot, draining peer-to-peer traffic, ... (``ACTIONS``). Older drivers answer the entry with an error:
feature ``recovery_action`` 0. ``gpuwatch_recovery_action`` is sparse: present only while the driver asks
for an action (0, none, is what almost every GPU says forever; the series budget has no room for it).
A value this table does not know is logged once per GPU and value, and exported as the driver's
number, never given a meaning; the rule recovery_action_required calls it unknown. No enum value at all
(NaN, a fraction, a negative or anything above 255) is left out and counted (Query.plausible).

The driver also reports a change as XID 154 (and the event nvmlEventTypeGpuRecoveryAction): the xid
group counts it like any XID; the action itself is read at the next slow poll (at most one slow
interval later), so the event asks for no read of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec
from gpuwatch.logs import get_logger

FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
_MAX_ACTION = 255  # an enum: anything larger is no action (a driver that answered something else)
#: NVML_GPU_RECOVERY_ACTION_* -> (name, what the operator does). 0 is "none": nothing to do.
ACTIONS: Mapping[int, tuple[str, str]] = {
    0: ("none", "nothing: the GPU can be used again by starting a new process"),
    1: ("gpu_reset", "drain the GPU and reset it (nvidia-smi -r)"),
    2: ("node_reboot", "drain the node and reboot it"),
    3: ("drain_p2p", "drain peer-to-peer (P2P) traffic: drain the jobs on the node"),
    4: ("drain_and_reset", "drain peer-to-peer traffic, then reset the GPU (nvidia-smi -r)"),
    5: ("recover_imex_domain", "recover the IMEX domain (see NVIDIA's IMEX documentation)"),
    6: ("bus_reset", "drain the GPU and reset its PCIe bus"),
    7: ("system_reboot", "drain the node and reboot the system"),
}


@dataclass(frozen=True, slots=True)
class Recovery:
    recovery_action: int | None = None  # NVML_GPU_RECOVERY_ACTION_*, as the driver reports it


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.supported = dev.field(FIELD, "slow")
        dev.feature("recovery_action", self.supported)
        self.unknown: set[int] = set()  # values logged once

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> Recovery:
        value = q.field(FIELD) if self.supported else None
        if value is None:
            return Recovery()
        plausible = q.plausible(value, 0, _MAX_ACTION, "recovery_action", whole=True)
        if plausible is None:  # not an enum value at all (NaN, negative, huge): no reading, logged and counted
            return Recovery()
        action = int(plausible)
        if action not in ACTIONS and action not in self.unknown:
            self.unknown.add(action)
            get_logger(component="recovery").warning(
                "unknown_recovery_action", value=action,
                hint="the driver asks for a recovery action this gpuwatch does not know: see `nvidia-smi -q` "
                     "(GPU Recovery Action) and NVIDIA's docs; the rule recovery_action_required fires on it")
        return Recovery(action)


def render(emit: Emit, fast: None, slow: Recovery | None) -> None:
    # sparse, like gpuwatch_anomaly: 0 (none) is what almost every GPU says forever, and the contract's
    # series budget has no room for it; the feature series says whether the driver reports the action
    if slow is not None and slow.recovery_action:
        emit("gpuwatch_recovery_action", (), slow.recovery_action)


GROUP = Group(
    name="recovery",
    help="The recovery action the driver asks for after an error (field 230, R570+; slow tier)",
    features=("recovery_action",),
    slow="recovery",
    nvml=Nvml,
    fields={FIELD: "GPU recovery action"},
    render=render,
    specs=(
        Spec("gpuwatch_recovery_action", "gauge", G,
             "The recovery action the driver asks for, as NVML's number: 0 none, 1 GPU reset, 2 node reboot, "
             "3 drain peer-to-peer, 4 drain and reset, 5 recover the IMEX domain, 6 PCIe bus reset, 7 system "
             "reboot (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; nvidia-smi 'GPU Recovery Action'). Present only while "
             "the driver asks for an action, absent while it asks for none (0), like gpuwatch_anomaly; "
             "gpuwatch_gpu_feature_supported{feature=\"recovery_action\"} says whether the driver reports it. "
             "Present: the rule recovery_action_required fires."),
    ),
)
