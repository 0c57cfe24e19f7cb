"""The simulated GPU models (profiles) and the constants of the simulation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatch.groups import HARDWARE_FEATURES
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
MIB = 1024 * 1024
ALL_REASONS = sum(CLOCKS_EVENT_REASON_BITS.values())
# Longest real-time slice of a wait_events wait, so that events coming due are seen promptly.
EVENT_POLL_SECONDS = 0.25
# Real-time re-check period of a read blocked by a "hang" fault.
HANG_POLL_SECONDS = 0.005





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
    nvlink_generation: int = 4  # 5: NVLink5 error counters and bit error rate (Blackwell)
    power_smoothing_lifetime_percent: float | None = None  # Blackwell power-smoothing circuitry, % left
    # Grace-coupled GPUs (GH200, GB200): NVLink-C2C links to the Grace CPU and their bandwidth (MB/s per link
    # and direction, as 'nvidia-smi c2c -s' shows it); 0 links: no Grace. The module's power beyond the GPU
    # (Grace CPU, its memory, SysIO), the GPU's share of it, idle and busy, in W; the module-scope power and
    # the energy counter include it (NVML's module scope). GPUs per Grace socket, for the host's hwmon sensors.
    c2c_links: int = 0
    c2c_mbps: float = 0.0
    grace_watts: tuple[float, float] = (0.0, 0.0)
    gpus_per_grace: int = 1
    grace_cap_watts: float = 0.0  # the Grace socket's power cap (hwmon "Grace Power Socket N")
    driver: DriverInfo | None = None  # the driver it reports (None: DRIVER_INFO, the H200 capture's)
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
            "power_smoothing": self.power_smoothing_lifetime_percent is not None,
            "c2c": self.c2c_links > 0,
            "recovery_action": self.recovery_action,
        }
        # a class of hardware the model does not have is not a feature of it (no series, as NVML's backend)
        return {feature: supported[feature] for feature in FEATURES
                if supported[feature] or feature not in HARDWARE_FEATURES}


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

# HGX B200: Blackwell, 18 NVLink5 links at 53.125 GB/s to the NVSwitches, liquid-cooled; the values of NVIDIA's
# mock B200 profile (k8s-test-infra: 192 GiB HBM3e, 1,000 W default, 400-1,200 W, 35 °C idle at 130 W) and of
# NVIDIA's Health Validation NVLink check (18 x 53,125 MB/s).
B200 = dataclasses.replace(
    H200,
    key="b200",
    name="NVIDIA B200",
    architecture="blackwell",
    vbios_version="96.00.A0.00.01",
    serial_prefix="1562",
    memory_total_mib=196608,
    memory_reserved_mib=1024,
    idle_watts=130.0,
    full_load_watts=1050.0,
    power_limit_watts={"enforced": 1000.0, "default": 1000.0, "min": 400.0, "max": 1200.0},
    clock_max_mhz={"graphics": 2100.0, "sm": 2100.0, "memory": 2500.0, "video": 2100.0},
    clock_idle_mhz={"graphics": 345.0, "sm": 345.0, "memory": 2500.0, "video": 1200.0},
    resistance_fans_stopped=0.038,
    resistance_fans_full=0.038,
    gpu_max_celsius=85.0,
    slowdown_celsius=90.0,
    shutdown_celsius=95.0,
    memory_temperature=(20.0, 0.375),
    pcie_max_generation=6,
    pcie_idle_generation=6,
    nvlink_gbps=53.125,
    nvlink_generation=5,
    power_smoothing_lifetime_percent=97.0,
)

# HGX A100 40 GB (SXM4, Ampere): 12 NVLink3 links at 25 GB/s to the NVSwitches; no GPM (Hopper and newer), no
# T.Limit margin (absolute thresholds), no fabric registration through NVML; NVIDIA's mock A100 profile's values.
A100 = dataclasses.replace(
    H200,
    key="a100",
    name="NVIDIA A100-SXM4-40GB",
    architecture="ampere",
    vbios_version="92.00.45.00.03",
    serial_prefix="1324",
    memory_total_mib=40960,
    memory_reserved_mib=583,
    idle_watts=72.0,
    full_load_watts=420.0,
    power_limit_watts={"enforced": 400.0, "default": 400.0, "min": 100.0, "max": 400.0},
    clock_max_mhz={"graphics": 1410.0, "sm": 1410.0, "memory": 1215.0, "video": 1290.0},
    clock_idle_mhz={"graphics": 210.0, "sm": 210.0, "memory": 1215.0, "video": 585.0},
    resistance_fans_stopped=0.09,  # about 61 °C at 400 W (HGX A100 under a burn job)
    resistance_fans_full=0.09,
    gpu_max_celsius=83.0,
    slowdown_celsius=87.0,
    shutdown_celsius=92.0,
    threshold_scale="absolute",
    memory_max_tlimit=None,
    memory_temperature=(2.0, 0.9),
    pcie_max_generation=4,
    pcie_idle_generation=4,
    gpm=False,
    nvlink_links=12,
    nvlink_gbps=25.0,
    fabric=False,
)

# GeForce RTX 4090 (Ada): two fans, absolute thresholds, no ECC, row remapping, NVLink, GPM or MIG; 24 GB GDDR6X,
# 450 W (150-600 W); the behaviour of the RTX 4080 SUPER capture (590/595 drivers).
RTX4090 = dataclasses.replace(
    RTX6000,
    key="rtx4090",
    name="NVIDIA GeForce RTX 4090",
    vbios_version="95.02.18.80.87",
    serial_prefix="0",
    memory_total_mib=24564,
    memory_reserved_mib=470,
    idle_watts=31.0,
    full_load_watts=480.0,
    power_limit_watts={"enforced": 450.0, "default": 450.0, "min": 150.0, "max": 600.0},
    clock_max_mhz={"graphics": 3120.0, "sm": 3120.0, "memory": 10501.0, "video": 2415.0},
    clock_idle_mhz={"graphics": 210.0, "sm": 210.0, "memory": 405.0, "video": 1185.0},
    resistance_fans_stopped=0.16,
    resistance_fans_full=0.07,
    fan_count=2,
    fan_max_rpm=3300.0,
    gpu_max_celsius=90.0,
    slowdown_celsius=94.0,
    shutdown_celsius=97.0,
    ecc=False,
)

# A Grace Hopper superchip node (e.g. an MGX server with GH200 modules, one GPU per superchip, no
# NVSwitch): the H100-class GPU with 96 GB HBM3 ("GH200 480GB": 480 GB of LPDDR5X on the Grace side), a
# 900 W GPU limit within a 1,000 W module. No capture of a GH200 is on file: the C2C link count and speed
# (10 links at 44,712 MB/s per direction, 'nvidia-smi c2c -s') are NVLink-C2C's published 900 GB/s
# (450 GB/s a direction) split as the NVML GPM metrics' per-C2C-link ids suggest, and the power
# numbers are the board's published ones; treat them as plausible, not measured.
GH200 = dataclasses.replace(
    H200,
    key="gh200",
    name="NVIDIA GH200 480GB",
    vbios_version="96.00.74.00.01",
    serial_prefix="1655",
    memory_total_mib=97871,
    memory_reserved_mib=576,
    idle_watts=90.0,
    full_load_watts=940.0,
    power_limit_watts={"enforced": 900.0, "default": 900.0, "min": 200.0, "max": 900.0},
    clock_max_mhz={"graphics": 1980.0, "sm": 1980.0, "memory": 2619.0, "video": 1545.0},
    clock_idle_mhz={"graphics": 345.0, "sm": 345.0, "memory": 2619.0, "video": 765.0},
    resistance_fans_stopped=0.033,  # liquid cooled
    resistance_fans_full=0.033,
    nvlink_links=0,
    nvlink_gbps=0.0,
    fabric=False,
    c2c_links=10,
    c2c_mbps=44712.0,
    grace_watts=(110.0, 260.0),
    gpus_per_grace=1,
    grace_cap_watts=500.0,
)

# A GB200 NVL compute tray (two Grace Blackwell superchips: 4 GPUs, 2 Graces), after NVIDIA's mock-NVML
# GB200 configuration (k8s-test-infra mock-nvml-config-gb200.yaml): 192 GiB HBM3e, 1,000 W default,
# 400 W min, 1,200 W max, 145 W idle, 36 C idle (liquid cooled, no fans), shutdown/slowdown/max
# operating 95/90/85 C, clocks 2,100/2,500 MHz, PCIe gen 6, 18 NVLink5 links at 53.125 GB/s through the
# NVSwitches, fabric completed, C2C on, driver 580.65.06. The C2C link count and speed are the GH200's
# (assumed: the mock does not model them).
GB200 = dataclasses.replace(
    H200,
    key="gb200",
    name="NVIDIA GB200",
    architecture="blackwell",
    vbios_version="96.00.9E.00.01",
    serial_prefix="1562",
    memory_total_mib=196608,
    memory_reserved_mib=1024,
    idle_watts=145.0,
    full_load_watts=1150.0,
    power_limit_watts={"enforced": 1000.0, "default": 1000.0, "min": 400.0, "max": 1200.0},
    clock_max_mhz={"graphics": 2100.0, "sm": 2100.0, "memory": 2500.0, "video": 2100.0},
    clock_idle_mhz={"graphics": 345.0, "sm": 345.0, "memory": 2500.0, "video": 1200.0},
    ambient_celsius=33.0,  # the coolant's
    resistance_fans_stopped=0.021,  # 36 C at 145 W idle; liquid cooled
    resistance_fans_full=0.021,
    gpu_max_celsius=85.0,
    slowdown_celsius=90.0,
    shutdown_celsius=95.0,
    memory_temperature=(0.0, 0.95),  # 34 C at 36 C
    pcie_max_generation=6,
    pcie_idle_generation=6,
    nvlink_links=18,
    nvlink_gbps=53.125,
    fabric=True,
    c2c_links=10,
    c2c_mbps=44712.0,
    grace_watts=(60.0, 150.0),  # half a Grace's CPU, memory and SysIO per GPU
    gpus_per_grace=2,
    grace_cap_watts=500.0,
    nvlink_generation=5,
    power_smoothing_lifetime_percent=92.0,
    driver=DriverInfo(driver_version="580.65.06", nvml_version="13.580.65", cuda_driver_version="13.0"),
)

PROFILES: Mapping[str, Profile] = {p.key: p for p in (RTX6000, H200, T4, H100_MIG, B200, A100, RTX4090, GH200, GB200)}


def fan_curve(temperature: float) -> float:
    """Target fan speed ratio: 30 % up to 40 °C, linear to 100 % at 85 °C."""
    return min(1.0, max(0.30, 0.30 + 0.70 * (temperature - 40.0) / 45.0))


def unknown_profile(profile: object) -> str:
    return f"unknown simulated GPU profile {profile!r}; choose one of: {', '.join(PROFILES)}"
