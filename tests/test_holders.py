"""Who holds each GPU, end to end: the agent (in-process, simulated time; `gpuwatch run` where its
threads are the subject) over the fake library with fake cgroup trees, a fake scontrol, fake /proc trees
and a fake kubelet (a real gRPC server on a unix socket)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import fakenvml
import pytest
from daemon import Daemon, fake_env, stop_process, wait_for
from fakehost import fake_process, proc_stat, scontrol_world, slurm_v1_job, slurm_v2_job

TESTS = Path(__file__).parent
SCONTROL = str(TESTS / "fakes" / "scontrol")
SLURM_V2 = "0::/system.slice/slurmstepd.scope/job_{}/step_0/user/task_0\n"


def host_env_of_scontrol(tmp_path, jobs=None, sleep=None):
    world = scontrol_world(tmp_path / "world.json", jobs or {}, sleep=sleep)
    return dict(FAKE_SCONTROL_STATE=str(world), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"))


def host_env(fx, tmp_path, jobs=None, sleep=None):
    return {**fake_env(fx), **host_env_of_scontrol(tmp_path, jobs, sleep)}


def host_args(tmp_path, *extra):
    return ["--attribution.proc-root", str(tmp_path / "proc"), "--attribution.cgroup-root", str(tmp_path / "cgroup"),
            "--collector.slurm.scontrol", SCONTROL, "--collector.slurm.node-name", "gpu07", *extra]


def scontrol_calls(tmp_path):
    log = tmp_path / "scontrol.log"
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []


def test_every_allocated_gpu_shows_its_job_even_without_a_process(tmp_path, inproc, monkeypatch):
    """Slurm job 42 of alice asked for GPUs 0 and 1 (scontrol's GRES on cgroup v2) and runs on GPU 0
    only; GPUs 2 and 3 are free. GPU 1 shows the job without a process, is allocated, and
    allocated_idle fires on it naming the job and the user; the job's host side is exported; when
    the job ends its series go."""
    node = fakenvml.FakeNode.l40s(4)
    node.gpus[0].utilization = (90, 40)
    node.gpus[0].add_process(100, 4 * 2**30)
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    fake_process(proc, 100, user=120.0, system=4.0, read_bytes=10**9, write_bytes=10**6, cgroup=SLURM_V2.format(42),
                 uid=54321)
    fake_process(proc, 101, user=300.0, system=9.0, iowait=2.0, read_bytes=3 * 10**9, write_bytes=0,
                 cgroup=SLURM_V2.format(42), uid=54321)  # a data loader: not on the GPU
    slurm_v2_job(cgroup, 42, [100, 101], cpus="0-7")
    jobs = {"42": {"user": "alice", "uid": 54321, "parts": [{"nodes": "gpu[06-07]", "gres": "gpu:l40s:2(IDX:0-1)"}]}}
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {allocated_idle: {hold: 0, every: 0, window_seconds: 2}}\n")
    for name, value in host_env_of_scontrol(tmp_path, jobs).items():
        monkeypatch.setenv(name, value)  # what the agent's scontrol inherits
    d = inproc(node, args=host_args(tmp_path, "--config", str(config)))
    try:
        g = [dict(gpu=str(i), uuid=node.gpus[i].uuid) for i in range(4)]
        d.wait_value("gpuwatch_gpu_allocated", 1, **g[1])
        assert [d.value("gpuwatch_gpu_allocated", **g[i]) for i in range(4)] == [1, 1, 0, 0]
        d.wait_value("gpuwatch_gpu_job_info", 1, scheduler="slurm", job_id="42", user="alice", **g[1])
        m = d.metrics()
        infos = sorted((dict(k[1])["gpu"], dict(k[1])["user"]) for k in m if k[0] == "gpuwatch_gpu_job_info")
        assert infos == [("0", "54321"), ("1", "alice")]  # GPU 0: its process's, once; GPU 1: the allocation
        job = dict(scheduler="slurm", job_id="42")
        assert d.value("gpuwatch_job_cpu_seconds_total", mode="user", **job) == 420.0
        assert d.value("gpuwatch_job_cpu_seconds_total", mode="iowait", **job) == 2.0
        assert d.value("gpuwatch_job_cpus", **job) == 8
        assert d.value("gpuwatch_job_io_bytes_total", direction="read", **job) == 4 * 10**9
        assert d.value("gpuwatch_collector_success", group="slurm") == 1
        d.wait_value("gpuwatch_anomaly", 1, rule="allocated_idle", severity="warning", **g[1])
        assert d.value("gpuwatch_anomaly", rule="allocated_idle", severity="warning", **g[2]) is None  # free
        status = json.loads(d.get("/api/v1/status")[1])
        summary = next(a["summary"] for a in status["anomalies"] if a["rule"] == "allocated_idle" and a["gpu"] == "1")
        assert "slurm job 42 of alice (allocated, no process on it)" in summary
        assert len(scontrol_calls(tmp_path)) == 1  # asked once for the job's life
        # the job ends: its cgroup goes, then its process
        subprocess.run(["rm", "-r", str(cgroup / "system.slice" / "slurmstepd.scope" / "job_42")], check=True)
        d.wait_value("gpuwatch_gpu_allocated", 0, **g[1])
        d.wait_value("gpuwatch_gpu_job_info", None, scheduler="slurm", job_id="42", user="alice", **g[1])
        assert d.value("gpuwatch_job_cpus", **job) is None
    finally:
        d.stop()


@pytest.mark.daemon  # the poll threads go on while the host job's scontrol hangs
def test_a_hung_scontrol_delays_no_poll(tmp_path):
    """scontrol hangs (slurmctld not answering): while it runs, fast and slow polls go on at their
    interval and /metrics answers; it is killed at its timeout, counted, logged once, and not run
    again before the backoff."""
    node = fakenvml.FakeNode.l40s(2)
    fx = fakenvml.prepare(tmp_path, node)
    proc_stat(tmp_path / "proc")
    slurm_v2_job(tmp_path / "cgroup", 42, [])
    jobs = {"42": {"user": "alice", "parts": [{"nodes": "gpu07", "gres": "gpu:1(IDX:0)"}]}}
    d = Daemon(tmp_path, host_env(fx, tmp_path, jobs, sleep=60),
               host_args(tmp_path, "--collector.slurm.scontrol-timeout", "4"))
    try:
        wait_for(lambda: scontrol_calls(tmp_path), what="scontrol to be called")

        def last(m, tier):
            return m.get(("gpuwatch_last_poll_timestamp_seconds", (("tier", tier),)))
        before = d.metrics()
        fast, slow = last(before, "fast"), last(before, "slow")

        def polled():
            m = d.metrics()
            return m if last(m, "fast") >= fast + 1.0 and last(m, "slow") >= slow + 1.0 else None
        m = wait_for(polled, timeout=30, what="fast and slow polls to complete while scontrol hangs")
        # in that same scrape scontrol was still hanging (not yet killed at its 4 s timeout): the polls did not
        # wait for it
        timeouts = ("gpuwatch_collector_errors_total", (("error", "scontrol_timeout"), ("group", "slurm")))
        assert not m.get(timeouts), "the polls waited for scontrol"
        d.wait_value("gpuwatch_collector_errors_total", 1, group="slurm", error="scontrol_timeout")
        assert d.value("gpuwatch_gpu_allocated", gpu="0", uuid=node.gpus[0].uuid) is None  # unknown, not free
        assert len(scontrol_calls(tmp_path)) == 1  # the backoff (60 s)
        assert [e["event"] for e in d.events()].count("scontrol_timeout") == 1
    finally:
        d.stop()


def test_input_bound_fires_on_a_job_whose_loaders_saturate_its_cpus_while_its_gpu_waits(tmp_path, inproc,
                                                                                        monkeypatch):
    """GPU 0 runs at 35 % for job 42, whose four loader processes keep its 4 CPUs 97 % busy: input_bound
    fires. GPU 1 runs at 35 % for job 43, whose CPUs idle at 10 %: silent. The CPU times grow in the
    fake /proc with the agent's (simulated) time, rewritten on every look, so its rates are those rates."""
    node = fakenvml.FakeNode.l40s(2)
    for gpu in node.gpus:
        gpu.utilization = (35, 20)
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    slurm_v1_job(cgroup, 42, 1000, [100, 101, 102, 103], minors=[node.gpus[0].minor], cpus="0-3")
    slurm_v1_job(cgroup, 43, 1000, [200], minors=[node.gpus[1].minor], cpus="4-7")
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {input_bound: {hold: 0, every: 0, window_seconds: 2}}\n")
    for name, value in host_env_of_scontrol(tmp_path).items():
        monkeypatch.setenv(name, value)  # what the agent's scontrol inherits
    d = inproc(node, args=host_args(tmp_path, "--config", str(config)))
    t0 = d.clock.monotonic()

    def tick():
        elapsed = d.clock.monotonic() - t0
        for pid in (100, 101, 102, 103):
            fake_process(proc, pid, user=0.97 * elapsed, read_bytes=0)
        fake_process(proc, 200, user=0.1 * 4 * elapsed, read_bytes=0)
        return d.value("gpuwatch_anomaly", gpu="0", uuid=node.gpus[0].uuid, rule="input_bound", severity="warning")
    try:
        tick()
        d.wait_for(tick, timeout=30, what="input_bound on GPU 0")
        status = json.loads(d.get("/api/v1/status")[1])
        found = {a["gpu"]: a for a in status["anomalies"] if a["rule"] == "input_bound"}  # the firing ones
        assert "slurm job 42's 4 processes keep" in found["0"]["summary"]
        assert "of its 4 CPUs busy" in found["0"]["summary"]
        assert "1" not in found
    finally:
        d.stop()


@pytest.fixture
def kubelet(tmp_path):
    """The fake kubelet as a process on a short socket path (unix sockets are limited to 107 bytes)."""
    socket_dir = Path(tempfile.mkdtemp(prefix="gw-kubelet-", dir="/tmp"))
    socket_path, pods = socket_dir / "kubelet.sock", tmp_path / "pods.json"
    pods.write_text("[]")
    process = subprocess.Popen([sys.executable, str(TESTS / "fakekubelet.py"), "--socket", str(socket_path),
                                "--pods", str(pods)], stdin=subprocess.DEVNULL)
    wait_for(socket_path.exists, what="the fake kubelet's socket")
    yield socket_path, pods
    stop_process(process)
    subprocess.run(["rm", "-rf", str(socket_dir)], check=False)


def test_pods_from_the_kubelet_label_whole_gpus_and_mig_devices(tmp_path, kubelet, inproc):
    socket_path, pods = kubelet
    node = fakenvml.FakeNode.h100_mig(2)
    mig = node.gpus[0].mig_devices[1]
    pods.write_text(json.dumps([
        {"namespace": "ml", "name": "train-0", "containers": [
            {"name": "main", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": [node.gpus[1].uuid]}]},
            {"name": "sidecar", "devices": [{"resource_name": "example.com/nic", "device_ids": ["nic0"]}]}]},
        {"namespace": "serve", "name": "infer-7", "containers": [
            {"name": "server", "devices": [{"resource_name": "nvidia.com/mig-3g.40gb", "device_ids": [mig.uuid]}]}]},
    ]))
    d = inproc(node, args=["--collector.kubernetes.socket", str(socket_path)])
    try:
        g0, g1 = (dict(gpu=str(i), uuid=node.gpus[i].uuid) for i in range(2))
        d.wait_value("gpuwatch_gpu_pod_info", 1, namespace="ml", pod="train-0", container="main", **g1)
        d.wait_value("gpuwatch_gpu_pod_info", 1, namespace="serve", pod="infer-7", container="server", **g0)
        assert d.value("gpuwatch_mig_pod_info", gpu_instance=str(mig.gpu_instance), namespace="serve", pod="infer-7",
                       container="server", **g0) == 1
        assert d.value("gpuwatch_gpu_allocated", **g0) == 1 and d.value("gpuwatch_gpu_allocated", **g1) == 1
        assert len([k for k in d.metrics() if k[0] == "gpuwatch_gpu_pod_info"]) == 2  # the NIC is not a GPU
        assert d.value("gpuwatch_collector_success", group="kubernetes") == 1
        pods.write_text(json.dumps([]))  # the pods are deleted: their series go
        d.wait_value("gpuwatch_gpu_pod_info", None, namespace="ml", pod="train-0", container="main", **g1)
        assert d.value("gpuwatch_gpu_allocated", **g1) == 0
        pods.write_text(json.dumps({"pods": [], "fail": "UNAVAILABLE"}))  # the kubelet restarts
        d.wait_value("gpuwatch_collector_errors_total", 1, group="kubernetes", error="kubelet_unavailable")
        assert d.value("gpuwatch_gpu_allocated", **g1) is None  # cannot tell, so absent
    finally:
        d.stop()
