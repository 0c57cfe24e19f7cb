"""xid: XID error events, as the driver reports them (nvmlEventSetWait, on a thread of their own).

At discovery each GPU is asked whether it delivers XID events (nvmlDeviceGetSupportedEventTypes)
and registered in one event set; the events thread waits on it and the store counts every event.
``gpuwatch_xid_events_total`` exists at 0 from the start on a GPU that delivers events; a code's
own series appears with its first event. With ``--no-collector.xid`` nothing is registered.

``XIDS`` is gpuwatch's one XID table (meaning, severity, action per code): the ``xid_event`` log line,
the rule xid_critical (its critical set and summary) and the table in docs/runbooks.md all read it.
XID 154 (the driver's recovery action changed) is counted like any other code; the action itself is
the recovery group's reading (NVML field 230), read at the next slow poll: the event triggers no
read of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec, Unsupported

XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError

#: NVIDIA's Xid catalog for Ampere and newer (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
#: the codes a data-center GPU reports): code -> (meaning, severity, action). The meaning is the catalog's
#: description; the action is its immediate resolution bucket in operator words (RESTART_APP: restart the
#: application, RESET_GPU: reset the GPU, RESTART_BM: reboot the node, IGNORE: none, CONTACT_SUPPORT: contact
#: NVIDIA support). Severity (XID_SEVERITIES) is gpuwatch's: "critical" when the GPU, not the application, is
#: in trouble (xid_critical fires on exactly these), "warning" when the GPU may be degrading or the driver
#: recorded a repair, "application" for an application's own fault (the GPU is fine), "info" for events that
#: report and ask for nothing by themselves. Where the catalog gives no resolution bucket the action says so
#: ("see NVIDIA's Xid catalog"); a code not here is described as unknown (describe()).
XID_SEVERITIES: tuple[str, ...] = ("critical", "warning", "application", "info")
_CATALOG = "see NVIDIA's Xid catalog"
_NVLINK5 = "depends on the sub-code in the kernel log (see NVIDIA's Xid catalog); XID 154 follows if a reset is needed"
_RESET = "reset the GPU (nvidia-smi -r) once drained"
XIDS: Mapping[int, tuple[str, str, str]] = {
    13: ("graphics engine exception", "application", "restart the application (debug it with compute-sanitizer)"),
    31: ("GPU memory page fault", "application", "restart the application (debug it with compute-sanitizer)"),
    32: ("invalid or corrupted push buffer stream (DMA over PCIe)", "warning",
         "restart the application; check the PCIe link if it recurs"),
    38: ("driver firmware error (watchdog timeout)", "warning", "none; contact NVIDIA support if it recurs"),
    43: ("GPU stopped processing (the application hit a software fault)", "application",
         "none: the GPU stays healthy"),
    45: ("preemptive cleanup after previous errors or an aborted application", "application",
         "none with other XIDs (follow those); alone: restart nvidia-fabricmanager"),
    46: ("GPU stopped processing (GPU timeout)", "critical", _RESET),
    48: ("double-bit ECC error", "critical", "reset the GPU or reboot the node; RMA if it recurs"),
    61: ("internal micro-controller breakpoint/warning (pre-Ampere; unused on Ampere and newer)", "warning",
         "contact NVIDIA support if it recurs"),
    62: ("internal micro-controller halt", "critical", _RESET),
    63: ("ECC page retirement or row remapping recorded", "warning",
         "none now; reset the GPU when drained to apply the remap (row_remap_pending)"),
    64: ("ECC page retirement or row remapper recording failure", "critical",
         "reset the GPU; contact NVIDIA support (RMA)"),
    68: ("video decoder (NVDEC0) exception", "application", "restart the application"),
    69: ("graphics engine class error", "application", "restart the application"),
    74: ("NVLink error", "critical", "reset the GPU or reboot the node; contact support if it recurs"),
    79: ("GPU has fallen off the bus", "critical", "reboot the node; contact support if it recurs"),
    92: ("high single-bit ECC error rate", "warning", "none; contact NVIDIA support if it persists"),
    94: ("contained ECC error", "warning", "restart the application; reset the GPU when convenient"),
    95: ("uncontained ECC error", "critical", _RESET),
    109: ("context switch timeout", "critical", _RESET),
    110: ("security fault", "critical", "reset the GPU; cold-reset the node and contact the vendor if it recurs"),
    119: ("GSP RPC timeout", "critical", "reset the GPU; power-cycle the node if it persists"),
    120: ("GSP error", "critical", "reset the GPU; power-cycle the node if it persists"),
    121: ("C2C (Grace) link corrected error", "warning", "none; reset the GPU in a service window to retrain the link"),
    122: ("SPI flash read failure (unused on current GPUs)", "warning", "contact NVIDIA support"),
    123: ("SPI flash write failure (unused on current GPUs)", "warning", "contact NVIDIA support"),
    136: ("NVLink link training failed", "critical", _RESET),
    137: ("NVLink privilege error (illegal peer-to-peer access)", "application",
         "none; debug the application (compute-sanitizer)"),
    140: ("unrecovered ECC error", "critical", "reset the GPU; contact NVIDIA support if it persists"),
    143: ("GPU initialization error", "critical", _RESET),
    144: ("NVLink SAW error", "warning", _NVLINK5),
    145: ("NVLink RLW error", "warning", _NVLINK5),
    146: ("NVLink TLW error", "warning", _NVLINK5),
    147: ("NVLink TREX error", "warning", _NVLINK5),
    148: ("NVLink NVLPW_CTRL error", "warning", _NVLINK5),
    149: ("NVLink NETIR error", "warning", _NVLINK5),
    150: ("NVLink MSE error", "warning", _NVLINK5),
    151: ("key rotation error (confidential computing)", "warning", "restart the VM"),
    154: ("GPU recovery action changed", "info",
         "follow the recovery action the driver names (rule recovery_action_required)"),
    155: ("NVLink SW-defined error (a link taken down on purpose, e.g. to sleep)", "warning", _RESET),
    156: ("resource retirement event", "warning", "reset the GPU when drained to apply the retirement"),
    157: ("resource retirement failure (no spare resources left)", "warning",
         "none; contact NVIDIA support if it recurs"),
    158: ("GPU fatal timeout", "critical", _RESET),
    159: ("CHI non-data error (C2C link)", "warning", _CATALOG),
    160: ("channel retirement event", "warning", "none"),
    161: ("channel retirement failure", "warning", "none; contact NVIDIA support if it recurs"),
    162: ("power smoothing circuitry re-engaged", "info", "none"),
    163: ("power smoothing circuitry disengaged", "info",
         "none; resolve the thermal events, or reload the driver or reset the GPU after a timeout"),
    164: ("power smoothing circuitry low lifetime", "warning",
         "plan to replace the GPU if power smoothing is needed"),
    165: ("power smoothing circuitry lifetime exhausted", "warning",
         "replace the GPU if power smoothing is needed"),
    166: ("encrypted NVLink traffic before the link was configured (confidential computing)", "warning", _CATALOG),
    167: ("PCIe fatal timeout", "warning", _CATALOG),
    168: ("errors in the write-protected region (ECC disabled)", "warning",
         "enable ECC (row remapping) or reboot the node"),
    169: ("internal micro-controller (SEC2) halt", "warning", _CATALOG),
    170: ("interrupt in confidential-computing mode", "warning", _CATALOG),
    171: ("uncorrectable DRAM error (details of XID 48)", "critical",
         "as XID 48: reset the GPU or reboot the node; RMA if it recurs"),
    172: ("uncorrectable SRAM error (details of XID 48)", "critical",
         "as XID 48: reset the GPU; RMA if the SRAM error threshold is exceeded"),
}


def describe(code: int) -> tuple[str, str, str]:
    """(meaning, severity, action) of an XID code; a code the table does not know is "unknown",
    never a guess."""
    return XIDS.get(code) or ("unknown XID", "unknown", _CATALOG)


#: The codes that mean the GPU itself is in trouble: the rule xid_critical fires on these.
CRITICAL_XIDS: frozenset[int] = frozenset(code for code, (_, severity, _) in XIDS.items() if severity == "critical")


@dataclass(frozen=True, slots=True)
class XidEvent:
    uuid: str
    xid: int
    timestamp: float  # wall-clock seconds


class Nvml:
    def __init__(self, dev: Device) -> None:
        try:
            self.supported = bool(int(dev.probe(dev.call("nvmlDeviceGetSupportedEventTypes")) or 0)
                                  & XID_CRITICAL_ERROR)
        except Unsupported:
            self.supported = False
        dev.feature("xid_events", self.supported)
        if self.supported:  # delivered by the backend's wait_events; a refused registration: feature 0
            dev.events(XID_CRITICAL_ERROR, refused="xid_events")

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> None:
        return None


def select(state: Any, fast: Any, slow: Any, host: Any) -> tuple[Any, Any]:
    """The readings: the GPU's counts per code and the last time of each (store-kept, replaced at
    every event); nothing on a GPU that has neither events nor counts."""
    if not (state.features.get("xid_events") or state.xid_counts):
        return None, None
    return state.xid_counts, state.xid_last_timestamp


def render(emit: Emit, counts: Mapping[int, int] | None, last: Mapping[int, float] | None) -> None:
    if counts is None:
        return
    emit("gpuwatch_xid_events_total", (), sum(counts.values()))
    for xid, count in counts.items():  # a code's series appears with its first event
        emit("gpuwatch_xid_errors_total", (str(xid),), count)
    for xid, when in (last or {}).items():
        emit("gpuwatch_xid_last_timestamp_seconds", (str(xid),), when)


GROUP = Group(
    name="xid",
    events=True,
    help="XID error events (nvmlEventSetWait on a thread of its own)",
    features=("xid_events",),
    nvml=Nvml,
    select=select,
    render=render,
    specs=(
        Spec("gpuwatch_xid_events_total", "counter", G,
             "XID error events received from NVML (nvmlEventSetWait), any code; at 0 from the start on GPUs "
             "that deliver XID events."),
        Spec("gpuwatch_xid_errors_total", "counter", G + ("xid",),
             "XID error events per XID code; a code's series appears with its first event "
             "(alert on gpuwatch_xid_events_total, look here for the codes)."),
        Spec("gpuwatch_xid_last_timestamp_seconds", "gauge", G + ("xid",),
             "Unix time of the last XID event of that code."),
    ),
)
