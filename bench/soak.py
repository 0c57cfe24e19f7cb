"""A day compressed: one `gpuwatch run` process over a fake node while jobs, pods, MIG layouts and XIDs come and go.

    .venv/bin/python bench/soak.py                      # 100,000 polls at 0.05 s (about 85 min)
    .venv/bin/python bench/soak.py --polls 2000         # the same churn, squeezed into 2,000 polls

The node: 8 GPUs over the fake libnvidia-ml.so.1 (tests/fakenvml): six H100s and two H100s in MIG mode
(the capture's four instances each). gpuwatch runs as a real process at ``--poll.interval 0.05`` with the
host groups reading every second (``--poll.slow-interval 1``) from fake trees: a cgroup v2 hierarchy
(tests/fakehost.py), a /proc that psutil reads, the fake ``scontrol`` (tests/fakes/scontrol) and a fake
kubelet (tests/fakekubelet.py, a real gRPC PodResources server in this process). Over the polls:

- ``--jobs`` (1,000) Slurm jobs arrive and leave: each a cgroup with a GPU process and two data loaders
  in /proc, one or two GPUs in scontrol's GRES and the GPU process in NVML's process list;
- ``--pods`` (200) pods arrive and leave: the kubelet's answer, a pod cgroup with one process;
- ``--mig`` (50) MIG reconfigurations: GPU 6 or 7 switches between the four-instance layout and seven
  1g.10gb instances, with NVML's MIG configuration-change event (each GPU twice in a row, so both end
  in the layout they started in);
- ``--xids`` (5,000) XID events, spread over the GPUs and a dozen codes of every severity.

The churn starts after the baseline and ends at 90 % of the polls; the first 10 % of the polls are the
warm-up. Measured from /proc every ``--sample`` seconds: VmRSS and its RssAnon and RssFile, RssAnon split by
where it lives (/proc/PID/smaps), threads (/proc/PID/task), open file descriptors (/proc/PID/fd); from
/metrics: the series count (sample lines). The checks:

- resident memory at the end at most ``--rss-growth-mb`` (2 MB) above what it was after the warm-up: medians
  of the samples over a tenth of the polls each, right after the warm-up and at the end (after the churn),
  since it moves by several MB between samples (the rules' history is trimmed in chunks); of RssAnon, the
  memory gpuwatch allocated (VmRSS adds RssFile, the libraries' pages, which the kernel drops and maps back
  as it likes: VmRSS is reported beside it); the least-squares slope after the warm-up is reported too;
- threads: gRPC's flat after the warm-up (max == min, by name), gpuwatch's own at most their design's
  bound (OWN_THREADS_MAX: APScheduler's pool starts a worker, up to one per job, the first time all jobs
  overlap); descriptors flat (max == min), not counting the pipes to a child that is running (scontrol);
  each sample the least of four reads 100 ms apart, so that a scrape's socket open at one instant does
  not count);
- the series count back to its baseline once every job and pod is gone (waited for, with a deadline);
- no internal error: no log line at level error or above, none saying "a gpuwatch bug", no line that
  is not JSON (a traceback), no ``error="internal"`` in gpuwatch_collector_errors_total or
  gpuwatch_poll_errors_total.

What the daemon saw is counted from its side: the XIDs from gpuwatch_xid_events_total, the MIG
reconfigurations from its ``mig_config_changed`` log events, the jobs and pods from the job and pod ids
that /metrics named (gpuwatch_gpu_job_info, gpuwatch_gpu_pod_info) at the scrapes.

The baseline: before the churn every XID code the soak uses is sent once to every GPU (a code's series
appears with its first event and stays: a counter), so the baseline has them. Writes bench/out/soak.json
and exits 1 naming the checks that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402
from daemon import fake_env, parse, stop_process, wait_for  # noqa: E402
from fakehost import fake_process, pod_v2, proc_stat, slurm_v2_job  # noqa: E402

from gpuwatch.web.server import KEPT_WORKERS  # noqa: E402

OUT = ROOT / "bench" / "out"
SCONTROL = str(ROOT / "tests" / "fakes" / "scontrol")
NODE_NAME = "gpu07"
MIB = 2**20
MIG_GPUS = (6, 7)
FULL_GPUS = tuple(range(6))
# a dozen codes of every severity (gpuwatch/groups/xid.py): application, warning, critical, info
XID_CODES = (13, 31, 43, 45, 63, 92, 94, 48, 74, 79, 95, 119)
KEEP_XIDS = 64  # per GPU in the state file: the older ones were delivered long ago


# -- processes ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


ARENA_SPAN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread's malloc arena starts on a 64 MiB boundary


def anon_parts(pid: int) -> dict[str, int]:
    """The anonymous resident memory of ``pid`` by where it lives, in bytes, from /proc/PID/smaps: ``heap``
    (malloc's main arena, grown by brk), ``thread_arenas`` (malloc's per-thread arenas: anonymous mappings on a
    64 MiB boundary), ``other`` (Python's 1 MiB object arenas, malloc's mmap'd large blocks, thread stacks) and
    ``other_maps`` (how many such mappings: Python's arenas come and go one mapping at a time) and ``named``
    (the stack, and the pages of mapped files written to: a library's relocated data). Their sum is RssAnon."""
    parts = {"heap": 0, "thread_arenas": 0, "other": 0, "other_maps": 0, "named": 0}
    kind = None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps", "rb") as f:
        for raw in f:
            head = raw.split(None, 6)
            if head and b"-" in head[0] and not head[0].endswith(b":"):  # a mapping's first line
                start = int(head[0].split(b"-")[0], 16)
                name = head[5].strip() if len(head) > 5 else b""
                kind = ("heap" if name == b"[heap]" else "named" if name else
                        "thread_arenas" if start % ARENA_SPAN == 0 else "other")
                if kind == "other" and b"w" in head[1]:
                    parts["other_maps"] += 1
            elif kind and head and head[0] == b"Anonymous:":
                parts[kind] += int(head[1]) * 1024
    return parts


def _fd_links(pid: int | str) -> list[str]:
    """What each open descriptor of ``pid`` is ("pipe:[123]", "socket:[45]", a path); [] once it is gone."""
    links = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed since the listing
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def open_fds(pid: int) -> int:
    """``pid``'s open descriptors, less its ends of the pipes that a running child of it holds too (the
    children from /proc/PID/task/TID/children, CONFIG_PROC_CHILDREN: without it none is left out)."""
    children = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                children += Path(f"/proc/{pid}/task/{task}/children").read_text().split()
    to_children = {link for child in children for link in _fd_links(child) if link.startswith("pipe:")}
    return sum(link not in to_children for link in _fd_links(pid))


def proc_figures(pid: int) -> dict:
    """VmRSS (and its RssAnon and RssFile parts), threads and open file descriptors of ``pid``. Threads and
    descriptors are the least of four reads 100 ms apart: a scrape's socket that is open at the instant of
    one read is not what stays open (a leak is in all four reads). Descriptors leave out the pipes to a
    child that is running (scontrol, asked once per job: with --polls 2000's thousand jobs in 90 s one runs
    most of the time); a pipe left when its child has ended counts."""
    rss = None
    parts: dict[str, int] = {}  # RssAnon (the heaps: Python's arenas, malloc's), RssFile (mapped files), in bytes
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith(("RssAnon:", "RssFile:")):
            parts[line.split(":")[0]] = int(line.split()[1]) * 1024
    reads = []
    for k in range(4):
        if k:
            time.sleep(0.1)
        reads.append((len(os.listdir(f"/proc/{pid}/task")), open_fds(pid)))
    names: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):  # what the threads are: Python's, gRPC's (event_engine, ...)
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            names[name] = names.get(name, 0) + 1
    return {"rss_bytes": rss, "rss_anon_bytes": parts.get("RssAnon"), "rss_file_bytes": parts.get("RssFile"),
            "anon": anon_parts(pid),
            "threads": min(t for t, _ in reads), "fds": min(f for _, f in reads),
            "threads_max_read": max(t for t, _ in reads), "fds_max_read": max(f for _, f in reads),
            "thread_names": dict(sorted(names.items()))}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour (0 with fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var * 3600


# -- the schedule ---------------------------------------------------------------------------------
def schedule(polls: int, start: int, end: int, jobs: int, pods: int, migs: int, xids: int,
             seed: int = 1) -> list[tuple[int, str, int]]:
    """(poll, kind, n) events between polls ``start`` and ``end``, sorted: "job+"/"job-", "pod+"/"pod-",
    "mig", "xid". Arrivals are spread evenly over the span; each job lives ~1/100 of it (at least 40
    polls), each pod ~1/25; every departure is at or before ``end``."""
    rng = random.Random(seed)
    span = max(1, end - start)
    events: list[tuple[int, str, int]] = []

    def arrivals(kind: str, count: int, life: int) -> None:
        life = max(40, life)
        for n in range(count):
            at = start + (span - life) * n // max(1, count)
            stay = rng.randint(life // 2, life * 3 // 2)
            events.append((at, kind + "+", n))
            events.append((min(end, at + stay), kind + "-", n))

    arrivals("job", jobs, span // 100)
    arrivals("pod", pods, span // 25)
    for n in range(migs):
        events.append((start + span * (n + 1) // (migs + 1), "mig", n))
    for n in range(xids):
        events.append((start + span * n // max(1, xids), "xid", n))
    order = {"job-": 0, "pod-": 0, "mig": 1, "xid": 2, "job+": 3, "pod+": 3}
    events.sort(key=lambda e: (e[0], order[e[1]], e[2]))
    return events


# -- the fake host ------------------------------------------------------------------------------------
def mig_layout(gpu: int, seven: bool) -> dict[int, fakenvml.FakeMig]:
    """Seven 1g.10gb instances (GPU instances 7-13) or the profile's four (3g, 2g, 1g, 1g)."""
    if not seven:
        return fakenvml.make_gpu("h100-mig", gpu).mig_devices
    return {slot: fakenvml.FakeMig(gpu_instance=7 + slot, compute_instance=0, total=9984 * MIB, used=0,
                                   uuid=f"MIG-{gpu:04x}{slot:04x}-7777-7777-7777-{gpu * 16 + slot:012x}",
                                   name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", gpm={2: 0.0, 5: 0.0, 10: 0.0})
            for slot in range(7)}


class Kubelet:
    """tests/fakekubelet.py as a process of its own (gRPC in this process would not survive the fork that
    starts gpuwatch: "epoll_wait error: Bad file descriptor", SIGABRT), answering from a pods file."""

    def __init__(self, work: Path) -> None:
        self.socket_path = work / "kubelet.sock"
        self.pods_path = work / "pods.json"
        self.set_pods([])
        self.log = open(work / "kubelet.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakekubelet.py"), "--socket",
                                      str(self.socket_path), "--pods", str(self.pods_path)],
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        wait_for(lambda: self.socket_path.exists(), 60, "the fake kubelet's socket")

    def set_pods(self, pods: list[dict]) -> None:
        tmp = self.pods_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pods))
        os.replace(tmp, self.pods_path)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


class Host:
    """The fake node and host trees, changed by the schedule's events."""

    def __init__(self, work: Path, kubelet: Kubelet) -> None:
        self.work = work
        self.proc, self.cgroup = work / "proc", work / "cgroup"
        proc_stat(self.proc)
        # the hierarchies exist before any job: Slurm and Kubernetes are there, with nothing on the node
        (self.cgroup / "system.slice" / "slurmstepd.scope").mkdir(parents=True)
        (self.cgroup / "kubepods.slice" / "kubepods-burstable.slice").mkdir(parents=True)
        (self.cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        self.node = fakenvml.FakeNode.from_profiles(["h100"] * len(FULL_GPUS) + ["h100-mig"] * len(MIG_GPUS))
        self.fx = fakenvml.prepare(work, self.node)
        self.world_path = work / "world.json"
        self.world: dict = {"nodes": {}, "jobs": {}}
        self.kubelet = kubelet
        self.pods: dict[int, dict] = {}
        self.jobs: dict[int, tuple[list[int], list[int]]] = {}  # n -> (pids, gpus)
        self.seven = dict.fromkeys(MIG_GPUS, False)
        self.rng = random.Random(2)
        self.sent = {"jobs": 0, "pods": 0, "mig": 0, "xids": 0}
        self._write_world()

    def _write_world(self) -> None:
        tmp = self.world_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.world))
        os.replace(tmp, self.world_path)

    def write(self) -> None:
        for g in self.node.gpus:
            del g.xids[:-KEEP_XIDS]
        self.fx.write(self.node)

    def apply(self, kind: str, n: int) -> None:
        getattr(self, kind.replace("+", "_add").replace("-", "_remove"))(n)

    def job_add(self, n: int) -> None:
        job_id = 100_000 + n
        gpus = sorted(self.rng.sample(FULL_GPUS, self.rng.choice((1, 1, 2))))
        pids = [200_000 + 10 * n + k for k in range(3)]
        path = f"/system.slice/slurmstepd.scope/job_{job_id}/step_0/user/task_0"
        for k, pid in enumerate(pids):
            fake_process(self.proc, pid, user=10.0 + k, system=1.0, iowait=0.5, read_bytes=10**6, write_bytes=10**3,
                         start_ticks=5000 + n, cgroup=f"0::{path}\n")
        job = slurm_v2_job(self.cgroup, job_id, pids, cpus=f"{8 * gpus[0]}-{8 * gpus[0] + 7}")
        (job / "cpu.stat").write_text(f"usage_usec {n * 1000}\nuser_usec {n * 900}\nsystem_usec {n * 100}\n")
        (job / "io.stat").write_text("259:0 rbytes=9000 wbytes=90 rios=1 wios=1 dbytes=0 dios=0\n")
        idx = ",".join(map(str, gpus))
        self.world["jobs"][str(job_id)] = {"user": f"user{n % 50}", "uid": 2000 + n % 50,
                                           "parts": [{"nodes": NODE_NAME, "gres": f"gpu:h100:{len(gpus)}(IDX:{idx})"}]}
        self._write_world()
        for g in gpus:
            self.node.gpus[g].add_process(pids[0], 4 * 2**30)
        self.jobs[n] = (pids, gpus)
        self.sent["jobs"] += 1
        self.write()

    def job_remove(self, n: int) -> None:
        pids, gpus = self.jobs.pop(n)
        for g in gpus:
            gpu = self.node.gpus[g]
            gpu.compute_processes = [p for p in gpu.compute_processes if p[0] != pids[0]]
        self.write()
        job_id = 100_000 + n
        shutil.rmtree(self.cgroup / "system.slice" / "slurmstepd.scope" / f"job_{job_id}")
        for pid in pids:
            shutil.rmtree(self.proc / str(pid))
        self.world["jobs"].pop(str(job_id))
        self._write_world()

    def pod_add(self, n: int) -> None:
        uid = f"0000{n:04x}-aaaa-bbbb-cccc-{n:012x}"
        gpu = self.node.gpus[self.rng.choice(FULL_GPUS)]
        pid = 300_000 + n
        path = pod_v2(self.cgroup, uid, [pid])
        fake_process(self.proc, pid, user=5.0, system=0.5, start_ticks=7000 + n,
                     cgroup=f"0::/{path.relative_to(self.cgroup)}/cri-containerd-{'ab' * 32}.scope\n")
        self.pods[n] = {"namespace": "soak", "name": f"serve-{n}", "uid": uid, "pid": pid, "containers": [
            {"name": "main", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": [gpu.uuid]}]}]}
        self.kubelet.set_pods(list(self.pods.values()))
        self.sent["pods"] += 1

    def pod_remove(self, n: int) -> None:
        pod = self.pods.pop(n)
        self.kubelet.set_pods(list(self.pods.values()))
        shutil.rmtree(self.cgroup / "kubepods.slice" / "kubepods-burstable.slice"
                      / f"kubepods-burstable-pod{pod['uid'].replace('-', '_')}.slice")
        shutil.rmtree(self.proc / str(pod["pid"]))

    def mig(self, n: int) -> None:
        gpu = MIG_GPUS[(n // 2) % len(MIG_GPUS)]
        self.seven[gpu] = not self.seven[gpu]
        self.node.gpus[gpu].mig_devices = mig_layout(gpu, self.seven[gpu])
        self.node.add_event(gpu, fakenvml.EVENT_MIG_CONFIG)
        self.node.gpus[gpu].events[:] = self.node.gpus[gpu].events[-KEEP_XIDS:]
        self.sent["mig"] += 1
        self.write()

    def xid(self, n: int) -> None:
        self.node.add_xid(n % len(self.node.gpus), XID_CODES[(n * 7 + n // 8) % len(XID_CODES)])
        self.sent["xids"] += 1
        self.write()


# -- the daemon's side ------------------------------------------------------------------------------------
class Daemon:
    def __init__(self, host: Host, work: Path, interval: float, socket_path: Path, extra: list[str]) -> None:
        self.host = host
        env = fake_env(host.fx)
        env.update(FAKE_SCONTROL_STATE=str(host.world_path))
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env.pop("GPUWATCH_ATTRIBUTION_CGROUP_ROOT", None)
        env.pop("GPUWATCH_COLLECTOR_KUBERNETES_SOCKET", None)
        env.pop("GPUWATCH_COLLECTOR_SLURM_SCONTROL", None)
        self.log_path = work / "gpuwatch.log"
        argv = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:0",
                "--poll.interval", str(interval), "--poll.slow-interval", "1",
                "--log.level", "info", "--log.format", "json",
                "--attribution.proc-root", str(host.proc), "--attribution.cgroup-root", str(host.cgroup),
                "--collector.slurm.scontrol", SCONTROL, "--collector.slurm.node-name", NODE_NAME,
                "--collector.kubernetes.socket", str(socket_path), *extra]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        started = wait_for(self._started, 120, "gpuwatch to listen")
        self.base = f"http://{started['listen'][0]}"
        self._read_at = 0
        self.events: dict[str, int] = {}
        self.bad_lines: list[str] = []

    def _started(self) -> dict | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"gpuwatch exited with {self.proc.returncode}: see {self.log_path}")
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "started":
                    return event
        return None

    def polls(self) -> int:
        return self.host.fx.counts().get("nvmlDeviceGetTemperatureV", 0) // len(self.host.node.gpus)

    def metrics(self) -> tuple[int, dict]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as response:
            body = response.read().decode()
        series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
        return series, parse(body)

    def scan_log(self) -> None:
        """Count the log's events; keep every line that is an internal error (or not JSON at all)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._read_at)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self._read_at += cut
        for raw in data[:cut].splitlines():
            line = raw.decode(errors="replace")
            try:
                event = json.loads(line)
            except ValueError:
                self.bad_lines.append(line)
                continue
            name = str(event.get("event"))
            self.events[name] = self.events.get(name, 0) + 1
            if str(event.get("level", "")).lower() in ("error", "critical", "exception") or "gpuwatch bug" in line:
                self.bad_lines.append(line)

    def stop(self) -> int:
        rc = stop_process(self.proc)
        self._log.close()
        return rc


def internal_errors(m: dict) -> dict[str, float]:
    return {f"{name}{dict(labels)}": v for (name, labels), v in m.items()
            if name in ("gpuwatch_collector_errors_total", "gpuwatch_poll_errors_total")
            and dict(labels).get("error") == "internal" and v}


# -- the run ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    polls = args.polls
    warm = polls // 10 if args.warm_up is None else args.warm_up
    work = Path(tempfile.mkdtemp(prefix="gw-soak-", dir="/tmp"))  # short: the kubelet's socket path
    kubelet = Kubelet(work)
    socket_path = kubelet.socket_path
    host = Host(work, kubelet)
    extra = [] if args.rules_window is None else ["--rules.window", str(args.rules_window)]
    daemon = Daemon(host, work, args.interval, socket_path, extra)
    samples: list[dict] = []
    seen_jobs: set[str] = set()
    seen_pods: set[str] = set()
    t0 = time.monotonic()
    result: dict = {}
    try:
        # the baseline: every XID code once on every GPU, then a quiet node (no job, no pod)
        for code in XID_CODES:
            for g in range(len(host.node.gpus)):
                host.node.add_xid(g, code)
                host.sent["xids"] += 1
        host.write()
        seeded = host.sent["xids"]

        def xids_counted() -> float:
            return sum(v for (name, _), v in daemon.metrics()[1].items() if name == "gpuwatch_xid_events_total")

        wait_for(lambda: xids_counted() >= seeded, 120, "the seeded XIDs")
        wait_for(lambda: daemon.polls() >= 40, 120, "40 polls")
        # every tier, the host groups and the rules (every 4 s) have made their series: the count held still
        # for 10 s (a baseline taken at poll 40 once missed 16 series that came a little later)
        steady: list[tuple[float, int]] = []

        def settled() -> int | None:
            if steady and time.monotonic() - steady[-1][0] < 1.0:  # a scrape a second, not one per wait_for try
                return None
            steady.append((time.monotonic(), daemon.metrics()[0]))
            held = [n for t, n in steady if t >= steady[-1][0] - 10]
            return steady[-1][1] if steady[-1][0] - steady[0][0] >= 10 and len(set(held)) == 1 else None

        baseline = wait_for(settled, 180, "a steady series count")
        start = daemon.polls()
        end = max(start + 100, polls * 9 // 10)
        events = schedule(polls, start, end, args.jobs, args.pods, args.mig, max(0, args.xids - seeded))
        print(f"baseline {baseline} series at poll {start}; {len(events)} events until poll {end} of {polls}",
              flush=True)
        next_sample = 0.0
        i = 0
        while True:
            done = daemon.polls()
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"gpuwatch exited with {daemon.proc.returncode}: see {daemon.log_path}")
            while i < len(events) and events[i][0] <= done:
                _, kind, n = events[i]
                host.apply(kind, n)
                i += 1
            now = time.monotonic()
            if now >= next_sample or done >= polls:
                next_sample = now + args.sample
                figures = proc_figures(daemon.proc.pid)
                series, m = daemon.metrics()
                for (name, labels), _v in m.items():
                    if name == "gpuwatch_gpu_job_info":
                        seen_jobs.add(dict(labels).get("job_id", ""))
                    elif name == "gpuwatch_gpu_pod_info":
                        seen_pods.add(dict(labels).get("pod", ""))
                daemon.scan_log()
                samples.append({"t": round(now - t0, 1), "poll": done, "series": series, **figures})
                if len(samples) % 20 == 0:
                    print(f"{samples[-1]} jobs {len(host.jobs)} pods {len(host.pods)} events {i}/{len(events)}",
                          flush=True)
            if done >= polls and i >= len(events):
                break
            time.sleep(0.05)
        end_figures = proc_figures(daemon.proc.pid)
        # every job and pod is gone: the series count comes back (the host groups read every second)
        back = None
        with contextlib.suppress(AssertionError):
            back = wait_for(lambda: daemon.metrics()[0] == baseline or None, args.settle, "the baseline series")
        final_series, final = daemon.metrics()
        daemon.scan_log()
        after = [s for s in samples if s["poll"] >= warm]
        at_warm = after[0] if after else samples[-1]
        # RSS moves by several MB from one sample to the next (the rules' history is trimmed in chunks, the
        # collector runs): the figures compared are medians over a tenth of the polls, right after the
        # warm-up and at the end (after the churn). RssAnon is the check: what gpuwatch allocated. RssFile (the
        # libraries' pages mapped) is the kernel's to drop and bring back (a reclaim of the page cache took 12 MB
        # of it from both soaks of 2026-12-05 at once): it would hide growth, or be taken for it. VmRSS (both)
        # is reported beside it.
        early = [s for s in after if s["poll"] < warm + polls // 10] or [at_warm]
        late = [s for s in after if s["poll"] >= polls * 9 // 10] or [end_figures]
        compared = [len(early), len(late)]
        early_anon, late_anon = (median([s["rss_anon_bytes"] for s in part]) for part in (early, late))
        early_rss, late_rss = (median([s["rss_bytes"] for s in part]) for part in (early, late))
        xids_seen = sum(v for (name, _), v in final.items() if name == "gpuwatch_xid_events_total")
        result = {
            "polls": polls, "polls_done": daemon.polls(), "interval_s": args.interval,
            "seconds": round(time.monotonic() - t0, 1), "warm_up_polls": warm,
            "rss_mb": {"warm_up": early_anon / 1e6, "end": late_anon / 1e6, "growth": (late_anon - early_anon) / 1e6,
                       "of": "RssAnon", "samples_compared": compared,
                       "first_after_warm_up": at_warm["rss_anon_bytes"] / 1e6,
                       "last": end_figures["rss_anon_bytes"] / 1e6,
                       "min_after_warm_up": min(s["rss_anon_bytes"] for s in after) / 1e6 if after else None,
                       "max_after_warm_up": max(s["rss_anon_bytes"] for s in after) / 1e6 if after else None,
                       "slope_mb_per_hour_after_warm_up": slope_per_hour([(s["t"], s["rss_anon_bytes"] / 1e6)
                                                                          for s in after])},
            "vmrss_mb": {"warm_up": early_rss / 1e6, "end": late_rss / 1e6, "growth": (late_rss - early_rss) / 1e6,
                         "last": end_figures["rss_bytes"] / 1e6},
            "threads": {"warm_up": at_warm["threads"], "end": end_figures["threads"],
                        "min": min(s["threads"] for s in after), "max": max(s["threads"] for s in after),
                        "max_single_read": max(s["threads_max_read"] for s in after)},
            "fds": {"warm_up": at_warm["fds"], "end": end_figures["fds"],
                    "min": min(s["fds"] for s in after), "max": max(s["fds"] for s in after),
                    "max_single_read": max(s["fds_max_read"] for s in after)},
            # the least of the reads' names is not kept per name: a sample's names whose total is its least count
            "samples_after_warm_up_names": [s["thread_names"] for s in after if sum(s["thread_names"].values())
                                            == s["threads"]],
            "series": {"baseline": baseline, "peak": max(s["series"] for s in samples), "end": final_series,
                       "back_to_baseline": bool(back)},
            "sent": host.sent,
            "seen_by_daemon": {"xids": xids_seen, "mig_config_changed": daemon.events.get("mig_config_changed", 0),
                               "jobs": len(seen_jobs - {""}), "pods": len(seen_pods - {""})},
            "internal_errors": {"log_lines": daemon.bad_lines[:20], "log_line_count": len(daemon.bad_lines),
                                "metrics": internal_errors(final)},
            "log_events": dict(sorted(daemon.events.items(), key=lambda kv: -kv[1])[:30]),
            "samples": samples,
        }
    finally:
        rc = daemon.stop()
        kubelet.stop()
        result["exit_code"] = rc
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            result["workdir"] = str(work)
    return result


# gpuwatch's own threads (Python's: /proc/PID/task/*/comm says "python" on Python 3.11; newer ones name
# them): the main thread, APScheduler's scheduler thread, the events thread, one HTTP server thread per
# listen address (one here), and the scheduler's pool, which starts a worker only when every one it has is
# busy, up to one per job (gpuwatch.poller.Poller.jobs() with the host groups on: fast, slow, host). The
# pool reaches its size the first time all jobs overlap, at any time: a bound, not growth. And the HTTP
# listener's connection threads that wait for the next scrape (gpuwatch.web.server.KEPT_WORKERS: one while
# the scrapes come one at a time, up to 4 after scrapes overlapped).
OWN_THREADS_MAX = 4 + 3 + KEPT_WORKERS


def thread_checks(names_after_warm_up: list[dict[str, int]]) -> list[str]:
    """Threads after the warm-up: every kind that is not gpuwatch's own (gRPC's event engine, timer,
    lifeguard) the same count in every sample; gpuwatch's own at most OWN_THREADS_MAX (a thread that leaked
    per request, job or poll would pass it within minutes)."""
    failed = []
    own = [sum(n for name, n in sample.items() if name == "python" or name.startswith(("Thread", "gpuwatch")))
           for sample in names_after_warm_up]
    if own and max(own) > OWN_THREADS_MAX:
        failed.append(f"{max(own)} gpuwatch threads after the warm-up, more than its {OWN_THREADS_MAX}")
    kinds = {name for sample in names_after_warm_up for name in sample
             if not (name == "python" or name.startswith(("Thread", "gpuwatch")))}
    for name in sorted(kinds):
        counts = [sample.get(name, 0) for sample in names_after_warm_up]
        if max(counts) != min(counts):
            failed.append(f"threads {name!r} not flat after the warm-up: {min(counts)}..{max(counts)}")
    return failed


def checks(r: dict, rss_growth_mb: float) -> list[str]:
    failed = []
    if r["rss_mb"]["growth"] > rss_growth_mb:
        failed.append(f"RssAnon grew {r['rss_mb']['growth']:.2f} MB after the warm-up (at most {rss_growth_mb})")
    if r["fds"]["max"] != r["fds"]["min"]:
        failed.append(f"fds not flat after the warm-up: {r['fds']['min']}..{r['fds']['max']}")
    failed.extend(thread_checks(r["samples_after_warm_up_names"]))
    if not r["series"]["back_to_baseline"]:
        failed.append(f"series {r['series']['end']} at the end, baseline {r['series']['baseline']}")
    if r["internal_errors"]["log_line_count"] or r["internal_errors"]["metrics"]:
        failed.append(f"internal errors: {r['internal_errors']['log_line_count']} log lines "
                      f"{r['internal_errors']['log_lines'][:3]}, metrics {r['internal_errors']['metrics']}")
    if r["polls_done"] < r["polls"]:
        failed.append(f"{r['polls_done']} polls of {r['polls']}")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--polls", type=int, default=100_000)
    ap.add_argument("--interval", type=float, default=0.05, help="gpuwatch's --poll.interval, seconds")
    ap.add_argument("--rules-window", type=float, default=None,
                    help="gpuwatch's --rules.window (default: its own, 300 s; the warm-up should be longer, "
                         "the history fills over it)")
    ap.add_argument("--warm-up", type=int, default=None, help="polls of warm-up (default: a tenth of --polls)")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--mig", type=int, default=50, help="MIG reconfigurations (even: the layouts end as they began)")
    ap.add_argument("--xids", type=int, default=5000)
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples of /proc and /metrics")
    ap.add_argument("--settle", type=float, default=120.0, help="seconds to wait for the baseline series at the end")
    ap.add_argument("--rss-growth-mb", type=float, default=2.0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (trees, log) under /tmp")
    ap.add_argument("--out", default=str(OUT / "soak.json"))
    args = ap.parse_args(argv)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    r = run(args)
    r.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), argv=sys.argv[1:],
             machine={"python": platform.python_version(), "cpus": os.cpu_count(),
                      "cpu": platform.processor() or platform.machine()})
    failed = checks(r, args.rss_growth_mb) if "rss_mb" in r else ["the soak did not finish"]
    r["failed"] = failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1))
    if "rss_mb" in r:
        print(f"polls {r['polls_done']} in {r['seconds']:.0f} s; RssAnon {r['rss_mb']['warm_up']:.2f} MB after the "
              f"warm-up, {r['rss_mb']['end']:.2f} MB at the end ({r['rss_mb']['growth']:+.2f} MB; VmRSS "
              f"{r['vmrss_mb']['warm_up']:.2f} -> {r['vmrss_mb']['end']:.2f}); threads "
              f"{r['threads']['min']}..{r['threads']['max']}, fds {r['fds']['min']}..{r['fds']['max']}; series "
              f"baseline {r['series']['baseline']}, peak {r['series']['peak']}, end {r['series']['end']}")
        print(f"sent {r['sent']}; seen by the daemon {r['seen_by_daemon']}")
    for f in failed:
        print("FAIL:", f)
    print("PASS" if not failed else "FAILED", "->", args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
