"""jobs: the host side of each job on the node — CPU time, I/O and the CPUs it may use (psutil).

No NVML: per Slurm job and Kubernetes pod in this node's cgroup tree, every process of its
``cgroup.procs`` (data loaders often never touch the GPU: NVML's list would miss them) is read with
psutil (gpuwatch/hostside/jobs.py) on the host job's thread every slow interval. CPU seconds are
summed per mode (user, system, and iowait: the time blocked on block I/O, from the kernel's delay
accounting, 0 unless ``kernel.task_delayacct`` is on); the totals keep the time of processes that
exited, so they only grow while the job lives. The CPUs a job may use come from its cpuset and
``cpu.max`` (cgroup v1: ``cpuset.cpus``, ``cpu.cfs_quota_us``). Node-level families, one series
set per job, gone with the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.groups.base import Emit, Group, Spec

MODES = ("user", "system", "iowait")


@dataclass(frozen=True, slots=True)
class JobUsage:
    """A job's processes on the host, summed, at one read."""

    scheduler: str  # slurm | kubernetes
    job_id: str  # Slurm job id or pod UID (as gpuwatch_gpu_job_info's job_id)
    cpu_seconds: tuple[float, float, float | None] = (0.0, 0.0, 0.0)  # user, system, iowait (MODES); None: unknown
    read_bytes: int | None = None  # None: some process's /proc/PID/io is not readable
    write_bytes: int | None = None
    cpus: float | None = None  # CPUs it may use (cpuset, CPU quota); None: unknown
    processes: int = 0
    # Over the time since the previous read (None at the first): the share of its CPUs it kept busy
    # (user + system), and the share of its processes' time spent waiting for I/O.
    cpu_busy_ratio: float | None = None
    iowait_ratio: float | None = None


def render_node(emit: Emit, jobs: tuple[JobUsage, ...] | None) -> None:
    for j in jobs or ():
        key = (j.scheduler, j.job_id)
        for mode, seconds in zip(MODES, j.cpu_seconds):
            emit("gpuwatch_job_cpu_seconds_total", key + (mode,), seconds)
        emit("gpuwatch_job_cpus", key, j.cpus)
        emit("gpuwatch_job_io_bytes_total", key + ("read",), j.read_bytes)
        emit("gpuwatch_job_io_bytes_total", key + ("write",), j.write_bytes)


JOB = ("scheduler", "job_id")

GROUP: Group[None, None] = Group(
    name="jobs",
    help="per job on the node: CPU time (user/system/iowait), I/O bytes and CPUs of its cgroup's processes (psutil)",
    host="jobs",
    render_node=render_node,
    specs=(
        Spec("gpuwatch_job_cpu_seconds_total", "counter", JOB + ("mode",),
             "CPU seconds of the job's processes (every process of its cgroup, GPU or not) by mode: user, system, "
             "iowait (blocked on block I/O; kernel delay accounting, 0 unless kernel.task_delayacct=1)."),
        Spec("gpuwatch_job_cpus", "gauge", JOB,
             "CPUs the job may use: its cgroup's cpuset, or its CPU quota (cpu.max) where smaller."),
        Spec("gpuwatch_job_io_bytes_total", "counter", JOB + ("direction",),
             "Bytes the job's processes read from or wrote to storage (/proc/PID/io read_bytes, write_bytes); "
             "absent where gpuwatch may not read them (another user's processes need CAP_SYS_PTRACE)."),
    ),
)
