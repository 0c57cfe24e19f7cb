"""processes: who uses the GPU. NVML's compute process list, attributed to jobs and users.

Slow tier: nvmlDeviceGetComputeRunningProcesses (the versioned _v3, else _v2: the unversioned
wrapper raises NVMLLibraryMismatchError, which is no NVMLError, when _v3 is missing; nvml.md §9),
about 4.5 ms per GPU on a real driver. The poller then maps each PID through /proc/PID/cgroup to
its Slurm job, pod or unit (gpuwatch/attribution.py). Per-PID series come with
``--collector.processes.per-pid`` (PIDs churn), at most ``--collector.processes.per-pid-max``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU, as NVML lists it (host PID)."""

    pid: int
    used_memory_bytes: int | None = None  # None: NVML cannot tell (e.g. Windows WDDM)
    gpu_instance: int | None = None  # the MIG GPU instance it runs on (None: not on MIG, or not told)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A GPU process attributed to a user and a workload (gpuwatch/attribution.py)."""

    pid: int
    used_memory_bytes: int | None
    user: str  # user name, or the numeric uid, or "" when the process is not visible
    scheduler: str  # slurm | kubernetes | systemd | none | unknown (PID not visible: another PID namespace, exited)
    job_id: str  # Slurm job id, pod UID, systemd unit, or ""
    container: str = ""  # Kubernetes container id, where known
    gpu_instance: int | None = None  # the MIG GPU instance it runs on


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.list = dev.first(dev.call("nvmlDeviceGetComputeRunningProcesses_v3"),
                              dev.call("nvmlDeviceGetComputeRunningProcesses_v2"))

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> tuple[GpuProcess, ...] | None:
        listed = q(self.list) if self.list is not None else None
        if listed is None:
            return None
        return tuple(GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                                _instance(getattr(p, "gpuInstanceId", None)))
                     for p in listed)


_NO_INSTANCE = 0xFFFFFFFF


def _instance(gi: Any) -> int | None:
    return None if gi is None or int(gi) == _NO_INSTANCE else int(gi)


def select(state: Any, fast: Any, slow: Any, host: Any) -> tuple[Any, Any]:
    """The attributed processes of the last slow poll, while that poll is fresh."""
    return None, (state.workloads if slow is not None else None)


def render(emit: Emit, fast: None, workloads: tuple[ProcessInfo, ...] | None) -> None:
    # gpuwatch_gpu_job_info (this group's spec) is rendered with the slurm group's allocations: groups/joint.py
    memory: dict[tuple[str, str], int] = {}
    mig_jobs: set[tuple[str, ...]] = set()
    for p in workloads or ():
        if p.gpu_instance is not None:
            mig_jobs.add((str(p.gpu_instance), p.scheduler, p.job_id, p.user))
        if p.used_memory_bytes is not None:
            memory[(p.scheduler, p.job_id)] = memory.get((p.scheduler, p.job_id), 0) + p.used_memory_bytes
    for job in mig_jobs:
        emit("gpuwatch_mig_job_info", job, 1)
    for key, used in memory.items():
        emit("gpuwatch_workload_memory_used_bytes", key, used)


GROUP: Group[None, Any] = Group(  # render takes the attributed processes (select), not the slow reading
    name="processes",
    attributed=True,
    help="compute processes per GPU, attributed to Slurm jobs, pods and units through /proc",
    slow="processes",
    nvml=Nvml,
    select=select,
    render=render,
    options={"per-pid": (False, "export gpuwatch_process_memory_used_bytes per process (PIDs churn: off by default)"),
             "per-pid-max": (100, "at most this many per-process series per node")},
    specs=(
        Spec("gpuwatch_gpu_job_info", "gauge", G + ("scheduler", "job_id", "user"),
             "1 while a workload holds the GPU: scheduler slurm (job_id = Slurm job id), kubernetes (pod UID), "
             "systemd (unit), none (a plain process) or unknown (PID not visible); from NVML's process list "
             "and /proc/PID/cgroup."),
        Spec("gpuwatch_mig_job_info", "gauge", G + ("gpu_instance", "scheduler", "job_id", "user"),
             "1 while a workload runs on the MIG GPU instance: the attribution of gpuwatch_gpu_job_info per instance "
             "(the process list's gpuInstanceId; privileged callers only, else absent)."),
        Spec("gpuwatch_workload_memory_used_bytes", "gauge", G + ("scheduler", "job_id"),
             "Frame buffer used by the workload's processes on the GPU in bytes "
             "(nvmlDeviceGetComputeRunningProcesses)."),
        Spec("gpuwatch_process_memory_used_bytes", "gauge", G + ("pid", "scheduler", "job_id", "user"),
             "Frame buffer used by one process in bytes; only with --collector.processes.per-pid, at most "
             "--collector.processes.per-pid-max series per node; never command lines."),
    ),
)
