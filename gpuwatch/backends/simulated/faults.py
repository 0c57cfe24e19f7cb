"""Faults: what changes the inputs of a simulated GPU's physics (conditions.py), one small entry per kind (the demo
tour and `--sim.fault` specs that play them: tour.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuwatch.backends.simulated.conditions import Conditions, Health
from gpuwatch.backends.simulated.profiles import Profile


@dataclass(frozen=True, slots=True)
class FaultKind:
    """What one kind of fault does. Every hook is optional."""

    description: str
    params: Mapping[str, float] = field(default_factory=dict)  # name -> default
    requires: tuple[str, ...] = ()  # features the GPU must support
    # every step while active: (fault, conditions, seconds since this occurrence began)
    during: Callable[[Fault, Conditions, float], None] | None = None
    onset: Callable[[Fault, Health, Profile], None] | None = None
    end: Callable[[Fault, Health, Profile], None] | None = None
    # XID code emitted through wait_events at each onset (None or 0: none)
    xid: Callable[[Fault], int | None] | None = None
    # A Slurm job on the host while active: the GPU allocated to job ``job_id`` and the job's processes'
    # CPU use (params cpu_busy, iowait, cpus); the simulated backend's read_host reports it.
    job: bool = False
    # What it does to the backend itself rather than to one GPU's physics: "unavailable" (every
    # call raises BackendUnavailable, node-wide), "hang" (reads block, node-wide) or "unlisted"
    # (the GPU is left out of discovery and its reads raise DeviceLost).
    backend: str | None = None

    @property
    def node_level(self) -> bool:
        """Node-wide kinds ignore the fault's ``gpu`` (use 0)."""
        return self.backend in ("unavailable", "hang")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault on one GPU, active from ``start_seconds`` to ``end_seconds`` after ``open()``.

    ``end_seconds=None`` means it never ends. With ``repeat_seconds`` the window recurs every that
    many seconds (occurrence n covers [start + n·repeat, end + n·repeat)). ``params`` override the
    kind's defaults (see ``FAULT_KINDS``).
    """

    kind: str
    gpu: int
    start_seconds: float
    end_seconds: float | None = None
    params: Mapping[str, float] = field(default_factory=dict, hash=False)
    repeat_seconds: float | None = None

    def __post_init__(self) -> None:
        spec = FAULT_KINDS.get(self.kind)
        if spec is None:
            raise ValueError(
                f"unknown fault kind {self.kind!r}; known kinds: {', '.join(sorted(FAULT_KINDS))}"
            )
        if not isinstance(self.gpu, int) or isinstance(self.gpu, bool) or self.gpu < 0:
            raise ValueError(f"fault {self.kind}: gpu must be a GPU index >= 0, got {self.gpu!r}")
        if not is_number(self.start_seconds) or self.start_seconds < 0:
            raise ValueError(f"fault {self.kind}: start_seconds must be >= 0")
        if self.end_seconds is not None and (
            not is_number(self.end_seconds) or self.end_seconds <= self.start_seconds
        ):
            raise ValueError(f"fault {self.kind}: end_seconds must be after start_seconds")
        if self.repeat_seconds is not None:
            if not is_number(self.repeat_seconds) or self.repeat_seconds <= 0:
                raise ValueError(f"fault {self.kind}: repeat_seconds must be > 0")
            if self.end_seconds is None:
                raise ValueError(f"fault {self.kind}: a repeating fault needs end_seconds")
            if self.end_seconds - self.start_seconds > self.repeat_seconds:
                raise ValueError(f"fault {self.kind}: its window is longer than repeat_seconds")
        unknown = set(self.params) - set(spec.params)
        if unknown:
            allowed = ", ".join(sorted(spec.params)) or "none"
            raise ValueError(
                f"fault {self.kind}: unknown params {sorted(unknown)}; allowed: {allowed}"
            )
        for name, value in self.params.items():
            if not is_number(value):
                raise ValueError(f"fault {self.kind}: param {name} must be a number")
        object.__setattr__(self, "params", {**spec.params, **self.params})

    def since_onset(self, t: float) -> float | None:
        """Seconds since the current occurrence began, or None when not active at ``t``."""
        if t < self.start_seconds:
            return None
        local = t - self.start_seconds
        if self.repeat_seconds is not None:
            local %= self.repeat_seconds
        end = math.inf if self.end_seconds is None else self.end_seconds - self.start_seconds
        return local if local < end else None

    def onsets_between(self, after: float, until: float) -> list[float]:
        """Onset times ``o`` with ``after < o <= until``."""
        if self.repeat_seconds is None:
            return [self.start_seconds] if after < self.start_seconds <= until else []
        n = max(0, math.floor((after - self.start_seconds) / self.repeat_seconds) + 1)
        onsets = []
        while (onset := self.start_seconds + n * self.repeat_seconds) <= until:
            if onset > after:
                onsets.append(onset)
            n += 1
        return onsets


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _load(fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = fault.params["utilization"]
    c.memory_fraction = fault.params["memory_fraction"] if c.utilization > 0 else 0.0
    c.memory_intensity = 0.35


def _idle_allocation(fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = 0.0
    c.memory_fraction = fault.params["memory_fraction"]
    c.memory_intensity = 0.0


def _input_starved(fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = fault.params["utilization"]
    c.memory_fraction = 0.5
    c.memory_intensity = 0.3


def _allocated_unused(_fault: Fault, c: Conditions, _since: float) -> None:
    c.utilization = 0.0
    c.memory_fraction = 0.0
    c.memory_intensity = 0.0


def _inlet_warm(fault: Fault, c: Conditions, _since: float) -> None:
    c.inlet_offset_celsius += fault.params["celsius"]


def _fan_stall(_fault: Fault, c: Conditions, _since: float) -> None:
    c.fan_stalled = True


def _cooling_failure(fault: Fault, c: Conditions, since: float) -> None:
    ramp = fault.params["ramp_seconds"]
    progress = 1.0 if ramp <= 0 else min(1.0, since / ramp)
    c.resistance_factor *= 1.0 + (fault.params["factor"] - 1.0) * progress


def _fell_off_bus(_fault: Fault, c: Conditions, _since: float) -> None:
    c.lost = True


def _power_brake(fault: Fault, c: Conditions, _since: float) -> None:
    c.power_brake = True
    c.clock_cap = min(c.clock_cap, fault.params["clock_factor"])


def _ecc_onset(fault: Fault, health: Health, profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("uncorrected", "volatile")] += count
    health.ecc[("uncorrected", "aggregate")] += count
    if profile.remapped_rows:
        health.remapped_rows["uncorrectable"] += 1
        health.remapped_rows_pending = True


def _ecc_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    # The end of the window is the GPU reset that applies the remap: pending clears and the
    # volatile counters start again from 0, the aggregate ones keep the count.
    health.remapped_rows_pending = False
    health.ecc[("corrected", "volatile")] = 0
    health.ecc[("uncorrected", "volatile")] = 0


def _xid_param(fault: Fault) -> int | None:
    return int(fault.params["xid"]) or None


def _fan_lag(fault: Fault, c: Conditions, _since: float) -> None:
    c.fan_ratio = min(c.fan_ratio, fault.params["ratio"])


def _hw_slowdown(fault: Fault, c: Conditions, _since: float) -> None:
    c.hw_slowdown = True
    c.clock_cap = min(c.clock_cap, fault.params["clock_factor"])


def _pcie_downtrain(fault: Fault, c: Conditions, _since: float) -> None:
    width, generation = int(fault.params["width"]), int(fault.params["generation"])
    if width > 0:
        c.pcie_width = width if c.pcie_width is None else min(c.pcie_width, width)
    if generation > 0:
        c.pcie_generation = generation if c.pcie_generation is None else min(c.pcie_generation, generation)


def _pcie_replays(fault: Fault, c: Conditions, _since: float) -> None:
    c.replays_per_second += fault.params["per_minute"] / 60.0


def _pcie_replays_end(fault: Fault, health: Health, _profile: Profile) -> None:
    if fault.params["reset_at_end"]:
        health.pcie_replays = 0.0


def _nvlink_down(fault: Fault, c: Conditions, _since: float) -> None:
    c.nvlink_down = (*c.nvlink_down, int(fault.params["link"]))


def _nvlink_errors(fault: Fault, c: Conditions, _since: float) -> None:
    for kind in ("crc_flit", "replay", "recovery"):
        rate = fault.params[f"{kind}_per_minute"] / 60.0
        c.nvlink_errors_per_second[kind] = c.nvlink_errors_per_second.get(kind, 0.0) + rate


def _c2c_down(fault: Fault, c: Conditions, _since: float) -> None:
    c.c2c_down = (*c.c2c_down, int(fault.params["link"]))


def _fabric_manager_down(_fault: Fault, c: Conditions, _since: float) -> None:
    c.fabric_state = "not_started"


def _mig_idle_allocation(fault: Fault, c: Conditions, _since: float) -> None:
    c.mig_idle = (*c.mig_idle, int(fault.params["gpu_instance"]))


def _fabric_degraded(fault: Fault, c: Conditions, _since: float) -> None:
    c.fabric_issues = (*c.fabric_issues, "degraded_bandwidth")


def _recovery_action(fault: Fault, c: Conditions, _since: float) -> None:
    c.recovery_action = max(c.recovery_action, int(fault.params["action"]))


def _row_remap_pending_onset(fault: Fault, health: Health, profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("corrected", "volatile")] += count
    health.ecc[("corrected", "aggregate")] += count
    health.remapped_rows["correctable"] += 1
    health.remapped_rows_pending = True


def _row_remap_failure_onset(_fault: Fault, health: Health, _profile: Profile) -> None:
    health.remapped_rows_failed = True


def _row_remap_failure_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    health.remapped_rows_failed = False


def _retired_pages_onset(fault: Fault, health: Health, _profile: Profile) -> None:
    count = int(fault.params["count"])
    health.ecc[("corrected", "volatile")] += count
    health.ecc[("corrected", "aggregate")] += count
    health.retired_pages_pending = True


def _power_smoothing_worn_onset(fault: Fault, health: Health, _profile: Profile) -> None:
    health.power_smoothing_percent = fault.params["percent"]


def _power_smoothing_serviced(_fault: Fault, health: Health, _profile: Profile) -> None:
    health.power_smoothing_percent = None


def _reset_end(_fault: Fault, health: Health, _profile: Profile) -> None:
    # The end of the window is the GPU reset (or reboot) that applies the remap or retirement:
    # pending clears and the volatile counters start again from 0.
    health.remapped_rows_pending = False
    health.retired_pages_pending = False
    health.ecc[("corrected", "volatile")] = 0
    health.ecc[("uncorrected", "volatile")] = 0


#: kind -> what it does. Add a scenario by adding an entry.
FAULT_KINDS: dict[str, FaultKind] = {
    "load": FaultKind(
        "Scenario shaping, not an anomaly: force the utilization (default 1.0 = a burn job; 0 = "
        "idle) and the share of the frame buffer in use.",
        params={"utilization": 1.0, "memory_fraction": 0.4},
        during=_load,
    ),
    "idle_allocation": FaultKind(
        "A job holds the GPU and its memory but computes nothing (a notebook left open, a job "
        "waiting on I/O or a lock): utilization 0 with the frame buffer in use.",
        params={"memory_fraction": 0.3},
        during=_idle_allocation,
    ),
    "inlet_warm": FaultKind(
        "The air reaching the GPU is `celsius` warmer than the room's: a rack's failed cooler or hot-air "
        "recirculation (on every GPU of a rack), a node's failed chassis fans (on every GPU of a node).",
        params={"celsius": 10.0},
        during=_inlet_warm,
    ),
    "job": FaultKind(
        "A Slurm job holds the GPU (scontrol's GRES) while active; its processes keep cpu_busy of its cpus "
        "busy and spend iowait of their time waiting for I/O. Changes nothing on the GPU (add a load).",
        params={"job_id": 4200.0, "cpu_busy": 0.3, "iowait": 0.02, "cpus": 16.0},
        job=True,
    ),
    "input_starved": FaultKind(
        "A Slurm job whose input pipeline cannot keep up: the GPU runs at utilization while the job's "
        "processes keep cpu_busy of its cpus busy (data loaders) or wait on storage (iowait).",
        params={"job_id": 4300.0, "utilization": 0.35, "cpu_busy": 0.97, "iowait": 0.05, "cpus": 16.0},
        during=_input_starved,
        job=True,
    ),
    "allocated_unused": FaultKind(
        "A Slurm job was allocated the GPU but runs nothing on it (it asked for 8 GPUs and uses one): "
        "no process, no memory, utilization 0.",
        params={"job_id": 4200.0, "cpu_busy": 0.3, "iowait": 0.02, "cpus": 16.0},
        during=_allocated_unused,
        job=True,
    ),
    "fan_stall": FaultKind(
        "The fans stop: speed and RPM fall to 0 within seconds while the target keeps following "
        "the (rising) temperature; cooling falls to its fans-stopped value.",
        requires=("fan",),
        during=_fan_stall,
    ),
    "cooling_failure": FaultKind(
        "Clogged heatsink or failed chassis fan: thermal resistance rises to `factor` times normal "
        "over `ramp_seconds`. Under load the GPU reaches its slowdown threshold and throttles.",
        params={"factor": 4.0, "ramp_seconds": 60.0},
        during=_cooling_failure,
    ),
    "fell_off_bus": FaultKind(
        "The GPU falls off the bus: reads raise DeviceLost, XID 79 at onset, its job dies; at the "
        "end it answers again.",
        during=_fell_off_bus,
        xid=lambda _fault: 79,
    ),
    "xid": FaultKind(
        "One XID event with code `xid` at onset; nothing else changes.",
        params={"xid": 13.0},
        requires=("xid_events",),
        xid=_xid_param,
    ),
    "power_brake": FaultKind(
        "External power brake: hw_power_brake_slowdown and hw_slowdown active, clocks cut to "
        "`clock_factor` of maximum, power falls.",
        params={"clock_factor": 0.3},
        during=_power_brake,
    ),
    "ecc_uncorrectable": FaultKind(
        "`count` uncorrectable ECC errors at onset (volatile and aggregate) and, where supported, "
        "one uncorrectable remapped row pending until the end of the window (the GPU reset, which "
        "also zeroes the volatile counters). XID `xid` at onset (94, contained ECC error; "
        "0: none).",
        params={"count": 2.0, "xid": 94.0},
        requires=("ecc",),
        onset=_ecc_onset,
        end=_ecc_end,
        xid=_xid_param,
    ),
    "fan_lag": FaultKind(
        "Worn fan bearing or a failing fan controller: the fan reaches only `ratio` of its target "
        "speed (RPM likewise); it keeps turning, and the GPU runs hotter.",
        params={"ratio": 0.4},
        requires=("fan",),
        during=_fan_lag,
    ),
    "hw_slowdown": FaultKind(
        "HW slowdown that is neither thermal nor a power brake (the fast-trigger over-power "
        "protection, EDPp): hw_slowdown active, clocks cut to `clock_factor` of maximum. A short "
        "repeating window makes the brief flashes seen during clock changes.",
        params={"clock_factor": 0.5},
        during=_hw_slowdown,
    ),
    "pcie_downtrain": FaultKind(
        "The PCIe link trains below its maximum (a bad riser, a dirty slot): current width "
        "`width` lanes and, when `generation` > 0, that generation, whether busy or idle (0: "
        "unchanged).",
        params={"width": 8.0, "generation": 0.0},
        requires=("pcie",),
        during=_pcie_downtrain,
    ),
    "pcie_replays": FaultKind(
        "A marginal PCIe link: the replay counter grows by `per_minute` replays a minute. With "
        "`reset_at_end` (1) the end of the window is the GPU reset after reseating the card, which "
        "zeroes the counter; with 0 the counter just stops growing.",
        params={"per_minute": 30.0, "reset_at_end": 1.0},
        requires=("pcie",),
        during=_pcie_replays,
        end=_pcie_replays_end,
    ),
    "nvlink_down": FaultKind(
        "NVLink link `link` goes inactive (a cable, a connector, an NVSwitch port): the GPU's other "
        "links carry on.",
        params={"link": 5.0},
        requires=("nvlink",),
        during=_nvlink_down,
    ),
    "nvlink_crc_storm": FaultKind(
        "A marginal NVLink: the error totals grow by `crc_flit_per_minute` flit-CRC errors, "
        "`replay_per_minute` replays and `recovery_per_minute` recoveries a minute (the counters "
        "stay where they got to afterwards).",
        params={"crc_flit_per_minute": 120.0, "replay_per_minute": 40.0, "recovery_per_minute": 0.0},
        requires=("nvlink",),
        during=_nvlink_errors,
    ),
    "c2c_link_down": FaultKind(
        "NVLink-C2C link `link` between the GPU and its Grace CPU goes inactive (the superchip's coherent "
        "link degrades: CPU-GPU transfers slow down); the other C2C links carry on.",
        params={"link": 3.0},
        requires=("c2c",),  # gh200, gb200
        during=_c2c_down,
    ),
    "fabric_manager_down": FaultKind(
        "nvidia-fabricmanager is not running: the GPU's fabric registration stays not started until "
        "the end of the window (the fabric manager started), then completes.",
        requires=("fabric",),
        during=_fabric_manager_down,
    ),
    "mig_idle_allocation": FaultKind(
        "A job holds MIG GPU instance `gpu_instance` (30 % of its frame buffer in use) and computes "
        "nothing; the other instances follow the GPU's jobs.",
        params={"gpu_instance": 9.0},
        requires=("mig",),
        during=_mig_idle_allocation,
    ),
    "fabric_degraded": FaultKind(
        "The fabric reports degraded bandwidth for the GPU (an NVSwitch tray lost ports) while the "
        "registration stays completed.",
        requires=("fabric",),
        during=_fabric_degraded,
    ),
    "recovery_action": FaultKind(
        "After an uncorrectable error (XID `xid`, then XID 154) the driver asks for recovery action `action` "
        "(NVML_GPU_RECOVERY_ACTION_*: 1 GPU reset, 2 node reboot, ...) until the end of the window (the "
        "reset or reboot).",
        params={"action": 2.0, "xid": 154.0},
        requires=("recovery_action",),
        during=_recovery_action,
        xid=_xid_param,
    ),
    "row_remap_pending": FaultKind(
        "A row is remapped after `count` correctable errors in it (XID `xid`, 63: recording "
        "event): remapped rows correctable +1 and a remap pending until the end of the window "
        "(the GPU reset, which also zeroes the volatile counters). No uncorrectable error.",
        params={"count": 3.0, "xid": 63.0},
        requires=("ecc", "remapped_rows"),
        onset=_row_remap_pending_onset,
        end=_reset_end,
        xid=_xid_param,
    ),
    "row_remap_failure": FaultKind(
        "A row remapping fails (no spare rows left in the bank): remapped_rows_failed from onset "
        "to the end of the window (the end stands for the repair), XID `xid` (64) at onset.",
        params={"xid": 64.0},
        requires=("remapped_rows",),
        onset=_row_remap_failure_onset,
        end=_row_remap_failure_end,
        xid=_xid_param,
    ),
    "retired_pages_pending": FaultKind(
        "Pre-Ampere page retirement: after `count` correctable errors on one page it is marked for "
        "retirement at the next reboot (XID `xid`, 63); pending until the end of the window (the "
        "reboot, which also zeroes the volatile counters).",
        params={"count": 3.0, "xid": 63.0},
        requires=("ecc", "retired_pages"),
        onset=_retired_pages_onset,
        end=_reset_end,
        xid=_xid_param,
    ),
    "power_smoothing_worn": FaultKind(
        "The power-smoothing circuitry of a Blackwell board reports `percent` % of its lifetime left (XID `xid`, "
        "164: low lifetime) until the end of the window (the board serviced).",
        params={"percent": 6.0, "xid": 164.0},
        requires=("power_smoothing",),
        onset=_power_smoothing_worn_onset,
        end=_power_smoothing_serviced,
        xid=_xid_param,
    ),
    "backend_down": FaultKind(
        "Node-wide (gpu is ignored, use 0): the driver is unloaded or reloading. open(), "
        "discover(), the reads and wait_events raise BackendUnavailable(driver_not_loaded) while "
        "active; afterwards the node answers again.",
        backend="unavailable",
    ),
    "hang": FaultKind(
        "Node-wide (gpu is ignored, use 0): NVML calls hang, as with a wedged driver. read_fast and "
        "read_slow block until the window is over by the injected clock (re-checked every few "
        "milliseconds of real time) or close(). With a FakeClock, run the poll on another thread.",
        backend="hang",
    ),
    "unlisted": FaultKind(
        "The GPU drops off the PCI bus without a trace: its reads raise DeviceLost and discovery "
        "leaves it out while active. The poller notices the smaller count at its next discovery, "
        "so combine it with a short backend_down (a driver reload) at both ends of the window.",
        backend="unlisted",
    ),
}
