"""NVML field ids by driver branch: groups name the fields whose ids moved, this maps names to ids.

NVML's ``nvmlDeviceGetFieldValues`` ids are not stable across driver branches
(shared/reference/nvml-generations-and-peers-2026.md §2.2, from the CUDA headers go-nvml vendored and
the nvidia-ml-py wheels' constants):

- 251-273 were renumbered twice. R570 (CUDA 12.8) put power smoothing at 251-268; R575 and R580 up to
  580.126 (CUDA 12.9/13.0, nvidia-ml-py 12.575/13.580.65) put the throttle-time counters SW thermal,
  HW thermal and HW power brake at 251-253, power-sync balancing at 254-255 and shifted power smoothing
  to 256-273; R580.126 and newer (CUDA 13.1.2, nvidia-ml-py >= 13.580.126) went back to power
  smoothing at 251-268 and moved the counters to 269-271 (power sync 272-273).
- 199 and 200 (MIG-independent query capability / NVLink low-power threshold maximum) were swapped in
  the CUDA 12.5 and 12.6 headers (R555, R560).

Asking the wrong id on a branch is worse than an error: 251 on an R590 driver answers the power-smoothing
enable flag, a plausible small integer, not "nanoseconds throttled". So the ids of these fields are
chosen from ``nvmlSystemGetDriverVersion()``. On a branch newer than this table the newest numbering
is assumed and ``Numbering.known`` is False: the groups then sanity-check what the ids answer (a
throttle counter is an unsigned 64-bit count of nanoseconds, a power-smoothing percentage is 0-100) and
leave out, with one log line, what does not fit, rather than guess.

Fields whose ids never moved are named by number in the groups, as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# The names groups ask for.
SW_THERMAL_NS = "clocks_event.sw_thermal_slowdown_ns"
HW_THERMAL_NS = "clocks_event.hw_thermal_slowdown_ns"
HW_POWER_BRAKE_NS = "clocks_event.hw_power_brake_slowdown_ns"
POWER_SMOOTHING_ENABLED = "power_smoothing.enabled"
POWER_SMOOTHING_LIFETIME = "power_smoothing.hw_circuitry_percent_lifetime_remaining"
POWER_SYNC_FREQ = "power_sync_balancing.freq"
POWER_SYNC_AF = "power_sync_balancing.af"
MIG_INDEPENDENT_QUERY = "mig.independent_query_capable"
NVLINK_POWER_THRESHOLD_MAX = "nvlink.power_threshold_max"

NAMES: tuple[str, ...] = (SW_THERMAL_NS, HW_THERMAL_NS, HW_POWER_BRAKE_NS, POWER_SMOOTHING_ENABLED,
                          POWER_SMOOTHING_LIFETIME, POWER_SYNC_FREQ, POWER_SYNC_AF, MIG_INDEPENDENT_QUERY,
                          NVLINK_POWER_THRESHOLD_MAX)

# NVML_VALUE_TYPE_* (nvmlValueType_t)
VALUE_TYPE_UNSIGNED_LONG_LONG = 3

_CURRENT: Mapping[str, int] = {  # CUDA 13.1.2+ headers, nvidia-ml-py >= 13.580.126 (and R570's power smoothing)
    MIG_INDEPENDENT_QUERY: 199, NVLINK_POWER_THRESHOLD_MAX: 200,
    POWER_SMOOTHING_ENABLED: 251, POWER_SMOOTHING_LIFETIME: 258,
    SW_THERMAL_NS: 269, HW_THERMAL_NS: 270, HW_POWER_BRAKE_NS: 271,
    POWER_SYNC_FREQ: 272, POWER_SYNC_AF: 273,
}
_R575: Mapping[str, int] = {  # CUDA 12.9 / 13.0 headers: nvidia-ml-py 12.575.51, 13.580.65; DCGM 4.5.x
    MIG_INDEPENDENT_QUERY: 199, NVLINK_POWER_THRESHOLD_MAX: 200,
    SW_THERMAL_NS: 251, HW_THERMAL_NS: 252, HW_POWER_BRAKE_NS: 253,
    POWER_SYNC_FREQ: 254, POWER_SYNC_AF: 255,
    POWER_SMOOTHING_ENABLED: 256, POWER_SMOOTHING_LIFETIME: 263,
}
_SWAPPED: Mapping[str, int] = {MIG_INDEPENDENT_QUERY: 200, NVLINK_POWER_THRESHOLD_MAX: 199}  # CUDA 12.5, 12.6


@dataclass(frozen=True)
class Branch:
    """One numbering: the first driver version it applies to, and its ids."""

    name: str
    since: tuple[int, int]  # (major, minor) of the first driver of the numbering
    ids: Mapping[str, int]


#: Oldest first. A driver uses the last branch whose ``since`` it reaches. The throttle counters did not
#: exist before R570's numbering (the perf-policy counter 75 stands in for thermal there); R570's header
#: does not define them but reserves their R580.126+ ids, which is what an R570 driver that has them answers.
BRANCHES: tuple[Branch, ...] = (
    Branch("R535", (0, 0), {}),
    Branch("R550", (550, 0), {MIG_INDEPENDENT_QUERY: 199}),
    Branch("R555", (555, 0), _SWAPPED),
    Branch("R560", (560, 0), _SWAPPED),
    Branch("R570", (570, 0), _CURRENT),
    Branch("R575", (575, 0), _R575),
    Branch("R580.65", (580, 0), _R575),
    Branch("R580.126", (580, 126), _CURRENT),
    Branch("R590", (590, 0), _CURRENT),
    Branch("R595", (595, 0), _CURRENT),
    Branch("R610", (610, 0), _CURRENT),
    Branch("R615", (615, 0), _CURRENT),
)
#: The newest branch whose numbering was checked against a header or binding (nvidia-ml-py 13.615.71).
NEWEST_KNOWN = 615


@dataclass(frozen=True)
class Numbering:
    """The field ids of one driver: ``id(name)`` or None where the branch has no such field."""

    driver_version: str
    branch: str
    ids: Mapping[str, int]
    known: bool  # False: a branch newer than the table (or an unreadable version): check what the ids answer

    def id(self, name: str) -> int | None:
        return self.ids.get(name)


def _version(text: str) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d{1,6})(?:\.(\d{1,6}))?", text or "")
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def numbering(driver_version: str) -> Numbering:
    """The numbering of the driver that reports ``driver_version`` (e.g. "580.65.06")."""
    version = _version(driver_version)
    if version is None:  # cannot tell: the newest numbering, checked
        return Numbering(driver_version, "unknown", _CURRENT, known=False)
    branch = BRANCHES[0]
    for candidate in BRANCHES:
        if version >= candidate.since:
            branch = candidate
    if version[0] > NEWEST_KNOWN:
        return Numbering(driver_version, f"R{version[0]}", branch.ids, known=False)
    return Numbering(driver_version, branch.name, branch.ids, known=True)


DEFAULT = numbering("590.48.01")  # what a Device without a driver version (tests of one group) resolves with
