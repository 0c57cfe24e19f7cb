"""The physics of one simulated GPU, stepped on a fixed grid, and the samples it reports."""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from dataclasses import dataclass, field

from gpuwatch.backends.simulated.conditions import Conditions, Health
from gpuwatch.backends.simulated.faults import FAULT_KINDS, Fault
from gpuwatch.backends.simulated.profiles import ALL_REASONS, MIB, Profile, fan_curve
from gpuwatch.groups import fast_sample, slow_sample
from gpuwatch.groups.c2c import ERRORS as C2C_ERRORS
from gpuwatch.groups.mig import MigInstance, MigReading
from gpuwatch.groups.nvlink import ERRORS as NVLINK_ERRORS
from gpuwatch.groups.nvlink import NVLINK5_ERRORS
from gpuwatch.model import (
    CLOCKS,
    CLOCKS_EVENT_REASON_BITS,
    CLOCKS_EVENT_TIME_REASONS,
    FanReading,
    FastSample,
    SlowSample,
    decode_clocks_event_reasons,
)


def _derive_seed(*parts: object) -> int:
    text = ":".join(str(p) for p in ("gpuwatch-simulated", *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True, slots=True)
class _Job:
    start: float
    end: float
    utilization: float
    memory_fraction: float
    memory_intensity: float


class _JobSchedule:
    """A GPU's seeded sequence of jobs, generated lazily. Queried with non-decreasing times."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._jobs: deque[_Job] = deque()
        self._horizon = self._rng.uniform(-240.0, 90.0)  # start of the next job to generate

    def at(self, t: float) -> _Job | None:
        while self._horizon <= t:
            rng = self._rng
            start = self._horizon
            end = start + rng.uniform(150.0, 900.0)
            self._jobs.append(
                _Job(
                    start,
                    end,
                    utilization=rng.uniform(0.6, 1.0),
                    memory_fraction=rng.uniform(0.1, 0.85),
                    memory_intensity=rng.uniform(0.05, 0.6),
                )
            )
            self._horizon = end + rng.uniform(20.0, 240.0)
        while self._jobs and self._jobs[0].end <= t:
            self._jobs.popleft()
        if self._jobs and self._jobs[0].start <= t:
            return self._jobs[0]
        return None


@dataclass(slots=True)
class SimGpu:
    """The evolving state of one simulated GPU."""

    index: int
    uuid: str
    profile: Profile
    faults: tuple[Fault, ...]
    jobs: _JobSchedule
    noise: random.Random
    ambient: float
    temperature: float
    energy: float
    health: Health
    step: int = -1
    fan_speed: float = 0.0
    fan_target: float = 0.0
    power: float = 0.0
    utilization: float = 0.0
    memory_utilization: float = 0.0
    memory_used_mib: float = 0.0
    clock_factor: float = 1.0
    busy: bool = False
    capped: bool = False
    sw_thermal: bool = False
    hw_thermal: bool = False
    power_brake: bool = False
    hw_slowdown: bool = False
    lost: bool = False
    pcie_width: int | None = None  # trained-down link (faults), else the profile's
    pcie_generation: int | None = None
    # GPM: this step's activity (ratios) and the traffic integrated so far (bytes)
    sm_active: float = 0.0
    nvlink_down: tuple[int, ...] = ()
    nvlink_storm: bool = False  # flit errors accruing now (NVLink5: the effective bit error rate is high)
    c2c_down: tuple[int, ...] = ()
    grace_power: float = 0.0  # the GPU's share of its Grace module beyond the GPU (CPU, memory, SysIO), W
    fabric_state: str = "completed"
    fabric_issues: tuple[str, ...] = ()
    recovery_action: int = 0
    mig_idle: tuple[int, ...] = ()
    pcie_bytes: dict[str, float] = field(default_factory=lambda: {"tx": 0.0, "rx": 0.0})
    nvlink_bytes: dict[str, float] = field(default_factory=lambda: {"tx": 0.0, "rx": 0.0})
    active_faults: set[int] = field(default_factory=set)
    event_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(CLOCKS_EVENT_TIME_REASONS, 0.0)
    )


def new_gpu(index: int, uuid: str, profile: Profile, faults: tuple[Fault, ...], seed: int) -> SimGpu:
    rng = random.Random(_derive_seed(seed, index, "init"))
    ambient = profile.ambient_celsius + rng.uniform(-2.0, 3.0)
    idle_resistance = profile.resistance_fans_stopped
    if profile.fan_count:
        speed = fan_curve(ambient)
        idle_resistance -= (profile.resistance_fans_stopped - profile.resistance_fans_full) * speed
    gpu = SimGpu(
        index=index,
        uuid=uuid,
        profile=profile,
        faults=faults,
        jobs=_JobSchedule(_derive_seed(seed, index, "jobs")),
        noise=random.Random(_derive_seed(seed, index, "noise")),
        ambient=ambient,
        temperature=ambient + profile.idle_watts * idle_resistance,
        energy=rng.uniform(1e7, 5e8),  # joules since the (simulated) driver load
        health=Health(
            ecc=dict.fromkeys(
                [(e, c) for e in ("corrected", "uncorrected") for c in ("volatile", "aggregate")], 0
            ),
            remapped_rows={"correctable": 0, "uncorrectable": 0},
        ),
    )
    if profile.fan_count:
        gpu.fan_target = gpu.fan_speed = fan_curve(gpu.temperature)
    step(gpu, 0.0, 0.0)
    gpu.step = 0
    return gpu


def step(g: SimGpu, t: float, dt: float) -> None:
    """Advance ``g`` to time ``t`` (seconds since open) over a step of ``dt`` seconds."""
    p = g.profile
    jitter_util, jitter_power = g.noise.uniform(-1.0, 1.0), g.noise.uniform(-1.0, 1.0)

    job = g.jobs.at(t)
    if job is None:
        c = Conditions(utilization=0.0, memory_fraction=0.0, memory_intensity=0.0)
    else:
        c = Conditions(
            utilization=min(1.0, max(0.0, job.utilization + 0.03 * jitter_util)),
            memory_fraction=job.memory_fraction,
            memory_intensity=job.memory_intensity,
        )
    for i, fault in enumerate(g.faults):
        kind = FAULT_KINDS[fault.kind]
        since = fault.since_onset(t)
        if since is not None and i not in g.active_faults:
            g.active_faults.add(i)
            if kind.onset:
                kind.onset(fault, g.health, p)
        elif since is None and i in g.active_faults:
            g.active_faults.discard(i)
            if kind.end:
                kind.end(fault, g.health, p)
        if since is not None and kind.during:
            kind.during(fault, c, since)
    if c.lost:  # its processes died with it
        c.utilization = c.memory_fraction = 0.0

    util = min(1.0, max(0.0, c.utilization))
    busy = util > 0.0
    temp = g.temperature

    # thermal protection, with hysteresis
    if temp >= p.gpu_max_celsius:
        g.sw_thermal = True
    elif temp < p.gpu_max_celsius - 2.0:
        g.sw_thermal = False
    if temp >= p.slowdown_celsius:
        g.hw_thermal = True
    elif temp < p.slowdown_celsius - 5.0:
        g.hw_thermal = False
    factor = 1.0
    if g.sw_thermal:
        over = (temp - p.gpu_max_celsius) / (p.slowdown_celsius - p.gpu_max_celsius)
        factor = min(factor, 1.0 - 0.25 * min(1.0, max(0.0, over)))
    if g.hw_thermal:
        over = (temp - p.slowdown_celsius) / (p.shutdown_celsius - p.slowdown_celsius)
        factor = min(factor, 0.5 * min(1.0, max(0.3, 1.0 - 0.6 * over)))
    if c.power_brake or c.hw_slowdown:
        factor = min(factor, c.clock_cap)

    # power, capped at the enforced limit
    idle = p.idle_watts * (1.0 + 0.02 * jitter_power)
    dynamic = util * (p.full_load_watts - p.idle_watts) * factor * (1.0 + 0.015 * jitter_power)
    limit = p.power_limit_watts["enforced"]
    capped = busy and idle + dynamic > limit
    if capped:
        factor *= (limit - idle) / dynamic
        power = limit
    else:
        power = idle + dynamic

    # fans and temperature
    resistance = p.resistance_fans_stopped
    if p.fan_count:
        g.fan_target = fan_curve(temp)
        goal = 0.0 if c.fan_stalled else g.fan_target * c.fan_ratio
        tau = 1.0 if c.fan_stalled else p.fan_time_constant_seconds
        g.fan_speed += (goal - g.fan_speed) * (1.0 - math.exp(-dt / tau))
        resistance -= (p.resistance_fans_stopped - p.resistance_fans_full) * g.fan_speed
    steady = g.ambient + c.inlet_offset_celsius + power * resistance * c.resistance_factor
    g.temperature += (steady - temp) * (1.0 - math.exp(-dt / p.thermal_time_constant_seconds))

    # memory: allocations ramp up over ~10 s, frees are immediate
    usable = p.memory_total_mib - p.memory_reserved_mib
    wanted = usable * c.memory_fraction
    if wanted > g.memory_used_mib:
        g.memory_used_mib += (wanted - g.memory_used_mib) * (1.0 - math.exp(-dt / 10.0))
    else:
        g.memory_used_mib = wanted

    grace_idle, grace_busy = p.grace_watts
    g.grace_power = grace_idle + (grace_busy - grace_idle) * util * (1.0 + 0.01 * jitter_power)
    # NVML's energy counter covers the whole module on a Grace-coupled GPU
    g.energy += (power + (g.grace_power if p.c2c_links else 0.0)) * dt
    active = {
        "sw_power_cap": capped,
        "sw_thermal_slowdown": g.sw_thermal,
        "hw_thermal_slowdown": g.hw_thermal,
        "hw_power_brake_slowdown": c.power_brake,
        "thermal": g.sw_thermal or g.hw_thermal,
        "low_utilization": not busy,
    }
    for reason, on in active.items():
        if on:
            g.event_seconds[reason] += dt
    g.power, g.utilization, g.busy, g.capped = power, util, busy, capped
    g.memory_utilization = min(1.0, util * c.memory_intensity * (1.0 + 0.1 * jitter_util))
    g.clock_factor, g.power_brake, g.lost = factor, c.power_brake, c.lost
    g.hw_slowdown = c.hw_slowdown
    g.pcie_width, g.pcie_generation = c.pcie_width, c.pcie_generation
    g.health.pcie_replays += c.replays_per_second * dt
    # SM activity trails "utilization" (a resident kernel) by how much of the GPU the job fills
    g.sm_active = min(1.0, util * factor * (0.55 + 0.35 * c.memory_intensity))
    pcie = (0.2 + 20.0 * util) * MIB * dt  # MiB/s: input batches in, results out
    g.pcie_bytes["tx"] += pcie * 0.4
    g.pcie_bytes["rx"] += pcie
    g.nvlink_down, g.fabric_state, g.fabric_issues = c.nvlink_down, c.fabric_state or "completed", c.fabric_issues
    g.nvlink_storm = c.nvlink_errors_per_second.get("crc_flit", 0.0) > 0
    g.c2c_down = c.c2c_down
    g.mig_idle = c.mig_idle
    g.recovery_action = c.recovery_action
    for error, rate in c.nvlink_errors_per_second.items():
        g.health.nvlink_errors[error] = g.health.nvlink_errors.get(error, 0.0) + rate * dt
    if p.nvlink_links:  # collectives at a share of the links' bandwidth
        nvlink = util * 0.3 * p.nvlink_links * p.nvlink_gbps * 1e9 * dt
        g.nvlink_bytes["tx"] += nvlink
        g.nvlink_bytes["rx"] += nvlink


def fast_reading(g: SimGpu) -> FastSample:
    p = g.profile
    temperature = float(round(g.temperature))  # NVML reports whole degrees
    fans: tuple[FanReading, ...] = ()
    if p.fan_count:
        speed = round(g.fan_speed * 100) / 100
        fans = tuple(
            FanReading(
                fan=i,
                speed_ratio=speed,
                target_speed_ratio=round(g.fan_target * 100) / 100,
                speed_rpm=float(round(g.fan_speed * p.fan_max_rpm)),
            )
            for i in range(p.fan_count)
        )
    if g.busy:  # memory clock stays at max; the others follow the throttle factor
        clocks = {
            name: p.clock_max_mhz[name]
            if name == "memory"
            else max(p.clock_idle_mhz[name], _round_to(p.clock_max_mhz[name] * g.clock_factor, 15))
            for name in CLOCKS
        }
    else:
        clocks = {name: p.clock_idle_mhz[name] for name in CLOCKS}
    mask = 0
    for reason, on in (
        ("gpu_idle", not g.busy),
        ("sw_power_cap", g.capped),
        ("sw_thermal_slowdown", g.sw_thermal),
        ("hw_thermal_slowdown", g.hw_thermal),
        ("hw_power_brake_slowdown", g.power_brake),
        ("hw_slowdown", g.hw_thermal or g.power_brake or g.hw_slowdown),
    ):
        if on:
            mask |= CLOCKS_EVENT_REASON_BITS[reason]
    used = round(g.memory_used_mib)
    memory_temperature = None
    if p.memory_temperature is not None:
        offset, slope = p.memory_temperature
        memory_temperature = float(round(offset + slope * g.temperature))
    return fast_sample(
        temperature_celsius=temperature,
        memory_temperature_celsius=memory_temperature,
        temperature_margin_celsius=(
            p.gpu_max_celsius - temperature if p.threshold_scale == "tlimit" else None
        ),
        fans=fans,
        power_watts=round(g.power, 3),
        module_power_watts=round(g.power + g.grace_power, 3) if p.c2c_links else None,
        energy_joules=round(g.energy, 3),
        performance_state=p.busy_pstate if g.busy else p.idle_pstate,
        utilization_ratio={} if p.mig_instances else {  # NVML has none for a MIG-enabled GPU
            "gpu": round(g.utilization * 100) / 100,
            "memory": round(g.memory_utilization * 100) / 100,
        },
        memory_total_bytes=p.memory_total_mib * MIB,
        memory_used_bytes=used * MIB,
        memory_free_bytes=(p.memory_total_mib - p.memory_reserved_mib - used) * MIB,
        memory_reserved_bytes=p.memory_reserved_mib * MIB,
        clock_hertz={name: mhz * 1e6 for name, mhz in clocks.items() if name != "video"},  # video: slow tier
        clocks_event_active=decode_clocks_event_reasons(mask, ALL_REASONS),
        clocks_event_seconds={r: g.event_seconds[r] for r in p.clocks_event_time_reasons},
        **(_gpm(g) if p.gpm and not p.mig_instances else {}),
        **({"mig": _mig_readings(g)} if p.mig_instances else {}),
    )


def _mig_readings(g: SimGpu) -> tuple[MigReading, ...]:
    """Each instance runs a share of the GPU's job (the same activity, memory in proportion to its
    size); an instance held idle (fault mig_idle_allocation) keeps 30 % of its memory and no SM work."""
    p = g.profile
    usable = p.memory_total_mib - p.memory_reserved_mib
    share = g.memory_used_mib / usable if usable else 0.0
    out = []
    for gi, _, total_mib in p.mig_instances:
        idle = gi in g.mig_idle
        used = round(total_mib * (0.3 if idle else share))
        sm = 0.0 if idle else round(g.sm_active, 4)
        dram = 0.0 if idle else round(g.memory_utilization * 0.8, 4)
        out.append(MigReading(gi, total_mib * MIB, used * MIB, sm, dram, round(sm * 0.6, 4)))
    return tuple(out)


def _gpm(g: SimGpu) -> dict[str, object]:
    sm = g.sm_active
    return dict(  # the gpm group's default set (its detail option is the NVML backend's)
        sm_active_ratio=round(sm, 4),
        pipe_active_ratio={"tensor": round(sm * 0.6, 4)},
        dram_bandwidth_ratio=round(g.memory_utilization * 0.8, 4),
        pcie_traffic_bytes={d: float(round(v)) for d, v in g.pcie_bytes.items()},
    )


def slow_reading(g: SimGpu, video: bool = False) -> SlowSample:
    """The slow tier's readings; ``video``: with encoder and decoder utilization (--collector.utilization.video;
    the simulated workloads are compute jobs: both engines idle)."""
    p = g.profile
    absolute = {
        "shutdown": p.shutdown_celsius,
        "slowdown": p.slowdown_celsius,
        "gpu_max": p.gpu_max_celsius,
    }
    thresholds: dict[str, float] = {}
    margin_thresholds: dict[str, float] = {}
    if p.threshold_scale == "absolute":
        thresholds = absolute
    else:
        margin_thresholds = {name: p.gpu_max_celsius - value for name, value in absolute.items()}
        if p.memory_max_tlimit is not None:
            margin_thresholds["memory_max"] = p.memory_max_tlimit
    h = g.health
    generation = p.pcie_max_generation if g.busy else p.pcie_idle_generation
    if g.pcie_generation is not None:
        generation = min(generation, g.pcie_generation)
    width = p.pcie_width if g.pcie_width is None else min(p.pcie_width, g.pcie_width)
    return slow_sample(
        temperature_threshold_celsius=thresholds,
        utilization_ratio={"encoder": 0.0, "decoder": 0.0} if video and not p.mig_instances else {},
        clock_hertz={"video": (p.clock_max_mhz if g.busy else p.clock_idle_mhz)["video"] * 1e6},
        temperature_margin_threshold_celsius=margin_thresholds,
        power_limit_watts=dict(p.power_limit_watts),
        power_smoothing_lifetime_ratio=None if p.power_smoothing_lifetime_percent is None
        else (p.power_smoothing_lifetime_percent if h.power_smoothing_percent is None
              else h.power_smoothing_percent) / 100.0,
        clock_max_hertz={name: mhz * 1e6 for name, mhz in p.clock_max_mhz.items()},
        ecc_errors=dict(h.ecc) if p.ecc else {},
        remapped_rows=dict(h.remapped_rows) if p.remapped_rows else {},
        remapped_rows_pending=h.remapped_rows_pending if p.remapped_rows else None,
        remapped_rows_failed=h.remapped_rows_failed if p.remapped_rows else None,
        retired_pages_pending=h.retired_pages_pending if p.retired_pages else None,
        pcie_link_generation={"current": generation, "max": p.pcie_max_generation},
        pcie_link_width={"current": width, "max": p.pcie_width},
        pcie_replays=int(h.pcie_replays),
        **(_nvlink(g) if p.nvlink_links else {}),
        **(_fabric(g) if p.fabric else {}),
        **({"recovery_action": g.recovery_action} if p.recovery_action else {}),
        **({"mig": _mig_instances(g)} if p.mig_instances else {}),
        **(_c2c(g) if p.c2c_links else {}),
    )


def _c2c(g: SimGpu) -> dict[str, object]:
    """The C2C links (no errors: the simulated links are clean)."""
    links = range(g.profile.c2c_links)
    up = {str(link): link not in g.c2c_down for link in links}
    return dict(c2c_up=up, c2c_low_power={str(link): False for link in links},
                c2c_bandwidth_bytes={link: g.profile.c2c_mbps * 1e6 for link, active in up.items() if active},
                c2c_errors={kind: 0 for kind in C2C_ERRORS},
                c2c_up_at_discovery={str(link): True for link in links})


def _mig_instances(g: SimGpu) -> tuple[MigInstance, ...]:
    digest = hashlib.sha256(f"{g.uuid}/mig".encode()).hexdigest()
    return tuple(MigInstance(gi, 0, f"MIG-{digest[k * 8:k * 8 + 8]}-{digest[32:36]}-{digest[36:40]}-{digest[40:44]}-"
                                    f"{digest[44:56]}", profile)
                 for k, (gi, profile, _) in enumerate(g.profile.mig_instances))


def _fabric(g: SimGpu) -> dict[str, object]:
    completed = g.fabric_state == "completed"
    health = {issue: issue in g.fabric_issues for issue in ("degraded_bandwidth", "route_recovery")}
    return dict(fabric_state=g.fabric_state, fabric_status="success" if completed else None, fabric_health=health,
                fabric_cluster_uuid="00000000-0000-0000-0000-000000000000", fabric_clique_id=0)


# What a marginal link's errors are on NVLink5: the flit errors that FEC could not correct are effective errors
# (and raise the effective bit error rate), replays show as corrected symbol errors, retrainings as recoveries.
_NVLINK5_KINDS = {"effective": "crc_flit", "symbol": "replay", "recovery_successful": "recovery"}
_STORM_BER = 4e-12  # effective BER while effective errors accrue (DCGM fails a link above 1e-12)


def _nvlink(g: SimGpu) -> dict[str, object]:
    links = g.profile.nvlink_links
    errors = g.health.nvlink_errors
    if g.profile.nvlink_generation >= 5:
        counts = {kind: int(errors.get(_NVLINK5_KINDS.get(kind, kind), 0.0)) for kind in NVLINK5_ERRORS}
        ber = {"effective": _STORM_BER if g.nvlink_storm else 0.0}
        nvlink5: dict[str, object] = dict(nvlink_bit_error_rate=ber, nvlink_generation=5)
    else:
        counts = {kind: int(errors.get(kind, 0.0)) for kind in NVLINK_ERRORS}
        nvlink5 = {}
    return dict(
        **nvlink5,
        nvlink_up={str(link): link not in g.nvlink_down for link in range(links)},
        nvlink_errors=counts,
        nvlink_traffic_bytes={d: float(round(v / 1024) * 1024) for d, v in g.nvlink_bytes.items()},
        nvlink_up_at_discovery={str(link): True for link in range(links)},
        nvlink_remote={str(link): f"NVSwitch 00000000:{0x05 + link % 4:02X}:00.0" for link in range(links)},
    )


def _round_to(value: float, quantum: float) -> float:
    return float(round(value / quantum) * quantum)


