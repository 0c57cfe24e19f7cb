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

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.attribution import POD_UID

NVIDIA_MAJOR = 195  # /dev/nvidiaN: char 195:N; 255 is /dev/nvidiactl, 254 /dev/nvidia-modeset
_GPU_MINORS = range(0, 254)

_SLURM_V2 = ("system.slice/*slurmstepd.scope/job_*",)
_SLURM_V1 = ("*/slurm*/uid_*/job_*",)
_PODS = ("kubepods.slice/kubepods-pod*.slice", "kubepods.slice/kubepods-*.slice/kubepods-*-pod*.slice",
         "kubepods/pod*", "kubepods/*/pod*")
_POD_UID = re.compile(rf"pod({POD_UID})(?:\.slice)?$")
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
        text = _read(directory / "devices.list")
        return None if text is None else parse_devices_list(text)

    def pids(self) -> tuple[set[int], int]:
        """Every process of the job: cgroup.procs of its directory and all below (the steps, the tasks),
        and how many entries read as 0 — processes outside gpuwatch's PID namespace (a container
        without the host's PID namespace), which the kernel cannot name."""
        found: set[int] = set()
        hidden = 0
        for directory in self._one_tree():
            for walked, (base, _dirs, files) in enumerate(os.walk(directory)):
                if walked > _MAX_DIRS:  # a runaway tree: what was read is what there is
                    break
                if "cgroup.procs" in files:
                    text = _read(Path(base, "cgroup.procs")) or ""
                    for line in text.split():
                        if line.isascii() and line.isdigit():
                            if int(line) == 0:
                                hidden += 1
                            else:
                                found.add(int(line))
        return found, hidden

    def accounting(self) -> tuple[tuple[float, float] | None, tuple[int, int] | None]:
        """The cgroup's own totals, which count every process that ever ran in it (exited ones too,
        whatever PID namespace): (user, system) CPU seconds, (read, write) bytes of block I/O; None
        where not readable (cgroup v2 ``cpu.stat``/``io.stat``; v1 ``cpuacct.stat``)."""
        cpu = io = None
        if "" in self.dirs:
            stat = _keyed(_read(self.dirs[""] / "cpu.stat"))
            if "user_usec" in stat and "system_usec" in stat:
                cpu = (stat["user_usec"] / 1e6, stat["system_usec"] / 1e6)
            text = _read(self.dirs[""] / "io.stat")
            if text is not None:
                read = write = 0
                for line in text.splitlines():
                    fields = _keyed(" ".join(line.split()[1:]), "=")
                    read += int(fields.get("rbytes", 0))
                    write += int(fields.get("wbytes", 0))
                io = (read, write)
        for controller in ("cpu,cpuacct", "cpuacct"):
            directory = self.dirs.get(controller)
            if cpu is None and directory is not None:
                stat = _keyed(_read(directory / "cpuacct.stat"))
                if "user" in stat and "system" in stat:  # USER_HZ ticks
                    cpu = (stat["user"] / _TICK, stat["system"] / _TICK)
        return cpu, io

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
                if count_cpu_list(text) > 0:
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
        if quota is not None and quota > 0:
            counts.append(quota)
        return min(counts) if counts else None


_MAX_DIRS = 10_000  # directories walked per job at most
_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _read(path: Path) -> str | None:
    """A pseudo-file's text (bytes that are not UTF-8 replaced), None when it cannot be read. Only
    regular files: a FIFO or a socket where a file should be would block the read."""
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            return f.read(1 << 20).decode(errors="replace").strip()
    except OSError:
        return None


def _keyed(text: str | None, sep: str = " ") -> dict[str, float]:
    """"key value" lines (or "k=v" words) -> numbers; what does not parse is left out."""
    found: dict[str, float] = {}
    if not text:
        return found
    items = text.split() if sep == "=" else text.splitlines()
    for item in items:
        key, _, value = item.strip().partition(sep)
        try:
            number = float(value.strip())
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            found[key.strip()] = number
    return found


def _ratio(a: str, b: str) -> float | None:
    try:
        quota, period = float(a), float(b)
    except ValueError:
        return None
    ratio = quota / period if period > 0 else None
    return ratio if ratio is not None and math.isfinite(ratio) else None


def count_cpu_list(text: str) -> int:
    """CPUs in a kernel CPU list, e.g. "0-15,32-47" -> 32 (malformed parts count nothing)."""
    total = 0
    for part in text.strip().split(","):
        lo, sep, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            continue
        if not sep:
            total += 1
        elif int(hi) >= int(lo):
            total += int(hi) - int(lo) + 1
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
        if minor.isascii() and minor.isdigit() and int(minor) in _GPU_MINORS:
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
