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

import fnmatch
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatch.attribution import POD_UID
from gpuwatch.hostside.hostile import SPACE, Report, finite, lines, natural, read_regular, shown, words

NVIDIA_MAJOR = 195  # /dev/nvidiaN: char 195:N; 255 is /dev/nvidiactl, 254 /dev/nvidia-modeset
_GPU_MINORS = range(0, 254)

_SLURM_V2 = ("system.slice/*slurmstepd.scope/job_*",)
_SLURM_V1 = ("*/slurm*/uid_*/job_*",)
_PODS = ("kubepods.slice/kubepods-pod*.slice", "kubepods.slice/kubepods-*.slice/kubepods-*-pod*.slice",
         "kubepods/pod*", "kubepods/*/pod*")
# Whole directory names (fullmatch): "job_evil_job_42" or "job_42\n" is no job 42 (search with $ took both)
_POD_UID = re.compile(rf"(?:kubepods-(?:[a-z]+-)?)?pod({POD_UID})(?:\.slice)?", re.ASCII)
_JOB = re.compile(r"job_([0-9]{1,20})", re.ASCII)  # a Slurm job id is a 32-bit number; more is not a job
_UID = re.compile(r"uid_([0-9]+)", re.ASCII)
PathText = str | os.PathLike[str]  # a directory as text (what scan gives) or a Path (tests, callers)


@dataclass
class JobCgroup:
    """One job's cgroup directories (one on v2, one per controller on v1)."""

    scheduler: str  # slurm | kubernetes
    job_id: str  # Slurm job id, or the pod UID
    uid: int | None = None  # from Slurm's v1 uid_<uid> level
    # controller ("" on v2) -> directory. Text, joined with os.path: a Path interns each of its parts
    # (pathlib's parse_parts calls sys.intern), and names that come and go (job_<id>, step_0, cpu.stat) then
    # churned the interpreter's table of interned strings, which a resize every few minutes rebuilt at
    # 1 or 1.9 MB by turns: the soak's RSS switched between two levels 2 MB apart (gdb caught the resize).
    dirs: dict[str, PathText] = field(default_factory=dict)

    def devices(self, report: Report | None = None) -> tuple[int, ...] | None:
        """GPU minor numbers cgroup v1's devices controller lets the job open; None where it cannot
        tell (no devices controller, unreadable, or every device allowed). Malformed lines are
        skipped, the valid ones kept, and ``report(file, reason)`` told once for the file."""
        directory = self.dirs.get("devices")
        if directory is None:
            return None
        path = os.path.join(directory, "devices.list")
        text = _read(path)
        if text is None:
            return None
        bad: list[str] = []
        minors = parse_devices_list(text, bad)
        if bad and report is not None:
            report(str(path), f"{len(bad)} malformed line(s) skipped, the first: {shown(bad[0])}")
        return minors

    def pids(self, report: Report | None = None) -> tuple[set[int], int]:
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
                    path = os.path.join(base, "cgroup.procs")
                    text = _read(path) or ""
                    bad = 0
                    for line in words(text):
                        pid = natural(line, MAX_PID)
                        if pid is None:
                            bad += 1
                        elif pid == 0:
                            hidden += 1
                        else:
                            found.add(pid)
                    if bad and report is not None:
                        report(str(path), f"{bad} entries that are no PID skipped")
        return found, hidden

    def accounting(self, report: Report | None = None,
                   ) -> tuple[tuple[float, float] | None, tuple[int, int] | None]:
        """The cgroup's own totals, which count every process that ever ran in it (exited ones too,
        whatever PID namespace): (user, system) CPU seconds, (read, write) bytes of block I/O; None
        where not readable (cgroup v2 ``cpu.stat``/``io.stat``; v1 ``cpuacct.stat``). A value that is
        no number (NaN, negative, garbage) is left out and ``report(file, reason)`` told."""
        cpu = io = None
        if "" in self.dirs:
            stat = _keyed_file(os.path.join(self.dirs[""], "cpu.stat"), report)
            if "user_usec" in stat and "system_usec" in stat:
                cpu = (stat["user_usec"] / 1e6, stat["system_usec"] / 1e6)
            path = os.path.join(self.dirs[""], "io.stat")
            text = _read(path)
            if text is not None:
                read = write = 0
                bad: list[str] = []
                for line in lines(text):
                    fields = _keyed(" ".join(words(line)[1:]), "=", bad)
                    read += int(fields.get("rbytes", 0))
                    write += int(fields.get("wbytes", 0))
                io = (min(read, MAX_BYTES), min(write, MAX_BYTES))
                _tell(report, path, bad)
        for controller in ("cpu,cpuacct", "cpuacct"):
            directory = self.dirs.get(controller)
            if cpu is None and directory is not None:
                stat = _keyed_file(os.path.join(directory, "cpuacct.stat"), report)
                if "user" in stat and "system" in stat:  # USER_HZ ticks
                    cpu = (stat["user"] / _TICK, stat["system"] / _TICK)
        return cpu, io

    def _one_tree(self) -> list[PathText]:
        if "" in self.dirs:
            return [self.dirs[""]]
        for controller in ("freezer", "pids", "cpuacct", "cpu,cpuacct", "cpuset", "memory", "devices"):
            if controller in self.dirs:
                return [self.dirs[controller]]
        return list(self.dirs.values())[:1]

    def cpus(self, report: Report | None = None) -> float | None:
        """CPUs the job may use: its cpuset's size, or its CPU quota where that is smaller. A CPU list
        part or a quota that does not parse is left out and ``report(file, reason)`` told."""
        counts = []
        for controller, name in (("", "cpuset.cpus.effective"), ("", "cpuset.cpus"), ("cpuset", "cpuset.cpus"),
                                 ("cpuset", "cpuset.effective_cpus")):
            directory = self.dirs.get(controller)
            text = _read(os.path.join(directory, name)) if directory is not None else None
            if text and directory is not None:
                bad: list[str] = []
                count = count_cpu_list(text, bad)
                _tell(report, os.path.join(directory, name), bad)
                if count > 0:
                    counts.append(float(count))
                break
        quota = None
        if "" in self.dirs:
            text = _read(os.path.join(self.dirs[""], "cpu.max"))
            if text:
                parts = words(text)
                if len(parts) == 2 and parts[0] != "max":
                    quota = _ratio(parts[0], parts[1])
                if len(parts) != 2 or finite(parts[1], float(MAX_BYTES)) is None or (parts[0] != "max"
                                                                                      and quota is None):
                    _tell(report, os.path.join(self.dirs[""], "cpu.max"), [text])
        for controller in ("cpu,cpuacct", "cpu"):
            directory = self.dirs.get(controller)
            if directory is not None and quota is None:
                q = _read(os.path.join(directory, "cpu.cfs_quota_us"))
                p = _read(os.path.join(directory, "cpu.cfs_period_us"))
                if q and p and not q.startswith("-"):
                    quota = _ratio(q, p)
                    if quota is None:  # as cpu.max above: told, not skipped in silence
                        _tell(report, os.path.join(directory, "cpu.cfs_quota_us"), [f"{q} / {p}"])
                elif q and q != "-1" and finite(q, float(MAX_BYTES)) is None:  # -1: no quota
                    _tell(report, os.path.join(directory, "cpu.cfs_quota_us"), [q])
                break  # "cpu" is "cpu,cpuacct" by another name where both are (systemd's symlink): read once
        if quota is not None and quota > 0:
            counts.append(quota)
        return min(counts) if counts else None


_MAX_DIRS = 10_000  # directories walked per job at most
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT: a larger number in cgroup.procs is not a PID
MAX_CPUS = 1 << 16  # CPUs a kernel CPU list can name (NR_CPUS is 8192 at most today)
MAX_MINOR = (1 << 20) - 1  # the kernel's MINORBITS
MAX_MAJOR = (1 << 12) - 1
MAX_BYTES = 2**64 - 1  # block I/O bytes, CPU microseconds: the kernel's u64 counters
MAX_ID = 2**64 - 1  # a Slurm job id or a uid in a directory name
_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _read(path: PathText) -> str | None:
    """A pseudo-file's text (bytes that are not UTF-8 replaced), None when it cannot be read. Only
    regular files: a FIFO or a socket where a file should be would block the read."""
    try:
        return read_regular(path, 1 << 20).decode(errors="replace").strip(SPACE)  # "0\x1f" stays bad
    except OSError:  # NotRegular too
        return None


def _keyed(text: str | None, sep: str = " ", bad: list[str] | None = None) -> dict[str, float]:
    """"key value" lines (or "k=v" words) -> numbers; what does not parse is left out (and added to ``bad``)."""
    found: dict[str, float] = {}
    if not text:
        return found
    items = words(text) if sep == "=" else lines(text)
    for item in items:
        key, _, value = item.strip(SPACE).partition(sep)
        number = finite(value.strip(SPACE), float(MAX_BYTES))  # NaN, infinities, negatives, absurd: left out
        if number is not None:
            found[key.strip(SPACE)] = number
        elif bad is not None and item.strip(SPACE):
            bad.append(item)
    return found


def _keyed_file(path: PathText, report: Report | None) -> dict[str, float]:
    bad: list[str] = []
    found = _keyed(_read(path), bad=bad)
    _tell(report, path, bad)
    return found


def _tell(report: Report | None, path: PathText, bad: list[str]) -> None:
    if bad and report is not None:
        report(os.fspath(path), f"{len(bad)} malformed part(s) skipped, the first: {shown(bad[0])}")


def _ratio(a: str, b: str) -> float | None:
    quota, period = finite(a.strip(), float(MAX_BYTES)), finite(b.strip(), float(MAX_BYTES))
    if quota is None or period is None or period <= 0:
        return None
    ratio = quota / period
    return ratio if math.isfinite(ratio) else None


def count_cpu_list(text: str, bad: list[str] | None = None) -> int:
    """CPUs in a kernel CPU list, e.g. "0-15,32-47" -> 32 (malformed parts count nothing; CPU numbers
    beyond what a kernel can have are malformed, and so is a range that runs backwards; at most MAX_CPUS)."""
    total = 0
    for part in text.strip(SPACE).split(","):
        lo_text, sep, hi_text = part.strip(SPACE).partition("-")
        lo, hi = natural(lo_text, MAX_CPUS), natural(hi_text, MAX_CPUS) if sep else None
        if lo is None or (sep and hi is None) or (hi is not None and hi < lo):
            if bad is not None and part.strip(SPACE):
                bad.append(part)
            continue
        if hi is None:
            total += 1
        else:
            total += hi - lo + 1
    return min(total, MAX_CPUS)


_ACCESS = frozenset("rwm")


def parse_devices_list(text: str, bad: list[str] | None = None) -> tuple[int, ...] | None:
    """The GPU minor numbers a cgroup v1 ``devices.list`` allows (``c 195:N rwm``); None when it
    allows every device (``a *:* rwm``, the unconstrained default) or every NVIDIA minor (``c 195:*``).

    A line is ``<a|b|c> <major|*>:<minor|*> <access: r, w, m>``; one that is not (garbage, binary,
    a number beyond the kernel's major/minor range) is skipped and appended to ``bad``; every valid
    line around it still counts."""
    minors: set[int] = set()
    for line in lines(text):
        parts = words(line)
        if not parts:
            continue
        entry = _device_entry(parts)
        if entry is None:
            if bad is not None:
                bad.append(line)
            continue
        kind, major, minor = entry
        if kind == "a":
            return None
        if kind != "c" or major not in (NVIDIA_MAJOR, "*"):
            continue
        if minor == "*":
            return None
        if isinstance(minor, int) and minor in _GPU_MINORS:
            minors.add(minor)
    return tuple(sorted(minors))


def _device_entry(parts: list[str]) -> tuple[str, int | str, int | str] | None:
    """(kind, major, minor) of one devices.list line's words ("*" stays "*"); None when malformed."""
    if len(parts) != 3 or parts[0] not in ("a", "b", "c") or not parts[2] or not set(parts[2]) <= _ACCESS:
        return None
    major_text, sep, minor_text = parts[1].partition(":")
    if not sep:
        return None
    major = "*" if major_text == "*" else natural(major_text, MAX_MAJOR)
    minor = "*" if minor_text == "*" else natural(minor_text, MAX_MINOR)
    if major is None or minor is None:
        return None
    return parts[0], major, minor


@dataclass
class Scan:
    """What one scan found: the jobs, and whether a Slurm hierarchy exists at all."""

    jobs: list[JobCgroup]
    slurm_hierarchy: bool


_MATCHERS: dict[str, Callable[[str], re.Match[str] | None]] = {}  # a wildcard segment -> its fnmatch, compiled


def glob_text(root: PathText, pattern: str, listings: dict[str, dict[str, os.DirEntry[str]]] | None = None,
              ) -> list[str]:
    """``list(root.glob(pattern))`` as text, for a pattern of plain and wildcard segments (no ``**``): the same
    paths in the same order (tests/test_hostside.py holds the two equal), without a Path object and a stat per entry
    looked at (pathlib's glob: 0.39 ms a scan of a cgroup v1 tree, most of a host read; this one 0.16).
    ``listings``: the directories listed so far, shared by the globs of one scan (each lists the controllers
    again). A directory that goes away while it is listed (a job that ends) has nothing in it, where pathlib
    raises."""
    listings = {} if listings is None else listings
    paths = [str(root)]
    parts = pattern.split("/")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        found: list[str] = []
        if not any(c in part for c in "*?["):
            test = os.path.exists if last else os.path.isdir
            for parent in paths:
                listed = listings.get(parent)
                if listed is not None and part not in listed:
                    continue  # not in the parent's listing of this scan: no stat for it
                path = os.path.join(parent, part)
                if test(path):
                    found.append(path)
        else:
            match = _MATCHERS.get(part)
            if match is None:
                match = _MATCHERS[part] = re.compile(fnmatch.translate(part)).fullmatch
            for parent in paths:
                entries = listings.get(parent)
                if entries is None:
                    try:
                        with os.scandir(parent) as listing:
                            entries = {entry.name: entry for entry in listing}
                    except OSError:  # gone, or not readable (a name in it may still be reached: not kept)
                        continue
                    listings[parent] = entries
                for entry in entries.values():
                    if not match(entry.name):
                        continue
                    if not last:
                        try:
                            if not entry.is_dir():
                                continue
                        except OSError:
                            continue
                    found.append(os.path.join(parent, entry.name))
        paths = found
    return paths


def scan(root: PathText) -> Scan:
    """The jobs under ``root``; their directories as text (JobCgroup.dirs: no Path per scan)."""
    jobs: dict[tuple[str, str], JobCgroup] = {}
    listings: dict[str, dict[str, os.DirEntry[str]]] = {}  # each directory listed once a scan
    top = os.fspath(root)

    def controller_of(path: str) -> str:  # the first part below root: v1's controller directory
        return os.path.relpath(path, top).split(os.sep, 1)[0]

    slurm = False
    for pattern in _SLURM_V2:
        for path in glob_text(top, pattern, listings):
            match = _JOB.fullmatch(os.path.basename(path))
            if match and os.path.isdir(path):
                jobs.setdefault(("slurm", match.group(1)), JobCgroup("slurm", match.group(1))).dirs[""] = path
    slurm = slurm or any(glob_text(top, "system.slice/*slurmstepd.scope", listings))
    for pattern in _SLURM_V1:
        for path in glob_text(top, pattern, listings):
            match, uid = _JOB.fullmatch(os.path.basename(path)), _UID.fullmatch(os.path.basename(os.path.dirname(path)))
            if match and os.path.isdir(path):
                job = jobs.setdefault(("slurm", match.group(1)), JobCgroup("slurm", match.group(1)))
                job.dirs[controller_of(path)] = path
                if uid:
                    job.uid = natural(uid.group(1), MAX_ID)
    slurm = (slurm or any(glob_text(top, "*/slurm*/uid_*", listings))
             or any(glob_text(top, "devices/slurm*", listings)))
    for prefix in ("", "*/"):
        for pattern in _PODS:
            for path in glob_text(top, prefix + pattern, listings):
                pod = _POD_UID.fullmatch(os.path.basename(path))
                if pod and os.path.isdir(path):
                    pod_uid = pod.group(1).replace("_", "-")
                    controller = controller_of(path) if prefix else ""
                    jobs.setdefault(("kubernetes", pod_uid), JobCgroup("kubernetes", pod_uid)).dirs[controller] = path
    ordered = sorted(jobs.values(), key=lambda j: (j.scheduler, natural(j.job_id, MAX_ID) or 0, j.job_id))
    return Scan(ordered, slurm)
