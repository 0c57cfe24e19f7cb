"""Who is using the GPU: NVML processes -> /proc/PID/cgroup -> Slurm job, pod, unit; fake /proc only."""

from pathlib import Path

import fakenvml
import pytest

from gpuwatch.attribution import Attributor, parse_cgroup
from gpuwatch.model import GpuProcess
from gpuwatch.testing import identity

SLURM_V2 = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n"
SLURM_V1 = ("12:memory:/slurm/uid_1001/job_777/step_batch/task_0\n"
            "11:devices:/slurm/uid_1001/job_777/step_batch/task_0\n1:name=systemd:/system.slice/slurmd.service\n")
K8S_V2 = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
          "0f5e7c1a_2b3c_4d5e_8f90_123456789abc.slice/cri-containerd-" + "ab" * 32 + ".scope\n")
K8S_V1 = "4:devices:/kubepods/besteffort/pod0f5e7c1a-2b3c-4d5e-8f90-123456789abd/" + "cd" * 32 + "\n"
SERVICE = "0::/system.slice/inference.service\n"
PLAIN = "0::/\n"


@pytest.mark.parametrize(("text", "expected"), [
    (SLURM_V2, ("slurm", "4242", "")),
    (SLURM_V1, ("slurm", "777", "")),
    ("0::/system.slice/node1_slurmstepd.scope/job_31/step_extern\n", ("slurm", "31", "")),
    (K8S_V2, ("kubernetes", "0f5e7c1a-2b3c-4d5e-8f90-123456789abc", "ab" * 32)),
    (K8S_V1, ("kubernetes", "0f5e7c1a-2b3c-4d5e-8f90-123456789abd", "cd" * 32)),
    (SERVICE, ("systemd", "inference.service", "")),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", ("systemd", "session-3.scope", "")),
    (PLAIN, ("none", "", "")),
    ("0::/system.slice/job_scheduler.service\n", ("systemd", "job_scheduler.service", "")),
])
def test_cgroup_paths(text, expected):
    assert parse_cgroup(text) == expected


def fake_proc(root: Path, pid: int, cgroup: str, uid: int) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(cgroup)
    (root / str(pid) / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t100\n")


def users(uid: int) -> str:
    return {1001: "alice", 1002: "bob"}.get(uid, str(uid))


def test_attributor_reads_only_the_injected_proc_and_handles_vanished_pids(tmp_path):
    fake_proc(tmp_path, 100, SLURM_V2, 1001)
    fake_proc(tmp_path, 101, SERVICE, 0)
    attributor = Attributor(tmp_path, user_name=users)
    infos = attributor.attribute(identity(0), (GpuProcess(100, 2**30), GpuProcess(101, None), GpuProcess(999999, 5)))
    assert [(i.pid, i.scheduler, i.job_id, i.user) for i in infos] == [
        (100, "slurm", "4242", "alice"),
        (101, "systemd", "inference.service", "0"),
        (999999, "unknown", "", ""),
    ]


def test_metrics_show_which_job_and_user_holds_each_gpu(tmp_path, inproc):
    """Over the fake library: GPU 0 runs Slurm job 4242 of alice (two processes), GPU 1 a Kubernetes pod,
    GPU 2 nothing; per-process series only with --collector.processes.per-pid and capped. (uids without a
    passwd entry show as numbers: the daemon resolves names with the real passwd database.)"""
    proc = tmp_path / "proc"
    fake_proc(proc, 100, SLURM_V2, 54321)
    fake_proc(proc, 101, SLURM_V2, 54321)
    fake_proc(proc, 200, K8S_V2, 54322)
    node = fakenvml.FakeNode.h200(3)
    node.gpus[0].add_process(100, 4 * 2**30)
    node.gpus[0].add_process(101, 2**30)
    node.gpus[1].add_process(200, 8 * 2**30)
    d = inproc(node, args=["--attribution.proc-root", str(proc), "--collector.processes.per-pid",
                           "--collector.processes.per-pid-max", "2"])
    fx = d.fx
    try:
        g0 = dict(gpu="0", uuid=node.gpus[0].uuid)
        d.wait_value("gpuwatch_gpu_job_info", 1, scheduler="slurm", job_id="4242", user="54321", **g0)
        m = d.metrics()
        assert d.value("gpuwatch_workload_memory_used_bytes", scheduler="slurm", job_id="4242", **g0) == 5 * 2**30
        pod = "0f5e7c1a-2b3c-4d5e-8f90-123456789abc"
        g1 = dict(gpu="1", uuid=node.gpus[1].uuid)
        assert d.value("gpuwatch_gpu_job_info", scheduler="kubernetes", job_id=pod, user="54322", **g1) == 1
        assert not [k for k in m if k[0] == "gpuwatch_gpu_job_info" and ("gpu", "2") in k[1]]
        per_process = [k for k in m if k[0] == "gpuwatch_process_memory_used_bytes"]
        assert len(per_process) == 2  # capped
        # the job ends: its series go with the next slow poll
        node.gpus[0].compute_processes = []
        fx.write(node)
        d.wait_value("gpuwatch_gpu_job_info", None, scheduler="slurm", job_id="4242", user="54321", **g0)
    finally:
        d.stop()


def test_old_driver_process_list_falls_back_to_v2(tmp_path, inproc):
    """Without nvmlDeviceGetComputeRunningProcesses_v3 (older driver) the _v2 call is used; the
    unversioned pynvml wrapper would raise NVMLLibraryMismatchError, which is no NVMLError."""
    proc = tmp_path / "proc"
    fake_proc(proc, 300, SLURM_V1, 54323)
    node = fakenvml.FakeNode.h200(1)
    node.gpus[0].add_process(300, 3 * 2**30)
    d = inproc(node, old_driver=True, args=["--attribution.proc-root", str(proc)])
    fx = d.fx
    try:
        labels = dict(gpu="0", uuid=node.gpus[0].uuid)
        d.wait_value("gpuwatch_gpu_job_info", 1, scheduler="slurm", job_id="777", user="54323", **labels)
        assert fx.counts()["nvmlDeviceGetComputeRunningProcesses_v2"] >= 2
        assert "nvmlDeviceGetComputeRunningProcesses_v3" not in {k for k, v in fx.counts().items() if v}
    finally:
        d.stop()
