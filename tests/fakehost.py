"""Fake host trees for the host groups: cgroup v1/v2 hierarchies with Slurm jobs and pods, and a
/proc that psutil reads (stat, io, and the boot time in /proc/stat).

Also used by bench/ (8 jobs x 8 GPUs). Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path

CLK_TCK = 100  # psutil divides /proc/PID/stat's times by os.sysconf("SC_CLK_TCK"), 100 on Linux


def proc_stat(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  1 2 3 4 5 6 7 0 0 0\nbtime 1700000000\n")


def fake_process(root: Path, pid: int, user: float = 0.0, system: float = 0.0, iowait: float = 0.0,
                 read_bytes: int | None = 0, write_bytes: int = 0, start_ticks: int = 5000,
                 cgroup: str = "", uid: int = 1000) -> None:
    """/proc/PID with CPU seconds (stat fields 14, 15 and 42: delayacct_blkio_ticks), I/O (None:
    /proc/PID/io unreadable, as for another user's process) and, for the attribution, cgroup and status."""
    base = root / str(pid)
    base.mkdir(parents=True, exist_ok=True)
    fields = [str(pid), "(python3)", "S", "1", str(pid), str(pid), "0", "-1", "4194560", "100", "0", "0", "0",
              str(round(user * CLK_TCK)), str(round(system * CLK_TCK)), "0", "0", "20", "0", "4", "0",
              str(start_ticks), "1000000", "100", "18446744073709551615", "1", "1", "0", "0", "0", "0", "0", "0",
              "0", "0", "0", "0", "17", "3", "0", "0", str(round(iowait * CLK_TCK)), "0", "0"]
    (base / "stat").write_text(" ".join(fields) + "\n")
    io = base / "io"
    if read_bytes is None:  # psutil's AccessDenied for another user's process; as root (CI), an empty file
        io.write_text("")
    else:
        io.write_text(f"rchar: 0\nwchar: 0\nsyscr: 0\nsyscw: 0\nread_bytes: {read_bytes}\n"
                      f"write_bytes: {write_bytes}\ncancelled_write_bytes: 0\n")
    (base / "cgroup").write_text(cgroup or "0::/user.slice\n")
    (base / "status").write_text(f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def slurm_v2_job(cgroup: Path, job_id: int, pids: list[int], cpus: str = "0-15", quota: str = "max 100000") -> Path:
    """cgroup v2: system.slice/slurmstepd.scope/job_<id>/step_0/user/task_0 with the pids."""
    job = cgroup / "system.slice" / "slurmstepd.scope" / f"job_{job_id}"
    task = job / "step_0" / "user" / "task_0"
    task.mkdir(parents=True, exist_ok=True)
    (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (job / "cgroup.procs").write_text("")
    (job / "cpuset.cpus.effective").write_text(cpus + "\n")
    (job / "cpu.max").write_text(quota + "\n")
    (task / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return job


def slurm_v1_job(cgroup: Path, job_id: int, uid: int, pids: list[int], minors: list[int] | None,
                 cpus: str = "0-7") -> None:
    """cgroup v1: devices (devices.list: the GPU minors, or every device when ``minors`` is None),
    cpuset and freezer hierarchies for slurm/uid_<uid>/job_<id>/step_0."""
    for controller in ("devices", "cpuset", "freezer"):
        job = cgroup / controller / "slurm" / f"uid_{uid}" / f"job_{job_id}"
        (job / "step_0").mkdir(parents=True, exist_ok=True)
        (job / "cgroup.procs").write_text("")
        (job / "step_0" / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        if controller == "devices":
            lines = ["a *:* rwm"] if minors is None else \
                ["c 195:255 rwm", "c 195:254 rwm", "c 510:0 rwm", "c 510:1 rwm"] + [f"c 195:{m} rw" for m in minors]
            (job / "devices.list").write_text("\n".join(lines) + "\n")
        if controller == "cpuset":
            (job / "cpuset.cpus").write_text(cpus + "\n")


def pod_v2(cgroup: Path, uid: str, pids: list[int], qos: str = "burstable") -> Path:
    """cgroup v2, systemd driver: kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/cri-containerd-….scope."""
    pod = cgroup / "kubepods.slice" / f"kubepods-{qos}.slice" / f"kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
    container = pod / ("cri-containerd-" + "ab" * 32 + ".scope")
    container.mkdir(parents=True, exist_ok=True)
    (pod / "cgroup.procs").write_text("")
    (container / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (pod / "cpu.max").write_text("400000 100000\n")
    return pod


def scontrol_world(path: Path, jobs: dict[str, dict], sleep: float | None = None,
                   fail: tuple[int, str] | None = None) -> Path:
    world: dict = {"nodes": {}, "jobs": jobs}
    if sleep is not None:
        world["sleep"] = {"job": sleep}
    if fail is not None:
        world["fail"] = {"job": list(fail)}
    path.write_text(json.dumps(world))
    return path
