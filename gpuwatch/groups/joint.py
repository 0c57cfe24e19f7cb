"""Families made of several groups' readings together, each rendered by exactly one unit here while any of
the groups it reads is selected (the exporter renders them after the groups, per GPU, like a group):

- ``gpuwatch_gpu_job_info`` (its spec is the processes group's): the jobs with a process on the GPU (processes:
  NVML's process list attributed through /proc) and the Slurm jobs allocated the GPU without one (slurm);
- ``gpuwatch_gpu_allocated`` (the catalogue's): whether any scheduler group (slurm, kubernetes) allocated it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwatch.groups.base import Emit, Render


@dataclass(frozen=True)
class Joint:
    name: str
    of: frozenset[str]  # rendered while any of these groups is selected
    # (GpuState, fresh fast sample, fresh slow sample, fresh GpuHost) -> the two readings render() takes
    select: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    render: Render


def _holders(state: Any, fast: Any, slow: Any, host: Any) -> tuple[Any, Any]:
    """(the attributed processes of the last slow poll while it is fresh, (the jobs those processes belong to,
    this GPU's Slurm allocations) while the host read is fresh)."""
    workloads = state.workloads if slow is not None else None
    if host is None or host.slurm is None:
        return workloads, None
    return workloads, (frozenset((w.scheduler, w.job_id) for w in state.workloads), host.slurm)


def _job_info(emit: Emit, workloads: Any, slurm: Any) -> None:
    for job in {(p.scheduler, p.job_id, p.user) for p in workloads or ()}:
        emit("gpuwatch_gpu_job_info", job, 1)
    if slurm is not None:  # an allocated job is added only where no process of it is on the GPU
        running, allocations = slurm
        for a in allocations:
            if ("slurm", a.job_id) not in running:
                emit("gpuwatch_gpu_job_info", ("slurm", a.job_id, a.user), 1)


def _schedulers(state: Any, fast: Any, slow: Any, host: Any) -> tuple[Any, Any]:
    return None, host


def _allocated(emit: Emit, _: None, host: Any) -> None:
    """gpuwatch_gpu_allocated: 1 allocated by any scheduler group, 0 free, absent when none can tell."""
    if host is not None:
        emit("gpuwatch_gpu_allocated", (), host.allocated)


JOINT: tuple[Joint, ...] = (
    Joint("job_info", frozenset({"processes", "slurm"}), _holders, _job_info),
    Joint("allocated", frozenset({"slurm", "kubernetes"}), _schedulers, _allocated),
)
