"""The jobs group's reader: per job, the CPU time, I/O and CPUs of the processes in its cgroup.

Per job (a Slurm job's or a pod's cgroup, gpuwatch/hostside/cgroups.py):

- user and system CPU seconds and block-I/O bytes from the cgroup's own accounting where it can be
  read (v2 ``cpu.stat``, ``io.stat``; v1 ``cpuacct.stat``): they count every process that ever ran
  in it, those that started and exited between two reads included, whatever PID namespace;
- iowait, and the rest where the cgroup does not account it, over every process of its ``cgroup.procs``
  (data loaders included): ``/proc/PID/stat``'s times and block-I/O delay (the kernel's delay
  accounting), ``/proc/PID/io``. A process that exits mid-read is skipped; the last seen times of one
  that exited stay in the job's totals, so the counters only grow while the job lives. One whose I/O
  gpuwatch may not read (EACCES: another user's, without CAP_SYS_PTRACE) makes the job's per-process I/O
  absent unless the cgroup accounts it. Both files are read here as the kernel writes them, not by psutil
  (whose float() and int() take ``1_000`` and other scripts' digits, and whose ValueError on ``nan`` in
  ``io`` cost the process its CPU times too): a stat whose times the kernel would not write is the process
  skipped, an io with such a read_bytes or write_bytes is that process's I/O unreadable, one warning
  naming the file each, the rest kept.

A job whose processes gpuwatch cannot see at all (cgroup.procs lists them as 0 from another PID
namespace, or ``/proc`` is mounted with hidepid) and whose cgroup has no readable accounting has no
reading: absent, not 0, counted as ``processes_not_visible`` and logged once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from gpuwatch.groups.jobs import JobUsage
from gpuwatch.hostside.cgroups import JobCgroup, Scan
from gpuwatch.hostside.hostile import SPACE, Malformed, NotRegular, natural, read_regular, shown, words
from gpuwatch.logs import get_logger

_Cpu = tuple[float, float, float]  # user, system, iowait seconds
_Io = tuple[int, int] | None  # read, write bytes; None: not readable
_Key = tuple[int, float]  # (pid, seconds after boot it started): a PID reused by another process differs
_RECENT = 4096  # exited processes remembered per job (one that only looked exited comes back uncounted)


@dataclass
class _Job:
    seen: dict[_Key, tuple[_Cpu, _Io]] = field(default_factory=dict)  # the last read's processes
    retired: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # CPU of processes that exited
    retired_io: list[int] = field(default_factory=lambda: [0, 0])
    recent: dict[_Key, tuple[_Cpu, _Io]] = field(default_factory=dict)  # retired ones, by key
    last: tuple[float, float | None, float | None, float | None] | None = None  # (monotonic, user, system, iowait)


class JobsReader:
    def __init__(self, proc_root: str, monotonic: Callable[[], float], node_cpus: float | None = None,
                 errors: list[tuple[str, str]] | None = None) -> None:
        psutil.PROCFS_PATH = proc_root  # psutil's one setting for where /proc is (a host's, in a container)
        self._monotonic = monotonic
        self._node_cpus = node_cpus
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._errors = errors if errors is not None else []
        self._invisible_logged = False
        self._log = get_logger(component="jobs")
        self._malformed = Malformed("jobs", self._errors)

    def read(self, found: Scan) -> tuple[JobUsage, ...]:
        now = self._monotonic()
        self._malformed.flush()
        usages = []
        live = set()
        for cgroup in found.jobs:
            key = (cgroup.scheduler, cgroup.job_id)
            live.add(key)
            usage = self._one(cgroup, self._jobs.setdefault(key, _Job()), now)
            if usage is not None:
                usages.append(usage)
        for ended in self._jobs.keys() - live:
            del self._jobs[ended]
        return tuple(usages)

    def _one(self, cgroup: JobCgroup, job: _Job, now: float) -> JobUsage | None:
        pids, hidden = cgroup.pids(self._malformed)
        accounted_cpu, accounted_io = cgroup.accounting(self._malformed)
        current: dict[_Key, tuple[_Cpu, _Io]] = {}
        io_readable = True
        for pid in sorted(pids):
            read_one = _process(pid, self._malformed)
            if read_one is None:
                continue
            start, times, io = read_one
            process = (pid, round(start, 2))  # a PID used again is another process: the start tells them apart
            previous = job.seen.get(process) or job.recent.pop(process, None)
            if previous is not None and process not in job.seen:  # it only looked exited: take it back
                self._unretire(job, previous)
            if io is None and previous is not None and previous[1] is not None:
                io = previous[1]  # /proc/PID/io became unreadable (the process dropped dumpable): keep the last
            current[process] = (times, io)
            io_readable = io_readable and io is not None
        if (pids or hidden) and not current and accounted_cpu is None:
            self._errors.append(("jobs", "processes_not_visible"))
            if not self._invisible_logged:
                self._invisible_logged = True
                self._log.warning("processes_not_visible", scheduler=cgroup.scheduler, job_id=cgroup.job_id,
                                  hidden=hidden, hint="gpuwatch cannot see the job's processes: in a container, run "
                                  "it in the host's PID namespace (hostPID); a /proc mounted with hidepid hides "
                                  "other users' processes")
            return None
        for exited in job.seen.keys() - current.keys():  # exited since the last read: keep their time
            self._retire(job, exited, job.seen[exited])
        job.seen = current
        psutil_cpu = [job.retired[i] + sum(times[i] for times, _ in current.values()) for i in range(3)]
        user, system = accounted_cpu if accounted_cpu is not None else (psutil_cpu[0], psutil_cpu[1])
        iowait: float | None = psutil_cpu[2] if (current or job.retired[2]) else None
        cpus = cgroup.cpus(self._malformed) or self._node_cpus
        busy = wait_share = None
        if job.last is not None and now > job.last[0]:
            elapsed = now - job.last[0]
            d_user, d_system = max(0.0, user - (job.last[1] or 0.0)), max(0.0, system - (job.last[2] or 0.0))
            busy = (d_user + d_system) / elapsed / cpus if cpus else None
            if iowait is not None and job.last[3] is not None:
                d_wait = max(0.0, iowait - job.last[3])
                wanted = d_user + d_system + d_wait
                wait_share = d_wait / wanted if wanted > 0 else 0.0
        job.last = (now, user, system, iowait)
        read = write = None
        if accounted_io is not None:
            read, write = accounted_io
        elif io_readable and current:
            read = job.retired_io[0] + sum(io[0] for _, io in current.values() if io is not None)
            write = job.retired_io[1] + sum(io[1] for _, io in current.values() if io is not None)
        return JobUsage(cgroup.scheduler, cgroup.job_id, (user, system, iowait), read, write, cpus,
                        len(current) or len(pids) + hidden, busy, wait_share)

    @staticmethod
    def _retire(job: _Job, key: _Key, totals: tuple[_Cpu, _Io]) -> None:
        times, io = totals
        for i in range(3):
            job.retired[i] += times[i]
        if io is not None:
            job.retired_io[0] += io[0]
            job.retired_io[1] += io[1]
        job.recent[key] = totals
        if len(job.recent) > _RECENT:
            del job.recent[next(iter(job.recent))]

    @staticmethod
    def _unretire(job: _Job, totals: tuple[_Cpu, _Io]) -> None:
        times, io = totals
        for i in range(3):
            job.retired[i] -= times[i]
        if io is not None:
            job.retired_io[0] -= io[0]
            job.retired_io[1] -= io[1]


_MAX_TICKS = 2**64 - 1  # the kernel's u64 tick counters


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # USER_HZ: /proc's times are in these
_MAX_STAT_FILE = 4096  # bytes: /proc/PID/stat is one line of 52 numbers and the command's name
# /proc/PID/stat's fields after "(comm)", from field 3 (state) on: utime 14, stime 15, starttime 22,
# delayacct_blkio_ticks 42 (absent on kernels without delay accounting: 0)
_UTIME, _STIME, _START, _BLKIO = 14 - 3, 15 - 3, 22 - 3, 42 - 3


def _process(pid: int, report: Callable[[str, str], None] | None = None) -> tuple[float, _Cpu, _Io] | None:
    """(start in seconds after boot, CPU seconds, I/O bytes) of one process; None if it is gone or cannot be
    read at all. /proc/PID/stat is read here, as the kernel writes it (psutil's float() took ``1_000`` and
    other scripts' digits): a stat that does not parse (truncated, a number the kernel never writes) is the
    process skipped and ``report`` told; the job's other processes are read. A bad /proc/PID/io costs only
    the I/O (see _io)."""
    path = f"{psutil.PROCFS_PATH}/{pid}/stat"
    try:
        raw = read_regular(path, _MAX_STAT_FILE)
    except OSError:  # gone (ENOENT, ESRCH), not ours to read, not a regular file
        return None
    fields = words(raw.decode("ascii", errors="replace").rpartition(")")[2])  # the name may hold ") "
    def ticks(i: int, absent: int | None = None) -> int | None:
        return natural(fields[i], _MAX_TICKS) if i < len(fields) else absent

    utime, stime, start, blkio = ticks(_UTIME), ticks(_STIME), ticks(_START), ticks(_BLKIO, 0)
    if utime is None or stime is None or start is None or blkio is None:
        if report is not None:
            report(path, "CPU times that are not whole numbers of ticks as the kernel writes them (or a truncated "
                         "line)")
        return None
    try:
        io = _io(pid, report)
    except psutil.NoSuchProcess:  # gone between its stat and its io
        return None
    return start / _TICKS, (utime / _TICKS, stime / _TICKS, blkio / _TICKS), io


_MAX_IO_FILE = 4096  # bytes: /proc/PID/io is seven short lines
_IO_FIELDS = ("read_bytes", "write_bytes")


def _io(pid: int, report: Callable[[str, str], None] | None) -> _Io:
    """/proc/PID/io's read_bytes and write_bytes; None when it cannot be read (EACCES: another user's process
    or one that dropped dumpable; empty, or absent: a kernel without the accounting) or when it is malformed
    (then ``report`` is told, naming the file). Raises psutil.NoSuchProcess when the process is gone."""
    path = f"{psutil.PROCFS_PATH}/{pid}/io"
    raw: bytes | None
    try:
        raw = read_regular(path, _MAX_IO_FILE + 1)
    except NotRegular:
        raw = None  # not read: a FIFO would block the reader
    except (FileNotFoundError, ProcessLookupError):
        if not os.path.exists(f"{psutil.PROCFS_PATH}/{pid}/stat"):
            raise psutil.NoSuchProcess(pid) from None
        return None
    except OSError:
        return None
    if raw is not None and not raw.strip(SPACE.encode()):
        return None  # empty: psutil's word for a kernel without the accounting (and fakehost's unreadable file)
    io, why = _parse_io(raw)
    if io is None and report is not None:
        report(path, why)
    return io


def _parse_io(raw: bytes | None) -> tuple[_Io, str]:
    """("read_bytes", "write_bytes") of /proc/PID/io's "name: value" lines (the others are not looked at), or
    None and why not: each once, in ASCII digits as the kernel writes them (not psutil's int(): "1_000", "٣"),
    0..2**64-1."""
    if raw is None:
        return None, "not a regular file"
    if len(raw) > _MAX_IO_FILE:
        return None, f"longer than {_MAX_IO_FILE} bytes"
    found: dict[str, int] = {}
    for line in raw.decode("ascii", errors="replace").split("\n"):
        name, sep, value = line.strip(SPACE).partition(": ")
        if not sep or name not in _IO_FIELDS:
            continue
        number = natural(value.strip(SPACE), 2**64 - 1)
        if number is None:
            return None, f"{name} is not a number as the kernel writes it: {shown(value)}"
        if name in found:
            return None, f"{name} twice"
        found[name] = number
    missing = [name for name in _IO_FIELDS if name not in found]
    if missing:
        return None, "no " + " or ".join(missing)
    return (found["read_bytes"], found["write_bytes"]), ""
