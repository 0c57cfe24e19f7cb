"""nvlink: the GPU's NVLink links, their state, error counters and traffic, by NVLink generation.

Slow tier, one nvmlDeviceGetFieldValues batch per GPU (not links x counters calls): the link count
(NVML_FI_DEV_NVLINK_LINK_COUNT, probed at discovery; up to 36 links), each link's state
(NVML_FI_DEV_NVLINK_GET_STATE with scopeId = link: 0 inactive, 1 active, 2 SLEEP -- a low-power idle
link is not down --, 3 active with traffic disabled) and the data throughput counters over all links
(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, scopeId = all links).

The error counters depend on the generation:

- Before Blackwell (NVLink 4 and older): the driver's totals over all links
  (NVML_FI_DEV_NVLINK_CRC_FLIT/CRC_DATA/REPLAY/RECOVERY_ERROR_COUNT_TOTAL, ECC_DATA_ERROR_COUNT_TOTAL:
  what dcgm-exporter exports as DCGM_FI_DEV_NVLINK_*_TOTAL); a total the driver does not answer
  (replay, recovery, crc_flit) is the sum of the links' data-link counters
  (NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY/RECOVERY/CRC, scopeId = link), read in the same batch.
- From Blackwell (NVLink5: the GPU's architecture is Blackwell or newer, or its NVLink version is
  NVML_NVLINK_VERSION_5_0 = 7 or newer): the header marks the DL counters "unsupported for
  Blackwell+" (NVIDIA's mock still serves them: they are never read here), and their replacements are
  the NVLink5 counters NVML_FI_DEV_NVLINK_COUNT_*: link recovery successful/failed (213/214) and
  effective errors (219) by default, with the effective bit error rate (220, packed: mantissa bits
  8-11, exponent bits 0-7, mantissa 15 with exponent 255 = no errors); the symbol errors (221: what
  FEC corrected, high on a healthy link), the total recovery events (215), the packet errors (206-212:
  malformed packets, buffer overruns, receive, remote, general, local link integrity, transmit
  discards) and the symbol BER (222) with ``--collector.nvlink.packet-errors``. Each is asked as the
  device total (scopeId = 0xFFFFFFFF, as DCGM does: one entry per counter); where the driver does not
  answer the total, per link and summed.

Every value is checked (``Query.plausible``): a counter (errors in counts, traffic in KiB) from 0 to MAX_COUNTER
(2**63-1: 0xFFFFFFFFFFFFFFFF is NVML's "not available"), a bit error rate from 0 to 1 after decoding, a link state
one of NVML's four; anything else is left out, counted as ``implausible_value`` and logged once per GPU and reading.

With ``--collector.nvlink.per-link``: each link's up state and its error counters (the DL counters
before Blackwell, the default NVLink5 counters and the symbol errors from Blackwell). A GPU without
NVLink (PCIe cards) has no link count: no series and no feature series (a class of hardware), no calls
after discovery; one whose links are counted but answer nothing has the nvlink feature 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import MAX_COUNTER, Device, Emit, FieldKey, G, Group, Query, Spec, Unsupported, counted, whole

_LINK_COUNT = 91
_STATE = 165  # scope = link: NVML_NVLINK_STATE_INACTIVE 0, ACTIVE 1, SLEEP 2, ACTIVE_TRAFFIC_DISABLED 3
_INACTIVE = 0
_STATES = frozenset({0, 1, 2, 3})
_MAX_STATE = 3
ALL_LINKS = 0xFFFFFFFF  # the scopeId of "every link"
ERRORS: Mapping[str, int] = {"crc_flit": 38, "crc_data": 45, "replay": 52, "recovery": 59, "ecc_data": 160}
_LINK_ERRORS: Mapping[str, int] = {"replay": 161, "recovery": 162, "crc_flit": 163}
# NVLink5 (Blackwell and newer): the counters exported by default, and those behind packet-errors
NVLINK5_ERRORS: Mapping[str, int] = {"recovery_successful": 213, "recovery_failed": 214, "effective": 219}
NVLINK5_DETAIL: Mapping[str, int] = {"symbol": 221, "recovery": 215, "malformed_packet": 206, "buffer_overrun": 207,
                                     "receive": 208, "remote": 209, "general": 210, "local_link_integrity": 211,
                                     "transmit_discards": 212}
NVLINK5_BER: Mapping[str, int] = {"effective": 220, "symbol": 222}
_TRAFFIC: Mapping[str, int] = {"tx": 138, "rx": 139}  # KiB
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS
_NVLINK_5 = 7  # NVML_NVLINK_VERSION_5_0
_NVLINK5_ARCHITECTURES = frozenset({"blackwell", "rubin"})
_VALUE_TYPE_DOUBLE = 0
_DOUBLE = "double"


def decode_ber(value: float | int, kind: str | None = None) -> float | None:
    """A BER field's value as a number: the packed form NVML's header defines (mantissa in bits 8-11,
    exponent in bits 0-7, BER = mantissa x 10^-exponent; mantissa 15 with exponent 255: no errors), or,
    for an entry of value type double (NVIDIA's mock), the number itself. None: not a BER."""
    ber = _ber(value, kind)
    return ber if 0.0 <= ber <= 1.0 else None


def _ber(value: float | int, kind: str | None) -> float | int:
    """decode_ber before its bounds: the rate, or a value outside 0..1 where the field holds no BER (a sentinel,
    NaN, 15e0): what Query.plausible is given, so that it logs what the driver answered."""
    if kind == _DOUBLE or isinstance(value, float):
        return float(value)
    packed = whole(value, 0xFFF)
    if packed is None:
        return value  # an int: a negative or beyond 0xFFF
    mantissa, exponent = (packed >> 8) & 0xF, packed & 0xFF
    if mantissa == 15 and exponent == 255:
        return 0.0
    return mantissa * 10.0 ** -exponent  # 15e0, 2e0: above 1, no error rate


@dataclass(frozen=True, slots=True)
class NvLink:
    nvlink_up: Mapping[str, bool] = field(default_factory=dict)  # link ("0".."35") -> not inactive
    nvlink_errors: Mapping[str, int] = field(default_factory=dict)  # error -> count over all links
    nvlink_traffic_bytes: Mapping[str, float] = field(default_factory=dict)  # tx | rx, all links
    nvlink_link_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (link, error) -> count
    nvlink_per_link: bool | None = None  # True: export the per-link series (--collector.nvlink.per-link)
    # facts of discovery, carried for the rules: which links were active then, and what is at the other
    # end of each ("NVSwitch 00000000:05:00.0", "GPU 00000000:18:00.0")
    nvlink_up_at_discovery: Mapping[str, bool] = field(default_factory=dict)
    nvlink_remote: Mapping[str, str] = field(default_factory=dict)
    nvlink_bit_error_rate: Mapping[str, float] = field(default_factory=dict)  # effective | symbol (NVLink5)
    nvlink_generation: int | None = None  # 5 for NVLink5 counters, else None (the DL counters)


Source = tuple[str, tuple[FieldKey, ...]]  # (error kind, the field keys whose values make it up)


class Nvml:
    def __init__(self, dev: Device) -> None:
        count = dev.values([_LINK_COUNT]).get(_LINK_COUNT) if dev.has_field(_LINK_COUNT) else None
        links = range(min(whole(count) or 0, MAX_LINKS))
        states = dev.values([(_STATE, link) for link in links])
        self.links = tuple(link for link in links if states.get((_STATE, link)) in _STATES)
        for link in self.links:
            dev.field((_STATE, link), "slow")
        self.names = {link: str(link) for link in self.links}  # the label values, made once (not a string a poll)
        self.at_discovery = {self.names[link]: states[(_STATE, link)] != _INACTIVE for link in self.links}
        self.remote = {self.names[link]: text for link in self.links if (text := _remote(dev, link))}
        on = bool(self.links)
        self.generation = 5 if on and _nvlink5(dev) else None
        self.per_link = on and bool(dev.option("per-link"))
        self.errors: tuple[Source, ...] = ()
        self.ber: tuple[Source, ...] = ()
        self.link_errors: tuple[tuple[str, str, FieldKey], ...] = ()
        self.double: frozenset[FieldKey] = frozenset()
        self._last: dict[str, list[int]] = {}  # kind -> each link's count at the last read (per-link kinds)
        self._sums: dict[str, int] = {}  # kind -> its running total over the links
        if on and self.generation == 5:
            detail = bool(dev.option("packet-errors"))
            self.errors = self._totals(dev, {**NVLINK5_ERRORS, **(NVLINK5_DETAIL if detail else {})})
            self.ber = self._totals(dev, NVLINK5_BER if detail else {"effective": NVLINK5_BER["effective"]})
            self.double = frozenset(key for _, keys in self.ber for key in keys
                                    if dev.value_type(key) == _VALUE_TYPE_DOUBLE)
            per_link_fields: Mapping[str, int] = {**NVLINK5_ERRORS, "symbol": NVLINK5_DETAIL["symbol"]}
        elif on:
            self.errors = tuple((name, (fid,)) for name, fid in ERRORS.items() if dev.field(fid, "slow"))
            have = {name for name, _ in self.errors}
            self.errors += self._per_link(dev, {n: f for n, f in _LINK_ERRORS.items() if n not in have})
            per_link_fields = _LINK_ERRORS
        if self.per_link:
            answered = dev.values([(fid, link) for link in self.links for fid in per_link_fields.values()])
            self.link_errors = tuple((self.names[link], name, (fid, link)) for link in self.links
                                     for name, fid in per_link_fields.items()
                                     if (fid, link) in answered and dev.field((fid, link), "slow"))
        traffic = dev.values([(fid, ALL_LINKS) for fid in _TRAFFIC.values()]) if on else {}
        self.traffic = tuple((d, fid, f"nvlink_traffic_{d}") for d, fid in _TRAFFIC.items()
                             if (fid, ALL_LINKS) in traffic and dev.field((fid, ALL_LINKS), "slow"))
        # each reading's name for Query.plausible (logged once per GPU and name: one for all the links of a kind)
        self.what = {name: f"nvlink_{name}_errors" for name, _ in self.errors}
        self.what_ber = {name: f"nvlink_{name}_ber" for name, _ in self.ber}
        self.what_link = {name: f"nvlink_link_{name}_errors" for _, name, _ in self.link_errors}
        # links counted but none of their states readable: the GPU has NVLink that gpuwatch cannot see
        # (or the link count itself did not answer now though the GPU has the field: a transient error)
        unreadable = bool(links) or (dev.has_field(_LINK_COUNT) and count is None)
        dev.feature("nvlink", True if on else (False if unreadable else None))

    def _totals(self, dev: Device, wanted: Mapping[str, int]) -> tuple[Source, ...]:
        """Each counter as the device total (scopeId = all links) where the driver answers it, else
        per link (to be summed)."""
        totals = dev.values([(fid, ALL_LINKS) for fid in wanted.values()])
        whole = tuple((name, ((fid, ALL_LINKS),)) for name, fid in wanted.items()
                      if (fid, ALL_LINKS) in totals and dev.field((fid, ALL_LINKS), "slow"))
        have = {name for name, _ in whole}
        return whole + self._per_link(dev, {n: f for n, f in wanted.items() if n not in have})

    def _per_link(self, dev: Device, wanted: Mapping[str, int]) -> tuple[Source, ...]:
        if not wanted:
            return ()
        answered = dev.values([(fid, link) for fid in wanted.values() for link in self.links])
        out = []
        for name, fid in wanted.items():
            keys = tuple((fid, link) for link in self.links if (fid, link) in answered)
            if keys and len(keys) == len(self.links) and all(dev.field(key, "slow") for key in keys):
                out.append((name, keys))
        return tuple(out)

    def _total(self, name: str, counts: list[int]) -> int:
        """The kind's count over its keys (one device total, or one per link): per link, the sum of each
        link's increases since the first read, so that one link's counter reset is that link's alone and
        never makes the total go back (a total that went back reads as a reset of every link). ``counts`` are
        plausible values only (read_slow leaves a kind out for a poll where one is not): a one-poll sentinel of
        a link is never taken for its new count, nor its return for a reset."""
        if len(counts) == 1:
            return counts[0]
        before = self._last.get(name)
        total = sum(counts) if before is None else \
            self._sums[name] + sum(now - was if now >= was else now for now, was in zip(counts, before))
        self._last[name], self._sums[name] = counts, total
        return total

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> NvLink:
        if not self.links:
            return NvLink()
        plausible = q.plausible
        up = {}
        for link in self.links:
            state = q.field((_STATE, link))
            if state in _STATES:
                up[self.names[link]] = state != _INACTIVE
            elif state is not None:
                # a state NVML does not define (a newer driver's, or garbage): counted as implausible, and the link
                # is in neither gpuwatch_nvlink_links count (active + inactive fall short of the links while it is)
                plausible(state, 0, _MAX_STATE, "nvlink_link_state", whole=True)
        errors = {}
        for name, keys in self.errors:
            what = self.what[name]
            # only plausible counts are summed: a link's sentinel is left out (no total this poll) before the
            # per-link sum could take it for a reset of that link
            counts = [c for key in keys if (c := counted(q, q.field(key), MAX_COUNTER, what)) is not None]
            if len(counts) == len(keys):  # a sum with a link missing would look like a reset
                errors[name] = self._total(name, counts)
        ber = {}
        for name, keys in self.ber:
            what = self.what_ber[name]
            rates = [None if (v := q.field(key)) is None else
                     plausible(_ber(v, _DOUBLE if key in self.double else None), 0.0, 1.0, what) for key in keys]
            if rates and all(r is not None for r in rates):
                ber[name] = max(float(r) for r in rates if r is not None)  # per link: the worst link
        traffic = {}
        for direction, fid, what in self.traffic:
            kib = plausible(q.field((fid, ALL_LINKS)), 0, MAX_COUNTER, what)
            if kib is not None:
                traffic[direction] = float(kib) * 1024.0
        link_errors = {}
        for label, name, key in self.link_errors:
            value = counted(q, q.field(key), MAX_COUNTER, self.what_link[name])
            if value is not None:
                link_errors[(label, name)] = value
        return NvLink(up, errors, traffic, link_errors, self.per_link or None, self.at_discovery, self.remote,
                      ber, self.generation)


def _nvlink5(dev: Device) -> bool:
    """Whether the GPU's links are NVLink5 (Blackwell and newer): by architecture, else by NVLink version."""
    if dev.architecture in _NVLINK5_ARCHITECTURES:
        return True
    try:
        version = dev.probe(dev.call("nvmlDeviceGetNvLinkVersion", 0))
    except Unsupported:
        return False
    version = whole(version)
    return version is not None and version >= _NVLINK_5


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
    for kind, rate in slow.nvlink_bit_error_rate.items():
        emit("gpuwatch_nvlink_bit_error_ratio", (kind,), rate)
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
    hardware=("nvlink",),
    slow="nvlink",
    nvml=Nvml,
    fields={_LINK_COUNT: "NVLink link count", **{fid: f"NVLink {name} errors" for name, fid in ERRORS.items()}},
    options={"per-link": (False, "export gpuwatch_nvlink_link_up and gpuwatch_nvlink_link_errors_total per link "
                                 "(18 links per H100/H200/B200: off by default)"),
             "packet-errors": (False, "on NVLink5 (Blackwell): also the total recovery events, the packet error "
                                      "counters (malformed packets, buffer overruns, receive, remote, general, local "
                                      "link integrity, transmit discards) and the symbol bit error rate")},
    render=render,
    specs=(
        Spec("gpuwatch_nvlink_links", "gauge", G + ("state",),
             "How many of the GPU's NVLink links are active / inactive; a link idling in low-power SLEEP counts as "
             "active (field NVML_FI_DEV_NVLINK_GET_STATE per link; 'nvidia-smi nvlink -s')."),
        Spec("gpuwatch_nvlink_errors_total", "counter", G + ("error",),
             "NVLink errors summed over the GPU's links. Before Blackwell: crc_flit, crc_data, replay, recovery, "
             "ecc_data (fields NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL, else the links' DL counters summed; DCGM "
             "DCGM_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL; 'nvidia-smi nvlink -e'). NVLink5 (Blackwell): "
             "recovery_successful, recovery_failed, effective (fields NVML_FI_DEV_NVLINK_COUNT_*, scopeId all "
             "links), and with --collector.nvlink.packet-errors symbol, recovery, malformed_packet, buffer_overrun, "
             "receive, remote, general, local_link_integrity, transmit_discards."),
        Spec("gpuwatch_nvlink_bit_error_ratio", "gauge", G + ("kind",),
             "NVLink5 (Blackwell) bit error rate over the GPU's links (the worst link where the driver gives no "
             "total): effective (after FEC; DCGM fails a GPU above 1e-12), and with "
             "--collector.nvlink.packet-errors symbol (fields NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER/SYMBOL_BER, "
             "decoded from NVML's packed mantissa and exponent; 0 = no errors)."),
        Spec("gpuwatch_nvlink_traffic_bytes_total", "counter", G + ("direction",),
             "NVLink data bytes sent (tx) and received (rx) over all links (fields "
             "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, KiB; DCGM DCGM_FI_PROF_NVLINK_TX/RX_BYTES)."),
        Spec("gpuwatch_nvlink_link_up", "gauge", G + ("link",),
             "1 while the NVLink link is active, 0 while inactive; with --collector.nvlink.per-link "
             "(field NVML_FI_DEV_NVLINK_GET_STATE)."),
        Spec("gpuwatch_nvlink_link_errors_total", "counter", G + ("link", "error"),
             "NVLink errors of one link, with --collector.nvlink.per-link: replay, recovery, crc_flit before "
             "Blackwell (fields NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY/RECOVERY/CRC, scopeId = link); "
             "recovery_successful, recovery_failed, effective, symbol on NVLink5 (NVML_FI_DEV_NVLINK_COUNT_*)."),
    ),
)
