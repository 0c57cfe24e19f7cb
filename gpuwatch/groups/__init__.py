"""The reading groups, in one table, and the per-tier containers of their readings.

A group is switched with ``--collector.<name>`` / ``--no-collector.<name>`` (YAML ``collector:
{<name>: false}``, env ``GPUWATCH_COLLECTOR_<NAME>``); a disabled group makes no NVML call, has no
feature series and no metric. ``FastSample``/``SlowSample`` hold one reading per group of that tier
(a group's attribute keeps its empty default when it is disabled, unsupported or not read).

Where things go (docs/groups.md): a new reading goes into its group's module (reading type, probe
and read, spec, render), the fake library, the simulator's profile, docs/metrics.md and the golden
file; a new group is one module here plus its line in ``GROUPS`` and its attribute below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.frozen import quick
from gpuwatch.groups import (
    c2c,
    clocks,
    ecc,
    fabric,
    fans,
    gpm,
    grace,
    jobs,
    kubernetes,
    memory,
    mig,
    nvlink,
    pcie,
    power,
    processes,
    recovery,
    slurm,
    thermal,
    utilization,
    xid,
)
from gpuwatch.groups.base import Group, Spec
from gpuwatch.groups.c2c import C2c
from gpuwatch.groups.clocks import ClockLimits, Clocks
from gpuwatch.groups.ecc import Ecc
from gpuwatch.groups.fabric import Fabric
from gpuwatch.groups.fans import FanReading
from gpuwatch.groups.gpm import NOTHING as NO_GPM
from gpuwatch.groups.gpm import Gpm
from gpuwatch.groups.grace import GraceSensor
from gpuwatch.groups.jobs import JobUsage
from gpuwatch.groups.kubernetes import PodAllocation
from gpuwatch.groups.memory import Memory
from gpuwatch.groups.mig import MigInstance, MigReading
from gpuwatch.groups.nvlink import NvLink
from gpuwatch.groups.pcie import Pcie
from gpuwatch.groups.power import Power, PowerLimits
from gpuwatch.groups.processes import GpuProcess
from gpuwatch.groups.recovery import Recovery
from gpuwatch.groups.selection import Selection
from gpuwatch.groups.slurm import JobAllocation
from gpuwatch.groups.thermal import TemperatureLimits, Temperatures
from gpuwatch.groups.utilization import Utilization

GROUPS: tuple[Group, ...] = (
    thermal.GROUP, fans.GROUP, power.GROUP, clocks.GROUP, utilization.GROUP, memory.GROUP,
    ecc.GROUP, recovery.GROUP, pcie.GROUP, xid.GROUP, processes.GROUP, gpm.GROUP, nvlink.GROUP, fabric.GROUP,
    mig.GROUP, slurm.GROUP, kubernetes.GROUP, jobs.GROUP, c2c.GROUP, grace.GROUP,
)
BY_NAME: Mapping[str, Group] = {g.name: g for g in GROUPS}
DEFAULT_ENABLED: frozenset[str] = frozenset(g.name for g in GROUPS if g.default)
ALL: frozenset[str] = frozenset(BY_NAME)

# Capabilities probed once per GPU and exported as gpuwatch_gpu_feature_supported{feature}.
FEATURES: tuple[str, ...] = tuple(sorted(f for g in GROUPS for f in g.features))
# Features of a class of hardware: a feature series (0) only where the GPU has it and it cannot be read
# (Group.hardware).
HARDWARE_FEATURES: frozenset[str] = frozenset(f for g in GROUPS for f in g.hardware)

SPECS: tuple[Spec, ...] = tuple(spec for g in GROUPS for spec in g.specs)




@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class FastSample:
    """One GPU's readings of the fast tier (default every 2 s), one attribute per group."""

    thermal: Temperatures = Temperatures()
    fans: tuple[FanReading, ...] = ()
    power: Power = Power()
    clocks: Clocks = Clocks()
    utilization: Utilization = Utilization()
    memory: Memory = Memory()
    gpm: Gpm = NO_GPM  # immutable (no dict shared by every sample without GPM readings)
    mig: tuple[MigReading, ...] = ()  # per MIG instance, on MIG-enabled GPUs
    # Lowercase NVML error names of queries that failed in this poll (not NOT_SUPPORTED probes).
    errors: tuple[str, ...] = ()
    # (group, seconds, succeeded) of each group read for this sample: gpuwatch_collector_*
    collected: tuple[tuple[str, float, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class SlowSample:
    """One GPU's readings of the slow tier (default every 30 s): limits, thresholds, health counters."""

    thermal: TemperatureLimits = TemperatureLimits()
    power: PowerLimits = PowerLimits()
    clocks: ClockLimits = ClockLimits()
    utilization: Utilization = Utilization()
    ecc: Ecc = Ecc()
    pcie: Pcie = Pcie()
    processes: tuple[GpuProcess, ...] | None = None  # None: not read (unsupported or not collected)
    nvlink: NvLink = NvLink()
    fabric: Fabric = Fabric()
    mig: tuple[MigInstance, ...] = ()  # the MIG devices, on MIG-enabled GPUs
    c2c: C2c = C2c()
    recovery: Recovery = Recovery()
    errors: tuple[str, ...] = ()
    collected: tuple[tuple[str, float, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class HostSample:
    """One read of the host groups (gpuwatch/hostside/, every slow interval), for the whole node.
    A group's attribute is None when it is off or none of its sources could be read."""

    slurm: tuple[JobAllocation, ...] | None = None
    kubernetes: tuple[PodAllocation, ...] | None = None
    jobs: tuple[JobUsage, ...] | None = None
    # (group, error) met in this read (gpuwatch_collector_errors_total), e.g. ("slurm", "scontrol_timeout")
    errors: tuple[tuple[str, str], ...] = ()
    collected: tuple[tuple[str, float, bool], ...] = ()  # (group, seconds, succeeded)
    # False when a source could not say where some of its jobs or pods are (scontrol failed, a device id
    # that names no GPU here): a GPU without an allocation is then unknown (None), not free
    slurm_complete: bool = True
    kubernetes_complete: bool = True
    gpus: tuple[str, ...] | None = None  # the GPUs (uuids) the read knew of; None: every GPU
    grace: tuple[GraceSensor, ...] | None = None  # the Grace hwmon sensors (None: no Grace node, or off)

    def on(self, uuid: str) -> GpuHost:
        """This GPU's part: its allocations."""
        return GpuHost(_part(self.slurm, uuid, self.slurm_complete), _part(self.kubernetes, uuid,
                                                                           self.kubernetes_complete))


def _part(allocations: tuple[Any, ...] | None, uuid: str, complete: bool) -> tuple[Any, ...] | None:
    if allocations is None:
        return None
    mine = tuple(a for a in allocations if a.uuid == uuid)
    return mine if mine or complete else None


@dataclass(frozen=True, slots=True)
class GpuHost:
    """One GPU's part of a HostSample: who the schedulers allocated it to (None: not readable)."""

    slurm: tuple[JobAllocation, ...] | None = None
    kubernetes: tuple[PodAllocation, ...] | None = None

    @property
    def allocated(self) -> bool | None:
        """Whether a scheduler allocated the GPU; None when no scheduler source can be read."""
        if self.slurm is None and self.kubernetes is None:
            return None
        return bool(self.slurm) or bool(self.kubernetes)


def _flat(container: type) -> dict[str, tuple[str, str | None]]:
    """Reading field name -> (attribute of the container, field of that reading or None for a reading
    that is one value): the flat names the trace format and the test helpers use."""
    table: dict[str, tuple[str, str | None]] = {}
    default = container()
    for f in dataclasses.fields(container):
        value = getattr(default, f.name)
        names = [sub.name for sub in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else [None]
        for sub in names:
            flat = sub or f.name
            assert flat not in table, f"{container.__name__}: {flat} is in two groups"
            table[flat] = (f.name, sub)
    return table


FAST_FLAT: Mapping[str, tuple[str, str | None]] = _flat(FastSample)
SLOW_FLAT: Mapping[str, tuple[str, str | None]] = _flat(SlowSample)


def _build(container: type, table: Mapping[str, tuple[str, str | None]], values: Mapping[str, Any]) -> Any:
    readings: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for name, value in values.items():
        try:
            attr, sub = table[name]
        except KeyError:
            raise TypeError(f"{container.__name__} has no reading {name!r}") from None
        if sub is None:
            direct[attr] = value
        else:
            readings.setdefault(attr, {})[sub] = value
    default = _DEFAULTS[container]
    for attr, fields in readings.items():
        direct[attr] = dataclasses.replace(getattr(default, attr), **fields)
    return container(**direct)


_DEFAULTS: dict[type, Any] = {FastSample: FastSample(), SlowSample: SlowSample()}


def fast_sample(**values: Any) -> FastSample:
    """A FastSample from flat reading names: ``fast_sample(temperature_celsius=40.0, fans=(...))``."""
    return _build(FastSample, FAST_FLAT, values)


def slow_sample(**values: Any) -> SlowSample:
    """A SlowSample from flat reading names: ``slow_sample(ecc_errors={...}, pcie_replays=3)``."""
    return _build(SlowSample, SLOW_FLAT, values)


def flat(sample: FastSample | SlowSample) -> dict[str, Any]:
    """The sample's readings by flat name (bookkeeping fields included)."""
    table = FAST_FLAT if isinstance(sample, FastSample) else SLOW_FLAT
    return {name: getattr(getattr(sample, attr), sub) if sub else getattr(sample, attr)
            for name, (attr, sub) in table.items()}


def unselected_defaults(kind: type, enabled: frozenset[str]) -> tuple[tuple[str, Any], ...]:
    """(attribute, empty default) in ``kind`` (FastSample or SlowSample) of each group not in ``enabled``."""
    default = _DEFAULTS[kind]
    tier = "fast" if kind is FastSample else "slow"
    return tuple((attr, getattr(default, attr)) for g in GROUPS
                 if g.name not in enabled and (attr := getattr(g, tier)) is not None)


__all__ = ["ALL", "BY_NAME", "DEFAULT_ENABLED", "FEATURES", "GROUPS", "HARDWARE_FEATURES",
           "SPECS", "FAST_HISTORY", "FastSample", "Selection",
           "GpuHost", "HostSample", "SlowSample",
           "fast_sample", "flat", "slow_sample", "unselected_defaults"]


def _nothing(_: Any) -> tuple[()]:
    return ()


def _fast_history() -> tuple[tuple[str, Callable[[Any], Any] | None], ...]:
    owners = {g.fast: g.history for g in GROUPS if g.fast}
    kept: list[tuple[str, Callable[[Any], Any] | None]] = []
    for f in dataclasses.fields(FastSample):
        if f.name in ("errors", "collected"):  # a poll's errors and group timings: never looked back at
            kept.append((f.name, _nothing))
        elif f.name in owners:
            kept.append((f.name, owners[f.name]))
        else:
            raise AssertionError(f"FastSample.{f.name} belongs to no group")
    return tuple(kept)


# Per FastSample field, in order: what the rules' look-back keeps of it (Group.history; None: all of it).
FAST_HISTORY: tuple[tuple[str, Callable[[Any], Any] | None], ...] = _fast_history()
