"""Who is using the GPU: NVML's process list mapped to users and workloads through /proc.

Each PID's ``/proc/PID/cgroup`` says which workload it belongs to:

- Slurm: ``job_<id>`` in the cgroup path, v1 (``…:/slurm/uid_1000/job_42/step_0``) and v2
  (``0::/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0``);
- Kubernetes: the pod UID (and container id) in ``kubepods`` paths, cgroupfs and systemd drivers;
- systemd: the unit (``…/foo.service``, ``session-3.scope``);
- otherwise ``none``.

The user comes from the ``Uid:`` line of ``/proc/PID/status``. A PID from another PID namespace or
a process that exits mid-read is ``unknown``, quietly: no log line per process. Jobs that hold a
GPU without a process on it come from the slurm and kubernetes groups (gpuwatch/hostside/),
dcgm-exporter's HPC job-mapping directory among them.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
from collections.abc import Callable, Iterable

from gpuwatch.logs import get_logger
from gpuwatch.model import GpuIdentity, GpuProcess, ProcessInfo

_SLURM_JOB = re.compile(r"/job_([0-9]{1,20})(?=/|$)")
_MAX_READ = 1 << 16  # bytes of /proc/PID/cgroup or status read: a few lines
# a pod UID in a cgroup path: dashes (cgroupfs driver) or underscores (systemd driver)
POD_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_K8S_POD = re.compile(rf"pod({POD_UID})")  # after "kubepods" (searched from there: "kubepods.*?pod" was quadratic)
_CONTAINER = re.compile(r"(?:docker|cri-containerd|crio|containerd)-([0-9a-f]{64})\.scope|/([0-9a-f]{64})(?=/|$)")
_UNIT = re.compile(r"/([^/]+\.(?:service|scope))(?=/|$)")


@functools.lru_cache(maxsize=4096)
def user_name(uid: int) -> str:
    """The user name of ``uid``, else the number; kept (a passwd lookup may go to LDAP or SSSD, for
    every process and job at every slow poll otherwise)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # bytes that are not UTF-8: pwd hands them over as lone surrogates, which no /metrics body can encode
        # (every scrape failed); the number, as for a uid without a name
        get_logger(component="attribution").warning(
            "host_input_skipped", source="passwd", uid=uid, reason=f"user name {ascii(name)} is not UTF-8",
            hint="the uid is shown as a number; fix the name in the passwd database (or LDAP, SSSD)")
        return str(uid)
    return name


def _small(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(_MAX_READ).decode(errors="replace")


def parse_cgroup(text: str) -> tuple[str, str, str]:
    """(scheduler, job_id, container) from the content of /proc/PID/cgroup."""
    paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
    for path in paths:
        match = _SLURM_JOB.search(path)
        if match:
            return "slurm", match.group(1), ""
    for path in paths:
        start = path.find("kubepods")
        match = _K8S_POD.search(path, start + len("kubepods")) if start >= 0 else None
        if match:
            container = _CONTAINER.search(path)
            cid = (container.group(1) or container.group(2)) if container else ""
            return "kubernetes", match.group(1).replace("_", "-"), cid
    for path in paths:
        match = _UNIT.search(path)
        if match:
            return "systemd", match.group(1), ""
    return "none", "", ""


class Attributor:
    """Maps NVML process lists to ProcessInfo. Reads ``proc_root`` (injected in tests), nothing else."""

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc",
                 user_name: Callable[[int], str] = user_name) -> None:
        self._proc = os.fspath(proc_root)  # text, joined with os.path: a Path would intern each PID (pathlib)
        self._user_name = user_name

    def _one(self, process: GpuProcess) -> ProcessInfo:
        base = os.path.join(self._proc, str(process.pid))
        try:  # bytes that are not UTF-8 (a cgroup directory a user named so) are characters, not an exception
            cgroup, status = _small(os.path.join(base, "cgroup")), _small(os.path.join(base, "status"))
        except OSError:  # another PID namespace, exited, or hidden (ProtectProc=invisible)
            return ProcessInfo(process.pid, process.used_memory_bytes, "", "unknown", "",
                               gpu_instance=process.gpu_instance)
        scheduler, job_id, container = parse_cgroup(cgroup)
        user = ""
        for line in status.splitlines():
            if line.startswith("Uid:"):
                fields = line.split()
                # ASCII digits of a 32-bit uid only: "²" is isdigit() but no int(), 5000 digits raise
                if len(fields) > 1 and fields[1].isascii() and fields[1].isdigit() and len(fields[1]) <= 10:
                    user = self._user_name(int(fields[1]))
                break
        return ProcessInfo(process.pid, process.used_memory_bytes, user, scheduler, job_id, container,
                           process.gpu_instance)

    def attribute(self, identity: GpuIdentity, processes: Iterable[GpuProcess] | None) -> tuple[ProcessInfo, ...]:
        infos = [self._one(p) for p in processes or ()]
        return tuple(sorted(infos, key=lambda i: (i.scheduler, i.job_id, i.pid)))
