"""c2c: the NVLink-C2C links between a Grace-coupled GPU (GH200, GB200) and its Grace CPU.

Probed once at discovery: C2C mode (nvmlDeviceGetC2cModeInfoV, isC2cEnabled) and the link count
(NVML_FI_DEV_C2C_LINK_COUNT, field 170, R535+). A GPU without C2C (every x86 node's GPU) answers
NOT_SUPPORTED, C2C disabled or a count of 0: no field of the group is read after discovery. On a C2C GPU every slow
poll reads, in the tier's one field-values batch (no call of its own):

- each link's status (NVML_FI_DEV_C2C_LINK_GET_STATUS, 171, 1 active, 0 inactive) and its maximum
  bandwidth (NVML_FI_DEV_C2C_LINK_GET_MAX_BW, 172, MB/s), with scopeId = link, as NCCL and UCX ask
  for them;
- each link's power state (NVML_FI_DEV_C2C_LINK_POWER_STATE, 234, R575+, scopeId = link: 0 full
  power, 1 low power). A link in low power is idle, not down;
- the error counters (NVML_FI_DEV_C2C_LINK_ERROR_INTR (CRC), _REPLAY, _REPLAY_B2B: 231-233, R575+)
  with scopeId 0. NVML's header says nothing of a link scope for them, and DCGM and Datadog's agent
  read them as device fields: asking every link's scope could count one total once per link where
  NVML ignores the scope, so they are read once.

Each value is checked (``Query.plausible``): a link's maximum bandwidth from 0 to 10**9 MB/s (1 PB/s; the field's
unit, 0xFFFFFFFF is NVML's "not available"), an error counter a whole number from 0 to MAX_COUNTER (2**63-1);
anything else is left out, counted as ``implausible_value`` and logged once per GPU and reading.

The rule c2c_link_down reads the link states. On a C2C GPU the GPU's energy counter
(gpuwatch_energy_joules_total) covers the whole module, not the GPU alone (the power group,
docs/metrics.md). C2C is a class of hardware: its feature series (``c2c``) and its families exist only on
GPUs that have it (3 series a Grace-coupled GPU, and an error kind's from its first error on), none
elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import MAX_COUNTER, Device, Emit, G, Group, Query, Spec, Unsupported, counted
from gpuwatch.groups.power import MODULE_POWER
from gpuwatch.logs import get_logger

_LINK_COUNT = 170
_STATUS = 171  # scope = link: 1 active, 0 inactive
_MAX_BW = 172  # scope = link: MB/s
_POWER_STATE = 234  # scope = link: NVML_C2C_POWER_STATE_FULL_POWER 0, _LOW_POWER 1
ERRORS: Mapping[str, int] = {"crc": 231, "replay": 232, "replay_b2b": 233}
MAX_LINKS = 32  # more than any Grace-coupled GPU has; a larger count is garbage and is capped
_LOW_POWER = 1
MAX_BANDWIDTH_MBPS = 10**9  # a link's largest plausible maximum bandwidth, in the field's MB/s (1 PB/s)
_MODULE_POWER = MODULE_POWER  # the power group's key: field 185 with scopeId NVML_POWER_SCOPE_MODULE


@dataclass(frozen=True, slots=True)
class C2c:
    c2c_up: Mapping[str, bool] = field(default_factory=dict)  # link ("0".."9") -> active
    c2c_low_power: Mapping[str, bool] = field(default_factory=dict)  # link -> in the low-power state
    c2c_bandwidth_bytes: Mapping[str, float] = field(default_factory=dict)  # link -> max bytes/s, per direction
    c2c_errors: Mapping[str, int] = field(default_factory=dict)  # crc | replay | replay_b2b -> count
    c2c_up_at_discovery: Mapping[str, bool] = field(default_factory=dict)  # a fact of discovery, for the rule


class Nvml:
    def __init__(self, dev: Device) -> None:
        enabled = _c2c_enabled(dev)
        count = dev.values([_LINK_COUNT]).get(_LINK_COUNT) if enabled is not False and dev.has_field(_LINK_COUNT) \
            else None
        links = range(min(int(count or 0), MAX_LINKS)) if isinstance(count, int) and count > 0 else range(0)
        states = dev.values([(_STATUS, link) for link in links])
        self.links = tuple(link for link in links if (_STATUS, link) in states)
        for link in self.links:
            dev.field((_STATUS, link), "slow")
        self.names = {link: str(link) for link in self.links}  # the label values, made once (not a string a poll)
        self.at_discovery = {self.names[link]: states[(_STATUS, link)] == 1 for link in self.links}
        on = bool(self.links)
        answered = dev.values([(fid, link) for link in self.links for fid in (_MAX_BW, _POWER_STATE)]) if on else {}
        self.bandwidth = tuple(link for link in self.links
                               if (_MAX_BW, link) in answered and dev.field((_MAX_BW, link), "slow"))
        self.power_state = tuple(link for link in self.links
                                 if (_POWER_STATE, link) in answered and dev.field((_POWER_STATE, link), "slow"))
        errors = dev.values(ERRORS.values()) if on else {}
        # (error kind, field id, the reading's name for Query.plausible)
        self.errors = tuple((name, fid, f"c2c_{name}_errors") for name, fid in ERRORS.items()
                            if fid in errors and dev.field(fid, "slow"))
        # the feature is the hardware: C2C mode on (or links counted); links that cannot be read are said once
        dev.feature("c2c", True if on else (False if enabled is True or links else None))
        if (enabled is True or links) and not on:
            get_logger(component="c2c").warning(
                "c2c_links_unreadable", hint="the driver says C2C is enabled but answers no C2C link count or link "
                                             "status (fields 170/171): no C2C link series and no c2c_link_down on "
                                             "this GPU; check `nvidia-smi c2c -s`")
        if on and not dev.values([_MODULE_POWER]):  # the power group reads it; a C2C GPU should have it
            get_logger(component="c2c").info(
                "module_power_unavailable", links=len(self.links),
                hint="a Grace-coupled GPU whose driver reports no module-scope power (field 185, scopeId 1; "
                     "R535+): gpuwatch_module_power_watts is absent, gpuwatch_energy_joules_total still "
                     "counts the whole module")

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> C2c:
        if not self.links:
            return C2c()
        up = {}
        for link in self.links:
            state = q.field((_STATUS, link))
            if state is not None:
                up[self.names[link]] = state == 1
        low = {}
        for link in self.power_state:
            state = q.field((_POWER_STATE, link))
            if state is not None:
                low[self.names[link]] = state == _LOW_POWER
        bandwidth: dict[str, float] = {}
        for link in self.bandwidth:
            if not up.get(self.names[link]):  # "for active links": an inactive one's is meaningless (not checked)
                continue
            raw = q.field((_MAX_BW, link))
            if raw is None:
                continue
            mbps = q.plausible(raw, 0, MAX_BANDWIDTH_MBPS, "c2c_max_bandwidth")
            if mbps is None:  # the gauge sums the active links: without one it would read as a link down
                bandwidth = {}
                break
            bandwidth[self.names[link]] = float(mbps) * 1e6
        errors = {}
        for name, fid, what in self.errors:
            value = counted(q, q.field(fid), MAX_COUNTER, what)
            if value is not None:
                errors[name] = value
        return C2c(up, low, bandwidth, errors, self.at_discovery)


def _c2c_enabled(dev: Device) -> bool | None:
    """isC2cEnabled of nvmlDeviceGetC2cModeInfoV (R550+); None where the driver or binding cannot say
    (the link count decides then)."""
    try:
        info = dev.probe(dev.call("nvmlDeviceGetC2cModeInfoV"))
    except Unsupported:
        return None
    value = getattr(info, "isC2cEnabled", None) if info is not None else None
    return None if value is None else bool(value)


def render(emit: Emit, fast: None, slow: C2c | None) -> None:
    if slow is None or not slow.c2c_up:
        return
    active = sum(1 for link, up in slow.c2c_up.items() if up or slow.c2c_low_power.get(link))
    emit("gpuwatch_c2c_links", ("active",), active)
    emit("gpuwatch_c2c_links", ("inactive",), len(slow.c2c_up) - active)
    if slow.c2c_bandwidth_bytes:
        emit("gpuwatch_c2c_bandwidth_bytes_per_second", (), sum(slow.c2c_bandwidth_bytes.values()))
    for name, count in slow.c2c_errors.items():  # sparse, as gpuwatch_xid_errors_total: from the first error on
        if count:
            emit("gpuwatch_c2c_errors_total", (name,), count)


GROUP = Group(
    name="c2c",
    help="NVLink-C2C links between a Grace-coupled GPU and its Grace CPU (GH200, GB200): state, bandwidth, errors",
    features=("c2c",),
    hardware=("c2c",),
    slow="c2c",
    nvml=Nvml,
    fields={_LINK_COUNT: "C2C link count"},
    render=render,
    specs=(
        Spec("gpuwatch_c2c_links", "gauge", G + ("state",),
             "How many of the GPU's NVLink-C2C links (to its Grace CPU) are active / inactive; a link "
             "in low power counts as active (field NVML_FI_DEV_C2C_LINK_GET_STATUS per link; 'nvidia-smi c2c -s')."),
        Spec("gpuwatch_c2c_bandwidth_bytes_per_second", "gauge", G,
             "Maximum bandwidth of the GPU's active NVLink-C2C links together, per direction, in bytes per second; "
             "drops when a link goes down (field NVML_FI_DEV_C2C_LINK_GET_MAX_BW per "
             "link, MB/s; 'nvidia-smi c2c -s')."),
        Spec("gpuwatch_c2c_errors_total", "counter", G + ("error",),
             "NVLink-C2C link errors: crc, replay, replay_b2b (back-to-back replays); a kind's series appears with "
             "its first error (zero for almost every GPU forever: no 0 series); R575+ drivers "
             "(fields NVML_FI_DEV_C2C_LINK_ERROR_INTR/_REPLAY/_REPLAY_B2B; DCGM "
             "DCGM_FI_DEV_C2C_LINK_ERROR_*)."),
    ),
)
