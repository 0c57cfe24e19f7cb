"""xid: XID error events, as the driver reports them (nvmlEventSetWait, on a thread of their own).

At discovery each GPU is asked whether it delivers XID events (nvmlDeviceGetSupportedEventTypes)
and registered in one event set; the events thread waits on it and the store counts every event.
``gpuwatch_xid_events_total`` exists at 0 from the start on a GPU that delivers events; a code's
own series appears with its first event. With ``--no-collector.xid`` nothing is registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec, Unsupported

XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError


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

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> None:
        return None


def select(state: Any, fast: Any, slow: Any) -> tuple[Any, Any]:
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
