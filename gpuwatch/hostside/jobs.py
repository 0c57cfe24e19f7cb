"""The jobs group's reader: per job, the CPU time, I/O and CPUs of every process in its cgroup (psutil).

psutil reads ``/proc/PID/stat`` (user, system, and the block-I/O delay that Linux accounts as
the process's iowait) and ``/proc/PID/io``; a process that exits mid-read is skipped
(NoSuchProcess), one whose I/O gpuwatch may not read (AccessDenied: another user's, without
CAP_SYS_PTRACE) makes the job's I/O absent. A job's totals keep the last seen times of its
processes that exited, so the counters only grow while the job lives. The proc root is
``--attribution.proc-root`` (psutil.PROCFS_PATH), the cgroup root ``--attribution.cgroup-root``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from gpuwatch.groups.jobs import JobUsage
from gpuwatch.hostside.cgroups import Scan

_Cpu = tuple[float, float, float]  # user, system, iowait seconds
_Io = tuple[int, int] | None  # read, write bytes; None: not readable


@dataclass
class _Job:
    seen: dict[tuple[int, float], tuple[_Cpu, _Io]] = field(default_factory=dict)  # (pid, start) -> last totals
    retired: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # CPU of processes that exited
    retired_io: list[int] = field(default_factory=lambda: [0, 0])
    last: tuple[float, float, float, float] | None = None  # (monotonic, user, system, iowait) of the last read


class JobsReader:
    def __init__(self, proc_root: str, monotonic: Callable[[], float], node_cpus: float | None = None) -> None:
        psutil.PROCFS_PATH = proc_root  # psutil's one setting for where /proc is (a host's, in a container)
        self._monotonic = monotonic
        self._node_cpus = node_cpus
        self._jobs: dict[tuple[str, str], _Job] = {}

    def read(self, found: Scan) -> tuple[JobUsage, ...]:
        now = self._monotonic()
        usages = []
        live = set()
        for cgroup in found.jobs:
            key = (cgroup.scheduler, cgroup.job_id)
            live.add(key)
            job = self._jobs.setdefault(key, _Job())
            current: dict[tuple[int, float], tuple[_Cpu, _Io]] = {}
            io_readable = True
            for pid in sorted(cgroup.pids()):
                read_one = _process(pid)
                if read_one is None:
                    continue
                start, times, io = read_one
                current[(pid, start)] = (times, io)
                io_readable = io_readable and io is not None
            for exited in job.seen.keys() - current.keys():  # exited since the last read: keep their time
                old_times, old_io = job.seen[exited]
                for i in range(3):
                    job.retired[i] += old_times[i]
                if old_io is not None:
                    job.retired_io[0] += old_io[0]
                    job.retired_io[1] += old_io[1]
            job.seen = current
            cpu = [job.retired[i] + sum(times[i] for times, _ in current.values()) for i in range(3)]
            cpus = cgroup.cpus() or self._node_cpus
            busy = iowait = None
            if job.last is not None and now > job.last[0]:
                elapsed = now - job.last[0]
                d_user, d_system, d_wait = (max(0.0, cpu[i] - job.last[i + 1]) for i in range(3))
                busy = (d_user + d_system) / elapsed / cpus if cpus else None
                wanted = d_user + d_system + d_wait
                iowait = d_wait / wanted if wanted > 0 else 0.0
            job.last = (now, cpu[0], cpu[1], cpu[2])
            read: int | None = None
            write: int | None = None
            if io_readable:
                read = job.retired_io[0] + sum(io[0] for _, io in current.values() if io is not None)
                write = job.retired_io[1] + sum(io[1] for _, io in current.values() if io is not None)
            usages.append(JobUsage(cgroup.scheduler, cgroup.job_id, (cpu[0], cpu[1], cpu[2]), read, write, cpus,
                                   len(current), busy, iowait))
        for ended in self._jobs.keys() - live:
            del self._jobs[ended]
        return tuple(usages)


def _process(pid: int) -> tuple[float, _Cpu, _Io] | None:
    """(start time, CPU seconds, I/O bytes) of one process; None if it is gone or cannot be read at all."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            start = process.create_time()
            io: _Io
            try:
                counters = process.io_counters()
                io = (int(counters.read_bytes), int(counters.write_bytes))
            except (psutil.AccessDenied, AttributeError, NotImplementedError, RuntimeError):
                io = None  # RuntimeError: an empty /proc/PID/io (psutil's word for a kernel without the accounting)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError, OSError, RuntimeError):
        return None
    iowait = float(getattr(times, "iowait", 0.0) or 0.0)
    return start, (float(times.user), float(times.system), iowait), io
