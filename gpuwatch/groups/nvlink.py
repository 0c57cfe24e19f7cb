"""nvlink: the GPU's NVLink links, their state, error counters and traffic.

Slow tier, one nvmlDeviceGetFieldValues batch per GPU (not links x counters calls): the link count
(NVML_FI_DEV_NVLINK_LINK_COUNT, probed at discovery), each link's state (NVML_FI_DEV_NVLINK_GET_STATE
with scopeId = link), the driver's error totals over all links (NVML_FI_DEV_NVLINK_CRC_FLIT/CRC_DATA/
REPLAY/RECOVERY_ERROR_COUNT_TOTAL, ECC_DATA_ERROR_COUNT_TOTAL: what dcgm-exporter exports as
DCGM_FI_DEV_NVLINK_*_TOTAL) and the data throughput counters over all links
(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, scopeId = all links). With
``--collector.nvlink.per-link``: each link's up state and its replay, recovery and flit-CRC counters
(NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY/RECOVERY/CRC, scopeId = link; R520+, not on Blackwell, whose
links report only the totals). A GPU without NVLink (PCIe cards) has no link count: feature 0, no
calls after discovery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec, Unsupported

_LINK_COUNT = 91
_STATE = 165  # scope = link: 1 active, 0 inactive
ALL_LINKS = 0xFFFFFFFF  # the scopeId of "every link"
ERRORS: Mapping[str, int] = {"crc_flit": 38, "crc_data": 45, "replay": 52, "recovery": 59, "ecc_data": 160}
_LINK_ERRORS: Mapping[str, int] = {"replay": 161, "recovery": 162, "crc_flit": 163}
_TRAFFIC: Mapping[str, int] = {"tx": 138, "rx": 139}  # KiB
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS


@dataclass(frozen=True, slots=True)
class NvLink:
    nvlink_up: Mapping[str, bool] = field(default_factory=dict)  # link ("0".."35") -> active
    nvlink_errors: Mapping[str, int] = field(default_factory=dict)  # error -> count over all links
    nvlink_traffic_bytes: Mapping[str, float] = field(default_factory=dict)  # tx | rx, all links
    nvlink_link_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (link, error) -> count
    nvlink_per_link: bool | None = None  # True: export the per-link series (--collector.nvlink.per-link)
    # facts of discovery, carried for the rules: which links were active then, and what is at the other
    # end of each ("NVSwitch 00000000:05:00.0", "GPU 00000000:18:00.0")
    nvlink_up_at_discovery: Mapping[str, bool] = field(default_factory=dict)
    nvlink_remote: Mapping[str, str] = field(default_factory=dict)


class Nvml:
    def __init__(self, dev: Device) -> None:
        count = dev.values([_LINK_COUNT]).get(_LINK_COUNT) if dev.has_field(_LINK_COUNT) else None
        links = range(min(int(count or 0), MAX_LINKS))
        states = dev.values([(_STATE, link) for link in links])
        self.links = tuple(link for link in links if (_STATE, link) in states)
        for link in self.links:
            dev.field((_STATE, link), "slow")
        self.at_discovery = {str(link): states[(_STATE, link)] == 1 for link in self.links}
        self.remote = {str(link): text for link in self.links if (text := _remote(dev, link))}
        on = bool(self.links)
        self.errors = tuple((name, fid) for name, fid in ERRORS.items() if on and dev.field(fid, "slow"))
        traffic = dev.values([(fid, ALL_LINKS) for fid in _TRAFFIC.values()]) if on else {}
        self.traffic = tuple((d, fid) for d, fid in _TRAFFIC.items()
                             if (fid, ALL_LINKS) in traffic and dev.field((fid, ALL_LINKS), "slow"))
        self.per_link = on and bool(dev.option("per-link"))
        self.link_errors: tuple[tuple[str, str, int], ...] = ()
        if self.per_link:
            keys = [(fid, link) for link in self.links for fid in _LINK_ERRORS.values()]
            answered = dev.values(keys)
            self.link_errors = tuple((str(link), name, link) for link in self.links
                                     for name, fid in _LINK_ERRORS.items()
                                     if (fid, link) in answered and dev.field((fid, link), "slow"))
        dev.feature("nvlink", on)

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> NvLink:
        if not self.links:
            return NvLink()
        up = {}
        for link in self.links:
            state = q.field((_STATE, link))
            if state is not None:
                up[str(link)] = state == 1
        errors = {}
        for name, fid in self.errors:
            value = q.field(fid)
            if value is not None:
                errors[name] = int(value)
        traffic = {}
        for direction, fid in self.traffic:
            value = q.field((fid, ALL_LINKS))
            if value is not None:
                traffic[direction] = float(value) * 1024.0
        link_errors = {}
        for label, name, link in self.link_errors:
            value = q.field((_LINK_ERRORS[name], link))
            if value is not None:
                link_errors[(label, name)] = int(value)
        return NvLink(up, errors, traffic, link_errors, self.per_link or None, self.at_discovery, self.remote)


_REMOTE_TYPES = {0: "GPU", 1: "IBM NPU", 2: "NVSwitch"}


def _remote(dev: Device, link: int) -> str | None:
    """What is at the other end of ``link`` (nvmlDeviceGetNvLinkRemoteDeviceType and
    GetNvLinkRemotePciInfo_v2, read once at discovery); None when the driver does not say."""
    try:
        kind = dev.probe(dev.call("nvmlDeviceGetNvLinkRemoteDeviceType", link))
    except Unsupported:
        return None
    name = _REMOTE_TYPES.get(kind) if kind is not None else None
    if name is None:
        return None
    try:
        pci = dev.probe(dev.call("nvmlDeviceGetNvLinkRemotePciInfo", link))
    except Unsupported:
        pci = None
    bus = getattr(pci, "busId", None) if pci is not None else None
    if isinstance(bus, bytes):
        bus = bus.decode("utf-8", "replace")
    return f"{name} {bus}" if bus else name


def render(emit: Emit, fast: None, slow: NvLink | None) -> None:
    if slow is None or not slow.nvlink_up:
        return
    active = sum(1 for up in slow.nvlink_up.values() if up)
    emit("gpuwatch_nvlink_links", ("active",), active)
    emit("gpuwatch_nvlink_links", ("inactive",), len(slow.nvlink_up) - active)
    for name, count in slow.nvlink_errors.items():
        emit("gpuwatch_nvlink_errors_total", (name,), count)
    for direction, total in slow.nvlink_traffic_bytes.items():
        emit("gpuwatch_nvlink_traffic_bytes_total", (direction,), total)
    if slow.nvlink_per_link:
        for link, up in slow.nvlink_up.items():
            emit("gpuwatch_nvlink_link_up", (link,), up)
        for (link, name), count in slow.nvlink_link_errors.items():
            emit("gpuwatch_nvlink_link_errors_total", (link, name), count)


GROUP = Group(
    name="nvlink",
    help="NVLink link states, error counters and traffic (one field-values batch per GPU, slow tier)",
    features=("nvlink",),
    slow="nvlink",
    nvml=Nvml,
    fields={_LINK_COUNT: "NVLink link count", **{fid: f"NVLink {name} errors" for name, fid in ERRORS.items()}},
    options={"per-link": (False, "export gpuwatch_nvlink_link_up and gpuwatch_nvlink_link_errors_total per link "
                                 "(18 links per H100/H200: off by default)")},
    render=render,
    specs=(
        Spec("gpuwatch_nvlink_links", "gauge", G + ("state",),
             "How many of the GPU's NVLink links are active / inactive (field NVML_FI_DEV_NVLINK_GET_STATE per link; "
             "'nvidia-smi nvlink -s')."),
        Spec("gpuwatch_nvlink_errors_total", "counter", G + ("error",),
             "NVLink errors summed over the GPU's links: crc_flit, crc_data, replay, recovery, ecc_data "
             "(fields NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL; DCGM DCGM_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL; "
             "'nvidia-smi nvlink -e')."),
        Spec("gpuwatch_nvlink_traffic_bytes_total", "counter", G + ("direction",),
             "NVLink data bytes sent (tx) and received (rx) over all links (fields "
             "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, KiB; DCGM DCGM_FI_PROF_NVLINK_TX/RX_BYTES)."),
        Spec("gpuwatch_nvlink_link_up", "gauge", G + ("link",),
             "1 while the NVLink link is active, 0 while inactive; with --collector.nvlink.per-link "
             "(field NVML_FI_DEV_NVLINK_GET_STATE)."),
        Spec("gpuwatch_nvlink_link_errors_total", "counter", G + ("link", "error"),
             "NVLink errors of one link: replay, recovery, crc_flit; with --collector.nvlink.per-link "
             "(fields NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY/RECOVERY/CRC, scopeId = link; not on Blackwell)."),
    ),
)
