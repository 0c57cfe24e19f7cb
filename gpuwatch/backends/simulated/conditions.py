"""What a simulated GPU's physics takes as inputs (Conditions, set by the faults every step) and its lasting
health state (Health: error counters, remapped rows, ...), which faults change at their onset and end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Conditions:
    """Inputs of one physics step of one GPU; fault kinds modify them while active."""

    utilization: float
    memory_fraction: float  # of the usable frame buffer the running job wants
    memory_intensity: float  # memory-engine utilization per unit of GPU utilization
    resistance_factor: float = 1.0
    inlet_offset_celsius: float = 0.0  # the air reaching the GPU is this much warmer than the room's
    fan_stalled: bool = False
    power_brake: bool = False
    hw_slowdown: bool = False  # HW slowdown that is neither thermal nor a power brake
    clock_cap: float = 1.0
    lost: bool = False
    fan_ratio: float = 1.0  # the fan reaches this share of its target
    pcie_width: int | None = None  # link trained down to this many lanes
    pcie_generation: int | None = None  # link trained down to this generation
    replays_per_second: float = 0.0
    nvlink_down: tuple[int, ...] = ()  # links inactive
    c2c_down: tuple[int, ...] = ()  # C2C links (to the Grace CPU) inactive
    nvlink_errors_per_second: dict[str, float] = field(default_factory=dict)  # error kind -> rate
    fabric_state: str | None = None  # overrides "completed" (the fabric manager is not running)
    fabric_issues: tuple[str, ...] = ()  # fabric health issues reported
    recovery_action: int = 0  # NVML_GPU_RECOVERY_ACTION_* the driver asks for
    mig_idle: tuple[int, ...] = ()  # MIG GPU instances held (memory in use) but computing nothing


@dataclass(slots=True)
class Health:
    """Health counters of one GPU that fault onsets and ends change."""

    ecc: dict[tuple[str, str], int]
    remapped_rows: dict[str, int]
    remapped_rows_pending: bool = False
    remapped_rows_failed: bool = False
    retired_pages_pending: bool = False
    pcie_replays: float = 0.0
    nvlink_errors: dict[str, float] = field(default_factory=dict)  # error kind -> count over the links
    power_smoothing_percent: float | None = None  # worn power-smoothing circuitry: % left (None: the profile's)
