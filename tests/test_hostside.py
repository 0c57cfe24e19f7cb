"""The host groups' readers over fake trees: Slurm allocations (cgroup v1 devices.list, scontrol,
the mapping directory), the jobs' host side through psutil, and the reader that runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakehost import fake_process, pod_v2, proc_stat, scontrol_world, slurm_v1_job, slurm_v2_job

from gpuwatch.clock import FakeClock
from gpuwatch.groups import Selection
from gpuwatch.groups.slurm import JobAllocation
from gpuwatch.hostside import HostReader, cgroups
from gpuwatch.hostside.slurm_allocations import Answer, SlurmAllocations, hostlist_contains, parse_scontrol_job
from gpuwatch.model import GpuState
from gpuwatch.testing import identity

SCONTROL = str(Path(__file__).parent / "fakes" / "scontrol")


def gpus(n: int = 4, minors: list[int] | None = None) -> list[GpuState]:
    minors = minors or list(range(n))
    return [GpuState(identity(i, minor_number=minors[i]), {}, True) for i in range(n)]


def uuid(i: int) -> str:
    return identity(i).uuid


@pytest.fixture
def scontrol_env(tmp_path, monkeypatch):
    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    monkeypatch.setenv("FAKE_SCONTROL_STATE", str(tmp_path / "world.json"))
    scontrol_world(tmp_path / "world.json", {})

    def calls() -> list[list[str]]:
        return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []
    return tmp_path / "world.json", calls


def slurm(options=None, mapping=None, clock=None, errors=None):
    opts = {"scontrol": SCONTROL, "scontrol-timeout": 5, "scontrol-backoff": 60, "node-name": "gpu07"}
    opts.update(options or {})
    clock = clock or FakeClock()
    return SlurmAllocations(opts, mapping, clock.monotonic, errors if errors is not None else [],
                            user_name=lambda uid: {1000: "alice", 1001: "bob"}.get(uid, str(uid)))


def test_hostlists_and_scontrol_records():
    for node in ("gpu01", "gpu03", "gpu07", "login1", "rack2-n40", "n9", "n10"):
        assert hostlist_contains("gpu[01-03,07],login1,rack[1-2]-n[01-40],n[8-10]", node), node
    for node in ("gpu04", "gpu1", "gpu007", "login", "rack3-n01", "rack1-n41", "n7", "n08"):
        assert not hostlist_contains("gpu[01-03,07],login1,rack[1-2]-n[01-40],n[8-10]", node), node
    assert hostlist_contains("n[1-99999999999]", "n123456789")  # never expanded
    line = ("JobId=42 JobName=train UserId=alice(1000) GroupId=users(100) NodeList=gpu[06-07] NumNodes=2 "
            "Nodes=gpu06 CPU_IDs=0-31 Mem=256000 GRES=gpu:h200:4(IDX:0-3) "
            "Nodes=gpu07 CPU_IDs=0-15 Mem=128000 GRES=gpu:h200:2(IDX:1,3),nic:1(IDX:0) MinCPUsNode=1 "
            "TresPerNode=gres/gpu:4")
    assert parse_scontrol_job(line, "gpu07") == Answer("alice", (1, 3), True)
    assert parse_scontrol_job(line, "gpu06") == Answer("alice", (0, 1, 2, 3), True)
    assert parse_scontrol_job(line, "gpu99") == Answer("alice", (), False)
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified", "gpu07") is None
    # a job name (or comment, or command) a user chose is no per-node part; a huge IDX range is clamped
    evil = ("JobId=43 JobName=x Nodes=gpu07 CPU_IDs=0 GRES=gpu(IDX:0-7) UserId=eve(1002) NodeList=gpu07 "
            "Nodes=gpu07 CPU_IDs=0-3 Mem=1 GRES=gpu:1(IDX:2) MinCPUsNode=1 Comment=Nodes=gpu07 GRES=gpu(IDX:5)")
    assert parse_scontrol_job(evil, "gpu07") == Answer("eve", (2,), True)
    huge = parse_scontrol_job("JobId=44 UserId=a(1) NodeList=gpu07 Nodes=gpu07 GRES=gpu:1(IDX:0-10000000000)",
                              "gpu07")
    assert huge is not None and len(huge.indices) == 1024
    mig = parse_scontrol_job("JobId=45 UserId=a(1) NodeList=gpu07 Nodes=gpu07 GRES=gpu:1g.10gb:2(IDX:0-1)", "gpu07")
    assert mig is not None and mig.mig


def test_cgroup_v1_devices_list_names_the_gpus_of_each_job_without_asking_slurm(tmp_path, scontrol_env):
    """GPU minors 2 and 3 are GPUs 1 and 3 here (minor numbers need not follow the NVML index); nvidiactl,
    nvidia-uvm and modeset are not GPUs."""
    _, calls = scontrol_env
    root = tmp_path / "cgroup"
    slurm_v1_job(root, 42, 1000, [100], minors=[2, 3])
    slurm_v1_job(root, 43, 1001, [200], minors=[0])
    found = cgroups.scan(root)
    assert [(j.job_id, j.uid, j.devices()) for j in found.jobs] == [("42", 1000, (2, 3)), ("43", 1001, (0,))]
    allocations, complete = slurm().read(found, gpus(4, minors=[0, 2, 1, 3]))
    assert complete
    assert sorted(allocations, key=lambda a: a.uuid) == [
        JobAllocation(uuid(0), "43", "bob", "devices"), JobAllocation(uuid(1), "42", "alice", "devices"),
        JobAllocation(uuid(3), "42", "alice", "devices")]
    assert calls() == []


def test_cgroup_v2_jobs_are_asked_of_scontrol_once_each(tmp_path, scontrol_env):
    """No devices controller on v2 (eBPF): scontrol --details gives this node's GRES indices, which
    follow the GPUs' minor numbers (gres.conf's File=/dev/nvidia[0-3]); a job is asked once, not
    at every read, and forgotten when its cgroup goes."""
    world, calls = scontrol_env
    scontrol_world(world, {"42": {"user": "alice", "parts": [{"nodes": "gpu[06-07]", "gres": "gpu:h200:2(IDX:0-1)"}]},
                           "43": {"user": "bob", "parts": [{"nodes": "gpu07", "gres": "gpu:h200:1(IDX:3)"}]}})
    root = tmp_path / "cgroup"
    slurm_v2_job(root, 42, [100])
    slurm_v2_job(root, 43, [200])
    reader = slurm()
    state = gpus(4, minors=[1, 0, 2, 3])
    first, complete = reader.read(cgroups.scan(root), state)
    assert complete
    assert sorted((a.uuid, a.job_id, a.user, a.source) for a in first) == [
        (uuid(0), "42", "alice", "scontrol"), (uuid(1), "42", "alice", "scontrol"), (uuid(3), "43", "bob", "scontrol")]
    assert reader.read(cgroups.scan(root), state) == (first, True)
    assert calls() == [["show", "job", "--details", "--oneliner", "42"], ["show", "job", "--details", "--oneliner", "43"]]


def test_unconstrained_v1_devices_fall_back_to_scontrol_then_to_the_mapping_directory(tmp_path, scontrol_env):
    world, calls = scontrol_env
    scontrol_world(world, {"50": {"user": "alice", "parts": [{"nodes": "gpu07", "gres": "gpu:1(IDX:2)"}]}})
    root = tmp_path / "cgroup"
    slurm_v1_job(root, 50, 1000, [100], minors=None)  # ConstrainDevices=no: "a *:* rwm"
    mapping = tmp_path / "map"
    mapping.mkdir()
    (mapping / "0").write_text("51\n")
    (mapping / "1").write_text("0\n")  # dcgm-job-map's "no job"
    (mapping / "3.2").write_text("52\n")  # a MIG instance of GPU 3
    (mapping / "junk").write_text("53\n")
    os.mkfifo(mapping / "2")  # a FIFO where a file should be: skipped, never read (it would block)
    allocations, complete = slurm(mapping=str(mapping)).read(cgroups.scan(root), gpus(4))
    assert complete
    assert sorted((a.uuid, a.job_id, a.source) for a in allocations) == [
        (uuid(0), "51", "mapping"), (uuid(2), "50", "scontrol"), (uuid(3), "52", "mapping")]


def test_no_slurm_here_is_absent_not_free(tmp_path, scontrol_env):
    assert slurm().read(cgroups.scan(tmp_path / "nothing"), gpus()) is None
    root = tmp_path / "cgroup"
    (root / "system.slice" / "slurmstepd.scope").mkdir(parents=True)  # slurmd runs, no job
    assert slurm().read(cgroups.scan(root), gpus()) == ((), True)


def test_a_hung_scontrol_is_killed_at_its_timeout_and_not_asked_again_before_the_backoff(tmp_path, scontrol_env):
    """One timeout, then no call for any job until scontrol-backoff has passed (a hung slurmctld costs
    one timeout per backoff, not one per job and read); counted and logged once; then it answers."""
    world, calls = scontrol_env
    jobs = {str(j): {"user": "alice", "parts": [{"nodes": "gpu07", "gres": f"gpu:1(IDX:{j - 60})"}]} for j in (60, 61)}
    scontrol_world(world, jobs, sleep=60)
    root = tmp_path / "cgroup"
    slurm_v2_job(root, 60, [1])
    slurm_v2_job(root, 61, [2])
    clock, errors = FakeClock(), []
    reader = slurm({"scontrol-timeout": 1}, clock=clock, errors=errors)
    assert reader.read(cgroups.scan(root), gpus()) == ((), False)  # the jobs' GPUs unknown, not free
    assert errors == [("slurm", "scontrol_timeout")] and len(calls()) == 1
    errors.clear()
    clock.advance(30)
    assert reader.read(cgroups.scan(root), gpus()) == ((), False) and errors == [] and len(calls()) == 1
    scontrol_world(world, jobs)
    clock.advance(31)
    allocations, complete = reader.read(cgroups.scan(root), gpus())
    assert {a.job_id for a in allocations} == {"60", "61"} and complete
    assert len(calls()) == 3


def test_scontrol_missing_or_failing_is_counted_and_the_other_sources_go_on(tmp_path, scontrol_env):
    world, _ = scontrol_env
    root = tmp_path / "cgroup"
    slurm_v2_job(root, 70, [1])
    slurm_v1_job(root, 71, 1000, [2], minors=[1])
    errors: list = []
    assert slurm({"scontrol": "no-such-scontrol-here"}, errors=errors).read(cgroups.scan(root), gpus()) == (
        (JobAllocation(uuid(1), "71", "alice", "devices"),), False)
    assert errors == [("slurm", "scontrol_missing")]
    scontrol_world(world, {}, fail=(1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"))
    errors.clear()
    allocations, complete = slurm(errors=errors).read(cgroups.scan(root), gpus())
    assert len(allocations) == 1 and not complete
    assert errors == [("slurm", "scontrol_failed")]
    scontrol_world(world, {})  # the job ended between the scan and the call (a leftover cgroup): no error
    errors.clear()
    reader = slurm(errors=errors)
    assert reader.read(cgroups.scan(root), gpus()) == ((JobAllocation(uuid(1), "71", "alice", "devices"),), True)
    assert errors == []
    scontrol_world(world, {"70": {"user": "bob", "parts": [{"nodes": "gpu08", "gres": "gpu:1(IDX:0)"}]}})
    errors.clear()  # another node's job as scontrol sees it: NodeName is not the host name
    assert slurm(errors=errors).read(cgroups.scan(root), gpus())[1] is False
    assert errors == [("slurm", "scontrol_node_unknown")]


def test_a_lost_gpu_keeps_its_place_in_the_gres_order(tmp_path, scontrol_env):
    """IDX 2 is the GPU with the third smallest minor number, whether or not the one before it answers:
    the reader ranks every GPU discovered since start (the poller passes lost ones too)."""
    world, _ = scontrol_env
    scontrol_world(world, {"80": {"user": "alice", "parts": [{"nodes": "gpu07", "gres": "gpu:1(IDX:2)"}]}})
    root = tmp_path / "cgroup"
    slurm_v2_job(root, 80, [1])
    state = gpus(4)
    state[1] = GpuState(state[1].identity, {}, False)  # lost
    allocations, _ = slurm().read(cgroups.scan(root), state)
    assert [a.uuid for a in allocations] == [uuid(2)]


def test_jobs_group_sums_every_process_of_the_job_with_psutil_and_keeps_the_time_of_those_that_exit(tmp_path):
    """Loader processes that never touch the GPU count; a process that exits keeps its CPU time in
    the job's totals (the counter never goes back); rates over the interval give the busy share of
    the job's CPUs and the share of its time in I/O wait; an unreadable /proc/PID/io makes the
    job's I/O absent, not wrong."""
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    slurm_v2_job(root, 42, [100, 101, 102], cpus="0-3,8-11", quota="400000 100000")  # 8 CPUs, 4 by quota
    pod_v2(root, "0e9c2d4a-1b7f-4c39-9a57-4f0fd1c2e111", [300])
    fake_process(proc, 100, user=10.0, system=1.0, read_bytes=1000, write_bytes=10)
    fake_process(proc, 101, user=20.0, system=2.0, iowait=3.0, read_bytes=2000, write_bytes=20)
    fake_process(proc, 102, user=5.0, read_bytes=500, write_bytes=5)
    fake_process(proc, 300, user=1.0, read_bytes=None)  # another user's: /proc/300/io not readable
    clock = FakeClock()
    reader = JobsReader(str(proc), clock.monotonic, node_cpus=64.0)
    first = {j.job_id: j for j in reader.read(cgroups.scan(root))}
    job = first["42"]
    assert (job.scheduler, job.cpu_seconds, job.read_bytes, job.write_bytes, job.cpus, job.processes) == (
        "slurm", (35.0, 3.0, 3.0), 3500, 35, 4.0, 3)
    assert job.cpu_busy_ratio is None and job.iowait_ratio is None  # one read: no rate yet
    pod = first["0e9c2d4a-1b7f-4c39-9a57-4f0fd1c2e111"]
    assert (pod.scheduler, pod.read_bytes, pod.cpus) == ("kubernetes", None, 4.0)
    # 30 s later: 100 and 101 used 96 more CPU seconds, 102 exited; 101 waited 24 s more for I/O
    (root / "system.slice/slurmstepd.scope/job_42/step_0/user/task_0/cgroup.procs").write_text("100\n101\n")
    fake_process(proc, 100, user=60.0, system=5.0, read_bytes=1000, write_bytes=10)
    fake_process(proc, 101, user=62.0, system=2.0, iowait=27.0, read_bytes=9000, write_bytes=20)
    clock.advance(30)
    job = {j.job_id: j for j in reader.read(cgroups.scan(root))}["42"]
    assert job.cpu_seconds == (127.0, 7.0, 27.0) and job.read_bytes == 10500 and job.processes == 2
    assert job.cpu_busy_ratio == pytest.approx(96.0 / 30 / 4)
    assert job.iowait_ratio == pytest.approx(24.0 / (96.0 + 24.0))


def test_reader_runs_each_enabled_group_and_one_failing_source_stays_there(tmp_path, scontrol_env, monkeypatch):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    slurm_v1_job(root, 42, 1000, [100], minors=[0])
    fake_process(proc, 100, user=1.0)
    options = {"slurm.scontrol": SCONTROL, "slurm.scontrol-timeout": 5, "slurm.scontrol-backoff": 60,
               "slurm.node-name": "gpu07", "kubernetes.socket": str(tmp_path / "no.sock"), "kubernetes.timeout": 1}
    reader = HostReader(Selection.of({"slurm", "kubernetes", "jobs"}, options), str(proc), str(root))
    sample = reader(gpus(2))
    assert [a.job_id for a in sample.slurm] == ["42"] and sample.kubernetes is None
    assert [j.job_id for j in sample.jobs] == ["42"]
    assert [name for name, _, ok in sample.collected if ok] == ["slurm", "jobs"]  # no kubelet: no series
    assert sample.on(uuid(0)).allocated and sample.on(uuid(1)).allocated is False
    monkeypatch.setattr(reader._slurm, "read", lambda *a: 1 / 0)
    sample = reader(gpus(2))
    assert sample.slurm is None and [j.job_id for j in sample.jobs] == ["42"]
    assert ("slurm", "internal") in sample.errors
    assert [(name, ok) for name, _, ok in sample.collected] == [("slurm", False), ("jobs", True)]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_psutil_reads_this_process_through_the_real_proc(tmp_path):
    """The real /proc, not a fake: gpuwatch's own job (a cgroup with this test's PID) is read."""
    from gpuwatch.hostside.jobs import JobsReader

    root = tmp_path / "cgroup"
    slurm_v2_job(root, 1, [os.getpid()])
    usage = JobsReader("/proc", FakeClock().monotonic).read(cgroups.scan(root))[0]
    assert usage.processes == 1 and usage.cpu_seconds[0] + usage.cpu_seconds[1] > 0


def test_the_cgroups_own_accounting_counts_what_no_process_list_can(tmp_path):
    """cgroup v2 cpu.stat and io.stat count every process that ever ran in the job, exited between two
    reads or invisible to gpuwatch: they are the user/system CPU and the I/O; iowait (delay accounting)
    comes from the processes psutil reads."""
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    job = slurm_v2_job(root, 42, [100])
    fake_process(proc, 100, user=10.0, system=1.0, iowait=2.0, read_bytes=5, write_bytes=5)
    (job / "cpu.stat").write_text("usage_usec 70000000\nuser_usec 60000000\nsystem_usec 10000000\n")
    (job / "io.stat").write_text("8:0 rbytes=1000 wbytes=200 rios=1 wios=1 dbytes=0 dios=0\n"
                                 "259:0 rbytes=24 wbytes=1 rios=1 wios=1 dbytes=0 dios=0\n")
    usage = JobsReader(str(proc), FakeClock().monotonic).read(cgroups.scan(root))[0]
    assert (usage.cpu_seconds, usage.read_bytes, usage.write_bytes) == ((60.0, 10.0, 2.0), 1024, 201)


def test_a_job_whose_processes_gpuwatch_cannot_see_is_absent_not_idle(tmp_path):
    """cgroup.procs lists processes of another PID namespace as 0 (a container without hostPID): without
    the cgroup's accounting nothing can be said, so the job has no reading (counted, logged once), never
    a CPU use of 0 that input_bound would read as 'not saturated'."""
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    job = slurm_v2_job(root, 42, [0, 0, 0])
    errors: list = []
    reader = JobsReader(str(proc), FakeClock().monotonic, errors=errors)
    assert reader.read(cgroups.scan(root)) == () and errors == [("jobs", "processes_not_visible")]
    (job / "cpu.stat").write_text("user_usec 5000000\nsystem_usec 1000000\n")
    usage = reader.read(cgroups.scan(root))[0]
    assert usage.cpu_seconds == (5.0, 1.0, None) and usage.processes == 3


def test_cpu_totals_never_count_a_process_twice(tmp_path):
    """Keyed by PID and start ticks: a boot time that moves (NTP) does not make a process new; one that
    misses one read (a cgroup.procs read racing a migration) and comes back is not counted twice; a PID
    reused by a new process is a new process; /proc/PID/io turning unreadable keeps the last bytes."""
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    slurm_v2_job(root, 42, [100, 101])
    procs = root / "system.slice/slurmstepd.scope/job_42/step_0/user/task_0/cgroup.procs"
    fake_process(proc, 100, user=100.0, read_bytes=1000)
    fake_process(proc, 101, user=50.0, read_bytes=500)
    reader = JobsReader(str(proc), FakeClock().monotonic)

    def read():
        job = reader.read(cgroups.scan(root))[0]
        return job.cpu_seconds[0], job.read_bytes
    assert read() == (150.0, 1500)
    (proc / "stat").write_text("cpu  1 2 3 4 5 6 7 0 0 0\nbtime 1700000001\n")  # the boot time moved by 1 s
    assert read() == (150.0, 1500)
    procs.write_text("100\n")  # 101 missed one read ...
    assert read() == (150.0, 1500)
    procs.write_text("100\n101\n")  # ... and is back, unchanged
    assert read() == (150.0, 1500)
    fake_process(proc, 101, user=1.0, read_bytes=1, start_ticks=9000)  # exited; its PID reused by a new process
    assert read() == (151.0, 1501)
    fake_process(proc, 100, user=110.0, read_bytes=None)  # 100 dropped dumpable: its I/O unreadable from now
    assert read() == (161.0, 1501)


def test_malformed_cgroup_files_cost_their_own_reading_only(tmp_path):
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    job = slurm_v2_job(root, 42, [100], cpus="5-3", quota="nan 100000")
    fake_process(proc, 100, user=1.0)
    (job / "step_0" / "cgroup.procs").write_bytes(b"\xff\xfe\n\xc2\xb2\n100\n")  # not UTF-8, a superscript two
    (job / "cpu.stat").write_text("user_usec inf\nsystem_usec -5\n")
    usage = JobsReader(str(proc), FakeClock().monotonic, node_cpus=64.0).read(cgroups.scan(root))[0]
    assert usage.processes == 1 and usage.cpus == 64.0 and usage.cpu_seconds[0] == 1.0
    assert cgroups.count_cpu_list("0-3,8,x,9-7,10-11") == 7


KUBELET_WITHOUT_GRPC = """
import json, sys
if sys.argv[2] == "blocked":
    sys.modules["grpc"] = None  # grpcio not installed
from gpuwatch import logs
logs.configure("info", "json")
from gpuwatch.hostside import KubeletPods
errors = []
pods = KubeletPods(sys.argv[1], 1.0, errors)
first, second = pods.read([]), pods.read([])
print(json.dumps({"reads": [first, second], "errors": errors, "grpc": sys.modules.get("grpc") is not None}))
"""


@pytest.mark.parametrize("socket", ["missing", "present"])
def test_grpcio_is_imported_only_where_the_kubelet_socket_is(tmp_path, socket, request):
    """grpcio and protobuf cost about 10 MB: a node without a kubelet never imports them; where the socket is
    and grpcio is not installed, the group says so once (kubernetes_off, no_grpcio) and is no error."""
    path = tmp_path / "kubelet.sock"
    if socket == "present":
        import socket as sockets

        server = sockets.socket(sockets.AF_UNIX)
        server.bind(str(path))
        request.addfinalizer(server.close)
    for mode in ("blocked", "installed") if socket == "present" else ("installed",):
        done = subprocess.run([sys.executable, "-c", KUBELET_WITHOUT_GRPC, str(path), mode],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.splitlines()[-1])
        events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        assert out["reads"] == [None, None]
        if socket == "missing":
            assert out == {"reads": [None, None], "errors": [], "grpc": False}
            assert [(e["event"], e["reason"]) for e in events] == [("kubernetes_off", "no_socket")]
        elif mode == "blocked":
            assert out["errors"] == [] and out["grpc"] is False
            assert [(e["event"], e["reason"]) for e in events] == [("kubernetes_off", "no_grpcio")]
            assert "gpuwatch[kubernetes]" in events[0]["hint"]
        else:  # a socket that is no kubelet: grpcio is imported to ask it, and the failure is counted
            assert out["grpc"] is True and out["errors"]


# -- the scan's own glob, held equal to pathlib's ----------------------------------------------------

_NAMES = ("system.slice", "slurmstepd.scope", "n1_slurmstepd.scope", "job_7", "job_12", "slurm", "slurm_n1", "uid_0",
          "devices", "cpu,cpuacct", "kubepods", "kubepods.slice", "kubepods-pod1.slice", "kubepods-besteffort.slice",
          "kubepods-besteffort-pod2.slice", "pod3", "burstable", ".hidden", "x[1]", "job_", "Job_8")


def _tree(root: Path, entries) -> None:
    """entries: (path of names, kind: 0 directory, 1 file, 2 symlink to the first directory made)."""
    first_dir = None
    for names, kind in entries:
        path = root.joinpath(*names)
        parent_ok = all(p.is_dir() for p in [root.joinpath(*names[:i]) for i in range(1, len(names))])
        if not parent_ok or path.exists() or path.is_symlink():
            continue
        if kind == 0:
            path.mkdir()
            first_dir = first_dir or path
        elif kind == 1:
            path.write_text("x")
        elif first_dir is not None and first_dir not in path.parents:
            path.symlink_to(first_dir, target_is_directory=True)


def test_the_scans_glob_finds_what_pathlib_finds_in_the_same_order():
    import tempfile

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    patterns = (*cgroups._SLURM_V2, *cgroups._SLURM_V1, *cgroups._PODS, *("*/" + p for p in cgroups._PODS),
                "system.slice/*slurmstepd.scope", "*/slurm*/uid_*", "devices/slurm*")
    entry = st.tuples(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4).map(tuple), st.integers(0, 2))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(entry, max_size=40))
    def same(entries):
        with tempfile.TemporaryDirectory() as directory:
            root = Path(directory)
            _tree(root, sorted(entries, key=lambda e: len(e[0])))
            listings = {}  # shared as in a scan: a directory listed by one pattern is looked up by the next
            for pattern in patterns:
                assert cgroups.glob_text(root, pattern, listings) == [str(p) for p in root.glob(pattern)], pattern

    same()
    assert cgroups.glob_text(Path("/nonexistent-root"), "*/slurm*") == []
    with tempfile.TemporaryDirectory() as directory:  # every pattern finds something: the layouts of a node
        root = Path(directory)
        _tree(root, [(("cpu,cpuacct",), 0), (("cpu",), 2)] + [
            (tuple(path.split("/")[:i]), 0) for path in (
                "system.slice/n1_slurmstepd.scope/job_7", "devices/slurm/uid_0/job_12",
                "cpu,cpuacct/slurm_n1/uid_0/job_12", "kubepods.slice/kubepods-pod1.slice",
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice", "kubepods/pod3",
                "kubepods/burstable/pod3", "memory/kubepods/burstable/pod3", "memory/kubepods/pod3",
                "memory/kubepods.slice/kubepods-pod1.slice",
                "memory/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice") for i in range(1, 5)])
        for pattern in patterns:
            found = cgroups.glob_text(root, pattern)
            assert found and found == [str(p) for p in root.glob(pattern)], pattern


def test_a_job_directory_that_goes_away_while_the_scan_lists_it_loses_only_that_job(tmp_path, monkeypatch):
    """pathlib's glob raised FileNotFoundError out of the scan (the slurm and jobs groups lost the read, logged
    as a gpuwatch bug) when a job's cgroup went away between its parent's listing and its own."""
    slurm_v1_job(tmp_path, 11, 1000, [], [0])
    slurm_v1_job(tmp_path, 12, 1000, [], [1])
    gone = str(tmp_path / "cpuset" / "slurm" / "uid_1000")
    real = os.scandir

    def scandir(path):
        if str(path) == gone:
            raise FileNotFoundError(2, "No such file or directory", path)  # removed after the listing above it
        return real(path)

    monkeypatch.setattr(cgroups.os, "scandir", scandir)
    found = cgroups.scan(tmp_path)
    assert [job.job_id for job in found.jobs] == ["11", "12"] and found.slurm_hierarchy
    assert all("cpuset" not in job.dirs and {"devices", "freezer"} <= set(job.dirs) for job in found.jobs)


@pytest.mark.parametrize("order", [sorted, lambda names: sorted(names, reverse=True)])
def test_a_mapping_file_is_named_in_one_spelling_only(tmp_path, monkeypatch, order):
    """"00" and "0000" were GPU 0 like "0" (and "0.03" MIG instance 3 like "0.3"): the file the listing gave
    last won, silently. They are no file dcgm-exporter writes: skipped, reported; "0" keeps its job."""
    from gpuwatch.hostside.slurm_allocations import read_mapping_dir
    real = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(order(real(self))))
    mapping = tmp_path / "map"
    mapping.mkdir()
    for name, job in (("0", "42"), ("00", "999"), ("0000", "998"), ("0.3", "43"), ("0.03", "997"), ("10", "44"),
                      ("010", "996"), ("junk", "995"), ("9" * 200, "994")):
        (mapping / name).write_text(job + "\n")
    reports: list[tuple[str, str]] = []
    assert read_mapping_dir(mapping, lambda source, reason: reports.append((source, reason))) == {
        (0, None): ["42"], (0, 3): ["43"], (10, None): ["44"]}
    assert sorted(Path(source).name for source, _ in reports) == ["0.03", "00", "0000", "010"]
    assert all("leading zero" in reason for _, reason in reports)


def test_a_mapping_job_id_is_ascii_between_ascii_whitespace(tmp_path, scontrol_env):
    """strip() and splitlines() made "42\\x1f" and "43\\u3000" jobs 42 and 43, and "46\\x1e47" two jobs: a line ends
    at "\\n" and only ASCII whitespace around it is dropped; the rest is a bad line, its neighbours kept."""
    from gpuwatch.hostside.slurm_allocations import read_mapping_dir
    mapping = tmp_path / "map"
    mapping.mkdir()
    (mapping / "0").write_bytes("42\x1f\n43\u3000\n\t44 \r\n\x0b45\x0c\n46\x1e47\n48\x85\n".encode())
    reports: list[str] = []
    assert read_mapping_dir(mapping, lambda source, reason: reports.append(reason)) == {(0, None): ["44", "45"]}
    assert reports == ["4 line(s) that are no job id skipped, the first: '42\\x1f'"]
    errors: list = []
    allocations, _ = slurm(mapping=str(mapping), errors=errors).read(cgroups.scan(tmp_path / "none"), gpus())
    assert [(a.uuid, a.job_id) for a in allocations] == [(uuid(0), "44"), (uuid(0), "45")]
    assert errors == [("slurm", "malformed_input")]


def test_a_scan_and_an_attribution_intern_no_string(tmp_path, interned):
    """pathlib interns every part of every Path it makes (sys.intern), and names that come and go with the jobs
    (job_<id>, step_0, a PID, cpu.stat) churned the interpreter's table of interned strings: each resize of it,
    every few minutes in the soak, allocated 1 or 1.9 MB by turns (gdb caught it), and the process's RSS
    switched between two levels 2 MB apart. What runs every host read and slow poll makes no Path."""
    from gpuwatch.attribution import Attributor
    from gpuwatch.hostside.slurm_allocations import read_mapping_dir
    from gpuwatch.model import GpuProcess

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    for pid, cgroup in ((4101, "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n"),
                        (4102, "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b2c3d_0000_"
                               "4000_8000_00000000abcd.slice/cri-containerd-" + "ab" * 32 + ".scope\n")):
        fake_process(proc, pid, cgroup=cgroup)
    slurm_v2_job(root, 77, [4101])
    slurm_v1_job(root, 78, 1000, [4103], [0, 1])
    pod_v2(root, "0a1b2c3d-0000-4000-8000-00000000abcd", [4102])
    attributor = Attributor(proc)
    processes = (GpuProcess(4101, 1), GpuProcess(4102, 1), GpuProcess(4103, 1))
    mapping = tmp_path / "mapping"  # dcgm-exporter's job-mapping directory: a file per GPU or MIG instance
    mapping.mkdir()
    for name, jobs in (("0", "77\n"), ("1.3", "78\n"), ("2", "0\n")):
        (mapping / name).write_text(jobs)

    def one_read() -> tuple:
        found = cgroups.scan(root)
        return (tuple((j.job_id, j.pids(), j.accounting(), j.cpus(), j.devices()) for j in found.jobs),
                attributor.attribute(identity(0), processes), read_mapping_dir(mapping))

    first = one_read()
    assert [j[0] for j in first[0]] == ["0a1b2c3d-0000-4000-8000-00000000abcd", "77", "78"]
    assert {(i.pid, i.scheduler, i.job_id) for i in first[1]} >= {(4101, "slurm", "77")}
    assert first[2] == {(0, None): ["77"], (1, 3): ["78"]}
    added = interned()
    assert one_read() == first
    assert added == []
