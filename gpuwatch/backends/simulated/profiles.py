"""The simulated GPU models (profiles) and the constants of the simulation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatch.groups.clocks import COUNTERS
from gpuwatch.model import (
    CLOCKS_EVENT_REASON_BITS,
    FEATURES,
    DriverInfo,
)

#: Integration step of the physics, in seconds. Readings are the state at the last step boundary.
STEP_SECONDS = 1.0
#: The simulated driver, as ``open()`` reports it (the H200 capture's versions).
DRIVER_INFO = DriverInfo(
    driver_version="590.48.01", nvml_version="13.590.48.01", cuda_driver_version="13.1"
)
MAX_GPUS = 256
_MIB = 1024 * 1024
_ALL_REASONS = sum(CLOCKS_EVENT_REASON_BITS.values())
# Longest real-time slice of a wait_events wait, so that events coming due are seen promptly.
_EVENT_POLL_SECONDS = 0.25
# Real-time re-check period of a read blocked by a "hang" fault.
_HANG_POLL_SECONDS = 0.005





@dataclass(frozen=True, slots=True)
class Profile:
    """Static facts and physics constants of one simulated GPU model."""

    key: str
    name: str
    architecture: str
    vbios_version: str
    serial_prefix: str
    memory_total_mib: int
    memory_reserved_mib: int
    idle_watts: float
    full_load_watts: float  # draw at 100 % utilization and full clocks, before the power cap
    power_limit_watts: Mapping[str, float]  # enforced, default, min, max
    clock_max_mhz: Mapping[str, float]
    clock_idle_mhz: Mapping[str, float]
    busy_pstate: int
    idle_pstate: int
    ambient_celsius: float
    thermal_time_constant_seconds: float
    resistance_fans_stopped: float  # °C/W; the only value for a passively cooled GPU
    resistance_fans_full: float  # °C/W at 100 % fan
    fan_count: int
    fan_max_rpm: float
    fan_time_constant_seconds: float
    gpu_max_celsius: float  # max operating temperature (T.Limit 0)
    slowdown_celsius: float
    shutdown_celsius: float
    threshold_scale: str  # "absolute" (NVML thresholds in °C) or "tlimit" (margin scale)
    memory_max_tlimit: float | None  # memory max-operating threshold on the T.Limit scale
    memory_temperature: tuple[float, float] | None  # (offset, slope) of memory vs GPU temperature
    pcie_max_generation: int
    pcie_idle_generation: int
    pcie_width: int
    clocks_event_time_reasons: tuple[str, ...]
    ecc: bool
    remapped_rows: bool
    retired_pages: bool
    gpm: bool = False  # profiling metrics (Hopper and newer)
    nvlink_links: int = 0  # NVLink links to the NVSwitches (HGX), 0 for PCIe cards
    nvlink_gbps: float = 0.0  # GB/s per link and direction, as `nvidia-smi nvlink -s` shows it
    fabric: bool = False  # NVSwitch fabric registration
    # MIG instances (GPU instance id, profile, frame buffer MiB); with MIG on, the GPU has no utilization
    # and no device-level GPM (per instance only) and NVLink is not reported
    mig_instances: tuple[tuple[int, str, int], ...] = ()
    # the driver reports the recovery action (NVML field 230, R570+: every capture's driver says "None")
    recovery_action: bool = True

    @property
    def features(self) -> dict[str, bool]:
        """Feature -> supported, exactly what the samples of this profile contain."""
        supported = {
            "clocks_event_reasons": True,
            "clocks_event_time": bool(self.clocks_event_time_reasons),
            "ecc": self.ecc,
            "energy": True,
            "fan": self.fan_count > 0,
            "fan_rpm": self.fan_count > 0,
            "fan_target": self.fan_count > 0,
            "memory_temperature": self.memory_temperature is not None,
            "pcie": True,
            "power": True,
            "power_limit": True,
            "remapped_rows": self.remapped_rows,
            "retired_pages": self.retired_pages,
            "temperature_margin": self.threshold_scale == "tlimit",
            "utilization": not self.mig_instances,
            "xid_events": True,
            "gpm": self.gpm and not self.mig_instances,
            "nvlink": self.nvlink_links > 0,
            "fabric": self.fabric,
            "mig": bool(self.mig_instances),
            "recovery_action": self.recovery_action,
        }
        return {feature: supported[feature] for feature in FEATURES}


RTX6000 = Profile(
    key="rtx6000",
    name="NVIDIA RTX 6000 Ada Generation",
    architecture="ada",  # as the NVML backend names NVML_DEVICE_ARCH_ADA
    vbios_version="95.02.5D.00.01",
    serial_prefix="1325",
    # 48 GB GDDR6 with ECC enabled, as the L40S (same AD102 board) reports it.
    memory_total_mib=46068,
    memory_reserved_mib=609,
    idle_watts=24.0,
    full_load_watts=330.0,
    power_limit_watts={"enforced": 300.0, "default": 300.0, "min": 100.0, "max": 300.0},
    clock_max_mhz={"graphics": 2505.0, "sm": 2505.0, "memory": 10001.0, "video": 1965.0},
    clock_idle_mhz={"graphics": 210.0, "sm": 210.0, "memory": 405.0, "video": 1185.0},
    busy_pstate=0,
    idle_pstate=8,
    ambient_celsius=25.0,
    thermal_time_constant_seconds=60.0,
    resistance_fans_stopped=0.21,
    resistance_fans_full=0.10,
    fan_count=1,  # one blower
    fan_max_rpm=4800.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=90.0,
    slowdown_celsius=95.0,
    shutdown_celsius=100.0,
    threshold_scale="absolute",
    memory_max_tlimit=None,
    memory_temperature=None,
    pcie_max_generation=4,
    pcie_idle_generation=1,
    pcie_width=16,
    clocks_event_time_reasons=tuple(COUNTERS.values()),  # what nvidia-smi shows; R575+
    ecc=True,
    remapped_rows=False,
    retired_pages=False,
)

H200 = Profile(
    key="h200",
    name="NVIDIA H200",
    architecture="hopper",
    vbios_version="96.00.A5.00.03",
    serial_prefix="1654",
    memory_total_mib=143771,
    memory_reserved_mib=614,
    idle_watts=77.0,
    full_load_watts=740.0,
    power_limit_watts={"enforced": 700.0, "default": 700.0, "min": 200.0, "max": 700.0},
    clock_max_mhz={"graphics": 1980.0, "sm": 1980.0, "memory": 3201.0, "video": 1545.0},
    clock_idle_mhz={"graphics": 345.0, "sm": 345.0, "memory": 3201.0, "video": 765.0},
    busy_pstate=0,
    idle_pstate=0,  # the capture shows P0 at idle too
    ambient_celsius=25.0,
    thermal_time_constant_seconds=60.0,
    # 28 °C at 77 W and 52 °C at 628 W in the capture: about 25 °C + 0.044 °C/W.
    resistance_fans_stopped=0.044,
    resistance_fans_full=0.044,
    fan_count=0,
    fan_max_rpm=0.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=87.0,
    slowdown_celsius=89.0,
    shutdown_celsius=95.0,
    threshold_scale="tlimit",
    memory_max_tlimit=0.0,
    memory_temperature=(21.5, 0.375),  # 28 -> 32 °C idle, 52 -> 41 °C under load
    pcie_max_generation=5,
    pcie_idle_generation=5,  # the capture shows gen 5 at idle
    pcie_width=16,
    clocks_event_time_reasons=tuple(COUNTERS.values()),
    ecc=True,
    remapped_rows=True,
    retired_pages=False,
    # HGX H200: 18 NVLinks at 26.562 GB/s to the NVSwitches, fabric registration Completed (the capture)
    gpm=True,
    nvlink_links=18,
    nvlink_gbps=26.562,
    fabric=True,
)

# A passively cooled 70 W Turing card: the one profile with page retirement (pre-Ampere GPUs
# retire pages; A100 and newer remap rows instead) and with a GDDR memory that has no sensor. No
# capture of a T4 is on file: the values are the board's published ones (70 W, 16 GB GDDR6, PCIe
# gen 3) and the thresholds nvidia-smi prints for it (shutdown 96, slowdown 93, max operating 85 C).
T4 = Profile(
    key="t4",
    name="Tesla T4",
    architecture="turing",
    vbios_version="90.04.38.00.03",
    serial_prefix="1322",
    memory_total_mib=15360,
    memory_reserved_mib=257,
    idle_watts=10.0,
    full_load_watts=76.0,
    power_limit_watts={"enforced": 70.0, "default": 70.0, "min": 60.0, "max": 70.0},
    clock_max_mhz={"graphics": 1590.0, "sm": 1590.0, "memory": 5001.0, "video": 1470.0},
    clock_idle_mhz={"graphics": 300.0, "sm": 300.0, "memory": 405.0, "video": 540.0},
    busy_pstate=0,
    idle_pstate=8,
    ambient_celsius=25.0,
    thermal_time_constant_seconds=50.0,
    # about 30 C idle and 60 C at 70 W in a server with adequate airflow
    resistance_fans_stopped=0.5,
    resistance_fans_full=0.5,
    fan_count=0,
    fan_max_rpm=0.0,
    fan_time_constant_seconds=3.0,
    gpu_max_celsius=85.0,
    slowdown_celsius=93.0,
    shutdown_celsius=96.0,
    threshold_scale="absolute",
    memory_max_tlimit=None,
    memory_temperature=None,
    pcie_max_generation=3,
    pcie_idle_generation=1,
    pcie_width=16,
    clocks_event_time_reasons=RTX6000.clocks_event_time_reasons,
    ecc=True,
    remapped_rows=False,
    retired_pages=True,
)

# An H100 SXM in MIG mode with the capture's four instances (GPU instances 2, 3, 9, 10). With MIG on
# the capture says: utilization N/A, "Nvlink queries are not supported for Devices in MIG mode"; row
# remapping is not reported while instances are active.
H100_MIG = dataclasses.replace(
    H200,
    key="h100-mig",
    name="NVIDIA H100 80GB HBM3",
    vbios_version="96.00.A5.00.01",
    serial_prefix="1652",
    memory_total_mib=81559,
    memory_reserved_mib=479,
    remapped_rows=False,
    nvlink_links=0,
    nvlink_gbps=0.0,
    fabric=False,
    mig_instances=((2, "3g.40gb", 40448), (3, "2g.20gb", 20096), (9, "1g.10gb", 9984), (10, "1g.10gb", 9984)),
)

PROFILES: Mapping[str, Profile] = {p.key: p for p in (RTX6000, H200, T4, H100_MIG)}


def _fan_curve(temperature: float) -> float:
    """Target fan speed ratio: 30 % up to 40 °C, linear to 100 % at 85 °C."""
    return min(1.0, max(0.30, 0.30 + 0.70 * (temperature - 40.0) / 45.0))


def _unknown_profile(profile: object) -> str:
    return f"unknown simulated GPU profile {profile!r}; choose one of: {', '.join(PROFILES)}"
