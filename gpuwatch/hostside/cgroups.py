"""The jobs of this node as its cgroup tree shows them: Slurm jobs and Kubernetes pods.

One scan per host read, shared by the slurm and jobs groups. Layouts (``root`` is
``--attribution.cgroup-root``, default /sys/fs/cgroup; docs/slurm.md, docs/kubernetes.md):

- Slurm, cgroup v2: ``system.slice/slurmstepd.scope/job_<id>`` (``<node>_slurmstepd.scope`` with
  several slurmd per host);
- Slurm, cgroup v1: ``<controller>/slurm/uid_<uid>/job_<id>`` (``slurm_<node>`` likewise), one
  directory per controller (devices, cpuset, cpu,cpuacct, freezer, memory, ...);
- Kubernetes pods: ``kubepods.slice/[kubepods-<qos>.slice/]kubepods-[<qos>-]pod<uid>.slice``
  (systemd driver) or ``kubepods/[<qos>/]pod<uid>`` (cgroupfs), under a controller on v1.

Every read is of small pseudo-files; a job that ends mid-scan is simply missing or partial.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

NVIDIA_MAJOR = 195  # /dev/nvidiaN: char 195:N; 255 is /dev/nvidiactl, 254 /dev/nvidia-modeset
_GPU_MINORS = range(0, 254)

_SLURM_V2 = ("system.slice/*slurmstepd.scope/job_*",)
_SLURM_V1 = ("*/slurm*/uid_*/job_*",)
_PODS = ("kubepods.slice/kubepods-pod*.slice", "kubepods.slice/kubepods-*.slice/kubepods-*-pod*.slice",
         "kubepods/pod*", "kubepods/*/pod*")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_JOB = re.compile(r"job_(\d+)$")
_UID = re.compile(r"uid_(\d+)$")


@dataclass
class JobCgroup:
    """One job's cgroup directories (one on v2, one per controller on v1)."""

    scheduler: str  # slurm | kubernetes
    job_id: str  # Slurm job id, or the pod UID
    uid: int | None = None  # from Slurm's v1 uid_<uid> level
    dirs: dict[str, Path] = field(default_factory=dict)  # controller ("" on v2) -> directory

    def devices(self) -> tuple[int, ...] | None:
        """GPU minor numbers cgroup v1's devices controller lets the job open; None where it cannot
        tell (no devices controller, unreadable, or every device allowed)."""
        directory = self.dirs.get("devices")
        if directory is None:
            return None
        try:
            text = (directory / "devices.list").read_text(errors="replace")
        except OSError:
            return None
        return parse_devices_list(text)

    def pids(self) -> set[int]:
        """Every process of the job: cgroup.procs of its directory and all below (the steps, the tasks)."""
        found: set[int] = set()
        for directory in self._one_tree():
            for base, _dirs, files in os.walk(directory):
                if "cgroup.procs" in files:
                    try:
                        text = Path(base, "cgroup.procs").read_text()
                    except OSError:
                        continue
                    found.update(int(line) for line in text.split() if line.isdigit())
        return found

    def _one_tree(self) -> list[Path]:
        if "" in self.dirs:
            return [self.dirs[""]]
        for controller in ("freezer", "pids", "cpuacct", "cpu,cpuacct", "cpuset", "memory", "devices"):
            if controller in self.dirs:
                return [self.dirs[controller]]
        return list(self.dirs.values())[:1]

    def cpus(self) -> float | None:
        """CPUs the job may use: its cpuset's size, or its CPU quota where that is smaller."""
        counts = []
        for controller, name in (("", "cpuset.cpus.effective"), ("", "cpuset.cpus"), ("cpuset", "cpuset.cpus"),
                                 ("cpuset", "cpuset.effective_cpus")):
            directory = self.dirs.get(controller)
            text = _read(directory / name) if directory is not None else None
            if text:
                counts.append(float(count_cpu_list(text)))
                break
        quota = None
        if "" in self.dirs:
            text = _read(self.dirs[""] / "cpu.max")
            if text:
                parts = text.split()
                if len(parts) == 2 and parts[0] != "max":
                    quota = _ratio(parts[0], parts[1])
        for controller in ("cpu,cpuacct", "cpu"):
            directory = self.dirs.get(controller)
            if directory is not None and quota is None:
                q, p = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
                if q and p and not q.startswith("-"):
                    quota = _ratio(q, p)
        if quota is not None:
            counts.append(quota)
        return min(counts) if counts else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _ratio(a: str, b: str) -> float | None:
    try:
        quota, period = float(a), float(b)
    except ValueError:
        return None
    return quota / period if period > 0 else None


def count_cpu_list(text: str) -> int:
    """CPUs in a kernel CPU list, e.g. "0-15,32-47" -> 32 (malformed parts count nothing)."""
    total = 0
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        try:
            total += (int(hi) - int(lo) + 1) if sep else (1 if lo.strip() else 0)
        except ValueError:
            continue
    return total


def parse_devices_list(text: str) -> tuple[int, ...] | None:
    """The GPU minor numbers a cgroup v1 ``devices.list`` allows (``c 195:N rwm``); None when it
    allows every device (``a *:* rwm``, the unconstrained default) or every NVIDIA minor (``c 195:*``)."""
    minors = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        kind, numbers = parts[0], parts[1]
        if kind == "a":
            return None
        major, _, minor = numbers.partition(":")
        if kind != "c" or major not in (str(NVIDIA_MAJOR), "*"):
            continue
        if minor == "*":
            return None
        if minor.isdigit() and int(minor) in _GPU_MINORS:
            minors.add(int(minor))
    return tuple(sorted(minors))


@dataclass
class Scan:
    """What one scan found: the jobs, and whether a Slurm hierarchy exists at all."""

    jobs: list[JobCgroup]
    slurm_hierarchy: bool


def scan(root: Path) -> Scan:
    jobs: dict[tuple[str, str], JobCgroup] = {}
    slurm = False
    for pattern in _SLURM_V2:
        for path in root.glob(pattern):
            match = _JOB.search(path.name)
            if match and path.is_dir():
                jobs.setdefault(("slurm", match.group(1)), JobCgroup("slurm", match.group(1))).dirs[""] = path
    slurm = slurm or any(root.glob("system.slice/*slurmstepd.scope"))
    for pattern in _SLURM_V1:
        for path in root.glob(pattern):
            match, uid = _JOB.search(path.name), _UID.search(path.parent.name)
            if match and path.is_dir():
                job = jobs.setdefault(("slurm", match.group(1)), JobCgroup("slurm", match.group(1)))
                job.dirs[path.relative_to(root).parts[0]] = path
                if uid:
                    job.uid = int(uid.group(1))
    slurm = slurm or any(root.glob("*/slurm*/uid_*")) or any(root.glob("devices/slurm*"))
    for prefix in ("", "*/"):
        for pattern in _PODS:
            for path in root.glob(prefix + pattern):
                pod = _POD_UID.search(path.name)
                if pod and path.is_dir():
                    pod_uid = pod.group(1).replace("_", "-")
                    controller = path.relative_to(root).parts[0] if prefix else ""
                    jobs.setdefault(("kubernetes", pod_uid), JobCgroup("kubernetes", pod_uid)).dirs[controller] = path
    ordered = sorted(jobs.values(), key=lambda j: (j.scheduler, int(j.job_id) if j.job_id.isdigit() else 0, j.job_id))
    return Scan(ordered, slurm)
