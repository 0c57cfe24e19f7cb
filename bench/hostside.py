"""What the host groups cost: 8 Slurm jobs x 8 GPUs on a fake node (slurm, kubernetes, jobs).

    .venv/bin/python bench/hostside.py [--jobs 8] [--loaders 8] [--seconds 60]

The node: 8 H200s over the fake libnvidia-ml.so.1; a cgroup v2 tree with ``--jobs`` Slurm jobs
(one GPU each through scontrol's GRES: tests/fakes/scontrol; cpu.stat and io.stat as the kernel
writes them), each with one GPU process and ``--loaders`` data-loader processes in a fake /proc that
psutil reads; a fake kubelet (tests/fakekubelet.py,
a real gRPC server) that allocates the same GPUs to 8 pods. Two measurements:

- in-process: gpuwatch.hostside.HostReader over those trees, the first read (it asks scontrol once
  per job: 8 runs of the fake scontrol, a Python script, so slower than Slurm's C binary) and then
  steady reads (scontrol answered from the cache): the CPU time (time.process_time) and wall time of
  one read, and each group's share (its ``collected`` seconds);
- whole process: `gpuwatch run` at 2 s polls with the host groups on, then off
  (--no-collector.slurm --no-collector.kubernetes --no-collector.jobs), both with the slow interval at
  2 s so that the host job runs at every poll and its cost stands out of the noise: CPU from
  /proc/PID/stat minus the fake library's (FAKE_NVML_CPU), per second and per host read. At the
  default 30 s slow interval a node pays 1/15 of that per-read cost every 2 s.

Prints a table and writes bench/out/hostside.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402
from daemon import fake_env, stop_process, wait_for  # noqa: E402
from fakehost import fake_process, proc_stat, scontrol_world, slurm_v2_job  # noqa: E402

OUT = ROOT / "bench" / "out"
SCONTROL = str(ROOT / "tests" / "fakes" / "scontrol")
TICK = os.sysconf("SC_CLK_TCK")


def build(work: Path, jobs: int, loaders: int, node: fakenvml.FakeNode) -> tuple[Path, Path, Path, Path]:
    proc, cgroup = work / "proc", work / "cgroup"
    proc_stat(proc)
    world, pods = {}, []
    for j in range(jobs):
        job_id = 5000 + j
        pids = [10_000 + 100 * j + k for k in range(1 + loaders)]
        for k, pid in enumerate(pids):
            fake_process(proc, pid, user=100.0 + k, system=5.0, iowait=1.0, read_bytes=10**9, write_bytes=10**6,
                         cgroup=f"0::/system.slice/slurmstepd.scope/job_{job_id}/step_0/user/task_0\n")
        job = slurm_v2_job(cgroup, job_id, pids, cpus=f"{8 * j}-{8 * j + 7}")
        (job / "cpu.stat").write_text("usage_usec 1000000000\nuser_usec 900000000\nsystem_usec 100000000\n")
        (job / "io.stat").write_text("259:0 rbytes=9000000000 wbytes=9000000 rios=1 wios=1 dbytes=0 dios=0\n")
        world[str(job_id)] = {"user": "alice", "parts": [{"nodes": "gpu07", "gres": f"gpu:h200:1(IDX:{j % 8})"}]}
        node.gpus[j % len(node.gpus)].add_process(pids[0], 8 * 2**30)
        pods.append({"namespace": "ml", "name": f"train-{j}", "containers": [
            {"name": "main", "devices": [{"resource_name": "nvidia.com/gpu",
                                          "device_ids": [node.gpus[j % len(node.gpus)].uuid]}]}]})
    state = scontrol_world(work / "world.json", world)
    pods_file = work / "pods.json"
    pods_file.write_text(json.dumps(pods))
    return proc, cgroup, state, pods_file


def options(socket_path: Path) -> dict:
    from gpuwatch.config import COLLECTOR_DEFAULTS

    opts = dict(COLLECTOR_DEFAULTS)
    opts.update({"slurm.scontrol": SCONTROL, "slurm.node-name": "gpu07", "kubernetes.socket": str(socket_path)})
    return opts


def in_process(work: Path, proc: Path, cgroup: Path, socket_path: Path, node: fakenvml.FakeNode,
               reads: int) -> dict:
    from gpuwatch.groups import Selection
    from gpuwatch.hostside import HostReader
    from gpuwatch.model import GpuState
    from gpuwatch.testing import identity

    gpus = [GpuState(identity(i, uuid=g.uuid, minor_number=g.minor), {}, True) for i, g in enumerate(node.gpus)]
    reader = HostReader(Selection.of({"slurm", "kubernetes", "jobs"}, options(socket_path)), str(proc), str(cgroup))

    def one() -> tuple[float, float, dict]:
        c0, w0 = time.process_time(), time.perf_counter()
        sample = reader(gpus)
        seconds = {name: s for name, s, _ in sample.collected}
        assert sample.slurm and sample.kubernetes and sample.jobs, sample
        return time.process_time() - c0, time.perf_counter() - w0, seconds

    first = one()
    steady = [one() for _ in range(reads)]
    reader.close()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "first_read_cpu_ms": first[0] * 1e3, "first_read_wall_ms": first[1] * 1e3,
        "steady_read_cpu_ms": mean([s[0] for s in steady]) * 1e3,
        "steady_read_wall_ms": mean([s[1] for s in steady]) * 1e3,
        "steady_group_wall_ms": {g: mean([s[2][g] for s in steady]) * 1e3 for g in ("slurm", "kubernetes", "jobs")},
        "reads": reads,
    }


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def whole_process(work: Path, proc: Path, cgroup: Path, state: Path, socket_path: Path, node: fakenvml.FakeNode,
                  seconds: float, on: bool) -> dict:
    run = work / ("on" if on else "off")
    run.mkdir()
    fx = fakenvml.prepare(run, node)
    env = fake_env(fx)
    env.update(FAKE_NVML_CPU="1", FAKE_SCONTROL_STATE=str(state))
    args = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:0", "--poll.interval", "2",
            "--poll.slow-interval", "2", "--log.level", "warning", "--log.format", "json",
            "--attribution.proc-root", str(proc), "--attribution.cgroup-root", str(cgroup),
            "--collector.slurm.scontrol", SCONTROL, "--collector.slurm.node-name", "gpu07",
            "--collector.kubernetes.socket", str(socket_path)]
    if not on:
        args += ["--no-collector.slurm", "--no-collector.kubernetes", "--no-collector.jobs"]
    daemon = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: fx.counts().get("nvmlDeviceGetTemperatureV", 0) >= 3 * len(node.gpus), 60,
                 "three polls")
        time.sleep(4)  # warm-up: the first host reads (scontrol once per job) are not in the window
        c0, l0, t0 = cpu_of(daemon.pid), fx.library_cpu_seconds(), time.monotonic()
        time.sleep(seconds)  # the measuring window (a benchmark, not a test: nothing waits on a condition here)
        c1, l1, t1 = cpu_of(daemon.pid), fx.library_cpu_seconds(), time.monotonic()
    finally:
        stop_process(daemon)
    own = (c1 - c0) - (l1 - l0)
    return {"seconds": t1 - t0, "cpu_ms_per_s": own / (t1 - t0) * 1e3, "host_reads": (t1 - t0) / 2.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--loaders", type=int, default=8, help="data-loader processes per job besides its GPU process")
    ap.add_argument("--seconds", type=float, default=60.0, help="whole-process window, each run")
    ap.add_argument("--reads", type=int, default=200, help="in-process steady reads")
    ap.add_argument("--out", default=str(OUT / "hostside.json"))
    args = ap.parse_args(argv)
    from fakekubelet import FakeKubelet

    work = Path(tempfile.mkdtemp(prefix="gw-host-", dir="/tmp"))  # short: the kubelet's socket path
    os.environ.update(FAKE_SCONTROL_STATE=str(work / "world.json"))
    try:
        node = fakenvml.FakeNode.h200(8)
        proc, cgroup, state, pods_file = build(work, args.jobs, args.loaders, node)
        socket_path = work / "kubelet.sock"
        with FakeKubelet(str(socket_path), pods=json.loads(pods_file.read_text())):
            inproc = in_process(work, proc, cgroup, socket_path, node, args.reads)
            on = whole_process(work, proc, cgroup, state, socket_path, node, args.seconds, True)
            off = whole_process(work, proc, cgroup, state, socket_path, node, args.seconds, False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_read_ms = (on["cpu_ms_per_s"] - off["cpu_ms_per_s"]) * 2.0
    result = {"jobs": args.jobs, "processes": args.jobs * (1 + args.loaders), "gpus": 8, "in_process": inproc,
              "whole_process": {"on": on, "off": off, "host_read_cpu_ms": per_read_ms,
                                "at_default_30s_ms_per_s": per_read_ms / 30.0},
              "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                          "cpu": platform.processor() or platform.machine()},
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    i = inproc
    print(f"host groups, {args.jobs} jobs x 8 GPUs, {result['processes']} processes, "
          f"fake kubelet with {args.jobs} pods")
    print(f"in-process, one read: first {i['first_read_cpu_ms']:.1f} ms CPU "
          f"({i['first_read_wall_ms']:.1f} ms wall, "
          f"scontrol once per job); steady {i['steady_read_cpu_ms']:.2f} ms CPU "
          f"({i['steady_read_wall_ms']:.2f} ms wall: "
          + ", ".join(f"{g} {ms:.2f}" for g, ms in i["steady_group_wall_ms"].items()) + ")")
    print(f"whole process, 2 s polls, host read every 2 s: {on['cpu_ms_per_s']:.2f} ms CPU/s with the host groups, "
          f"{off['cpu_ms_per_s']:.2f} without: {per_read_ms:.2f} ms per host read, "
          f"{per_read_ms / 30:.3f} ms/s at the default 30 s slow interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
