"""gpuwatch beside nvitop-exporter: whole processes, the same fake node, one run.

    .venv/bin/python bench/bench.py            # HGX and PCIe nodes, 8 and 64 GPUs, both cadences, both exporters
    .venv/bin/python bench/bench.py --quick    # the same, shorter windows (~35 min)
    .venv/bin/python bench/bench.py --gpus 8 --nodes pcie --only gpuwatch
    .venv/bin/python bench/bench.py --gpus 8 --cadence 2 --window 150   # one cadence, longer windows
    .venv/bin/python bench/bench.py --paired ...   # both exporters at once, their CPU in the same windows

Each exporter is installed by the benchmark into a virtual environment of its own under bench/out/
(gpuwatch from this working tree with `pip install .`, runtime dependencies only, as a user gets it;
nvitop-exporter from PyPI), never into the project's. Both run as real processes over the fake
libnvidia-ml.so.1 of tests/fakenvml with the same node (an HGX H200 node, then a PCIe L40S node), one
after the other (``--paired``: at once, each over a fake node of its own, so that the CPU windows whose ratio
is the target are the same seconds of the VM, whose neighbours move either exporter's figure by a fifth from
one window to the next), and are measured the same way:

- CPU per GPU per poll: the process's utime + stime over the measuring window (the figure /proc/PID/stat
  gives, read in nanoseconds through the process's CPU clock rather than in its 10 ms ticks; the ticks are
  recorded beside it as ``cpu_s_stat``), minus the CPU time its threads spent inside the fake library (the
  library sums it itself: FAKE_NVML_CPU), divided by the polls made (nvmlDeviceGetTemperatureV calls, once
  per GPU and poll for both) and the GPUs. Everything the process does is in: polling, rules, rendering the scrapes,
  timers, threads, the HTTP server. A scraper thread asks for /metrics at the cadence's scrape
  interval with Prometheus' headers (OpenMetrics preferred, gzip) over one connection kept open, as
  Prometheus keeps it (an exporter that closes each connection gets a new one per scrape);
- resident memory (VmRSS) after at least 300 polls (10 minutes' worth at gpuwatch's default 2 s;
  gpuwatch keeps its default 300 s rule history, which at 0.5 s polls holds twice the samples it does
  at 2 s: the figure is on the high side);
- /metrics latency alone (sequential requests) and with 20 concurrent scrapers, and its size, each request
  on a connection of its own (the connect included: the worst case).

Readings: "steady" as the fake node has them (they stay put between polls, as an idle GPU's mostly
do), then "changing" at every poll (Changer: power, temperatures, utilization, clocks, memory in use,
energy), each CPU window measured both ways.

Cadences: polls every 0.5 s with a scrape a second, and every 2 s with a scrape every 15 s
(Prometheus' default). Results: a table per GPU count, bench/out/results.json; docs/performance.md
says what the figures mean. Every child process dies with the benchmark (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import http.client
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402
from daemon import wait_for  # noqa: E402  (tests/daemon.py: poll a condition with a deadline)

OUT = ROOT / "bench" / "out"
PEER = "nvitop-exporter==1.7.2"
CADENCES = ((0.5, 1.0), (2.0, 15.0))  # (poll interval, scrape interval), seconds
# The node kinds: an HGX H200 node (18 NVLinks per GPU, GPM, a fabric), where the peer reads NVLink per link,
# and a PCIe L40S node without NVLink or GPM, where it is cheapest.
NODES = {"hgx": ("H200 HGX", fakenvml.FakeNode.h200), "pcie": ("L40S PCIe", fakenvml.FakeNode.l40s)}
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
}
TICKS = os.sysconf("SC_CLK_TCK")
# Targets (issue 9): gpuwatch's CPU per GPU per poll at most a third of nvitop-exporter's; RSS and latency.
TARGETS = {"cpu_ratio": 1 / 3, "rss_mb": {8: 35.0, 64: 45.0}, "p99_ms": {8: 2.0, 64: 10.0},
           "concurrent_p99_ms": {64: 25.0}}

_children: list[subprocess.Popen] = []


# -- processes ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, **kw)
    _children.append(proc)
    return proc


def reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc in _children:
        _children.remove(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv(name: str, requirement: str) -> Path:
    """bench/out/<name>/bin/python with ``requirement`` installed (made once, reused)."""
    path = OUT / name
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
                       check=True)
    return python


# -- the exporters ----------------------------------------------------------------------------------
def process_cpu_clock(pid: int) -> int | None:
    """The clock id of process ``pid``'s CPU time (clock_getcpuclockid(3)), None where there is none."""
    clock = ctypes.c_int()
    try:
        rc = ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock))
    except (OSError, AttributeError):
        return None
    return clock.value if rc == 0 else None


class Exporter:
    """One exporter process over a fake node of its own, and what /proc says about it."""

    def __init__(self, name: str, argv: list[str], port: int, fx: fakenvml.FakeNvmlEnv, workdir: Path) -> None:
        self.name, self.port, self.fx = name, port, fx
        self.node: fakenvml.FakeNode | None = None
        env = {k: v for k, v in fx.env.items() if not k.startswith("GPUWATCH_")}
        env.update(FAKE_NVML_CPU="1", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        self.log = open(workdir / f"{name}.log", "w")
        self.proc = spawn(argv, env, stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
        self._cpu_clock = process_cpu_clock(self.proc.pid)
        wait_for(lambda: self._answers(), 60, f"{name} to serve /metrics")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.log.name}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            return self.get()[0] == 200
        return False

    def get(self, headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
        """(status, body, seconds from connect to the last byte) of one GET /metrics on a new connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            t0 = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers or {})
            response = conn.getresponse()
            body = response.read()
            return response.status, body, time.perf_counter() - t0
        finally:
            conn.close()

    def cpu_seconds(self) -> float:
        """The process's utime + stime, every thread's, those that exited included, in nanoseconds: the figure
        /proc/PID/stat gives in 10 ms ticks (``stat_cpu_seconds``; the kernel derives both from the same sum
        of the threads' run times), read through the process's CPU clock. A 45 s window at 2 s polls holds
        about 35 ms of gpuwatch's own CPU at 8 GPUs: 3.5 ticks, too coarse for a ratio."""
        clock = self._cpu_clock
        if clock is None:
            return self.stat_cpu_seconds()
        return time.clock_gettime(clock)

    def stat_cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
        raise RuntimeError("no VmRSS")

    def counters(self) -> tuple[int, float]:
        """(nvmlDeviceGetTemperatureV calls, CPU seconds inside the library)."""
        return self.fx.counts().get("nvmlDeviceGetTemperatureV", 0), self.fx.library_cpu_seconds()

    def pause(self) -> None:
        """Stop the process where it is (SIGSTOP): it takes no CPU until ``resume``."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a stopped process does not act on SIGTERM until it runs again
        reap(self.proc)
        self.log.close()


def change(node: fakenvml.FakeNode, rng: Any, period: float) -> None:
    """One step of a busy node's readings (Changer; bench/instr.py's --changing): power, temperatures,
    utilization, graphics/SM clocks and memory in use new, energy accumulated over ``period`` seconds."""
    for gpu in node.gpus:
        watts = rng.uniform(300.0, 690.0)
        gpu.power_mw = int(watts * 1000)
        gpu.energy_mj = (gpu.energy_mj or 0) + int(watts * 1000 * period)
        gpu.temperature = rng.randint(55, 75)
        if gpu.memory_temperature is not None:
            gpu.memory_temperature = rng.randint(50, 70)
        if gpu.margin_temperature is not None:
            gpu.margin_temperature = 87 - gpu.temperature
        gpu.utilization = (rng.randint(60, 100), rng.randint(20, 80))
        mhz = rng.randrange(1500, 1981, 15)
        gpu.clocks = [mhz, mhz, *gpu.clocks[2:]]
        gpu.memory_used = rng.randrange(60, 130) * 2**30
        gpu.pstate = 0


class Changer:
    """Rewrites the fake node's state every ``period`` seconds with readings that move the way a busy
    GPU's do: power, temperatures, utilization, graphics/SM clocks and memory in use change at every
    poll, energy accumulates. Without it the fake node's readings stay where they are between polls
    (the "steady" figures), which lets gpuwatch's exposition reuse every GPU's encoded lines; the
    "changing" figures are the other end. Runs in the benchmark's process: its CPU is not counted."""

    def __init__(self, fx: fakenvml.FakeNvmlEnv, node: fakenvml.FakeNode, period: float) -> None:
        import random

        self.fx, self.node, self.period = fx, node, period
        self.rng = random.Random(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            change(self.node, self.rng, self.period)
            self.fx.write(self.node)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def start(name: str, python: dict[str, Path], gpus: int, poll: float, workdir: Path, kind: str = "hgx") -> Exporter:
    workdir.mkdir(parents=True, exist_ok=True)
    node = NODES[kind][1](gpus)
    fx = fakenvml.prepare(workdir, node)
    port = free_port()
    if name == "gpuwatch":
        argv = [str(python[name]), "-m", "gpuwatch", "run", "--web.listen-address", f"127.0.0.1:{port}",
                "--poll.interval", str(poll), "--log.level", "warning", "--log.format", "json"]
    else:
        argv = [str(python[name].parent / "nvitop-exporter"), "--bind-address", "127.0.0.1", "--port", str(port),
                "--interval", str(poll)]
    exp = Exporter(name, argv, port, fx, workdir)
    exp.node = node
    return exp


# -- measurements -------------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def latency(seconds: list[float]) -> dict:
    return {"requests": len(seconds), "p50_ms": percentile(seconds, 50) * 1e3,
            "p99_ms": percentile(seconds, 99) * 1e3, "max_ms": max(seconds) * 1e3}


def cpu_window(exp: Exporter, gpus: int, seconds: float, scrape_every: float) -> dict:
    """CPU per GPU per poll over ``seconds`` while a scraper asks for /metrics every ``scrape_every``."""
    stop = threading.Event()
    scrapes: list[float] = []

    def scraper() -> None:
        # one connection kept from scrape to scrape, as Prometheus keeps it (HTTP/1.1 keep-alive); an exporter
        # that answers and closes (nvitop-exporter's HTTP/1.0 server) gets a new connection for each scrape
        conn = http.client.HTTPConnection("127.0.0.1", exp.port, timeout=30)
        next_at = time.monotonic()
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
                    response = conn.getresponse()
                    response.read()
                    if response.status == 200:
                        scrapes.append(time.perf_counter() - t0)
                except (OSError, http.client.HTTPException):
                    conn.close()  # the next request connects again
                next_at += scrape_every
                stop.wait(max(0.0, next_at - time.monotonic()))
        finally:
            conn.close()

    thread = threading.Thread(target=scraper, daemon=True)
    polls0, lib0 = exp.counters()
    cpu0, stat0 = exp.cpu_seconds(), exp.stat_cpu_seconds()
    thread.start()
    stop.wait(seconds)
    stop.set()
    thread.join()
    polls1, lib1 = exp.counters()
    cpu1, stat1 = exp.cpu_seconds(), exp.stat_cpu_seconds()
    polls = (polls1 - polls0) / gpus
    own = (cpu1 - cpu0) - (lib1 - lib0)
    return {"seconds": seconds, "polls": polls, "scrapes": len(scrapes), "cpu_s": cpu1 - cpu0,
            "cpu_s_stat": stat1 - stat0, "library_cpu_s": lib1 - lib0,
            "cpu_us_per_gpu_poll": own / polls / gpus * 1e6 if polls else None}


def scrape_latency(exp: Exporter, quick: bool) -> dict:
    for _ in range(5):
        exp.get(PROMETHEUS_HEADERS)
    alone = [exp.get(PROMETHEUS_HEADERS)[2] for _ in range(40 if quick else 200)]
    samples: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(21)

    def scraper() -> None:
        mine = []
        barrier.wait()
        for _ in range(5 if quick else 20):
            mine.append(exp.get(PROMETHEUS_HEADERS)[2])
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=scraper, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join(timeout=600)
    status, body, _ = exp.get()
    gz = exp.get(PROMETHEUS_HEADERS)[1]
    return {"alone": latency(alone), "concurrent_20": latency(samples), "bytes": len(body),
            "bytes_gzip_openmetrics": len(gz),
            "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))}


def cpu_windows(exps: list[Exporter], gpus: int, seconds: float, scrape_every: float) -> list[dict]:
    """``cpu_window`` of each exporter, over the same ``seconds`` (each with its own scraper)."""
    if len(exps) == 1:
        return [cpu_window(exps[0], gpus, seconds, scrape_every)]
    with ThreadPoolExecutor(len(exps)) as pool:
        return list(pool.map(lambda exp: cpu_window(exp, gpus, seconds, scrape_every), exps))


def measure(names: list[str], python: dict[str, Path], gpus: int, quick: bool, workdir: Path, kind: str = "hgx",
            cadences: tuple[tuple[float, float], ...] = CADENCES, window_s: float | None = None) -> dict[str, dict]:
    """Each exporter's figures. Several names: the exporters run at once, each over a fake node of its own, and
    their CPU windows are the same seconds (``--paired``): what the VM's neighbours do then weighs on both."""
    results: dict[str, dict] = {name: {} for name in names}
    for poll, scrape in cadences:
        exps: list[Exporter] = []
        try:
            for name in names:
                exps.append(start(name, python, gpus, poll, workdir / f"{name}-{kind}-{gpus}-{poll:g}", kind))
            warm = 10 if quick else 20
            for exp in exps:
                wait_for(lambda exp=exp, warm=warm, poll=poll: exp.counters()[0] / gpus >= warm / poll / 2, 120,
                         "warm-up polls")
            window = window_s or ((30 if quick else 120) if poll < 1 else (45 if quick else 120))
            key = f"poll_{poll:g}s_scrape_{scrape:g}s"
            for exp, figures in zip(exps, cpu_windows(exps, gpus, window, scrape)):
                results[exp.name][key] = figures
            changers = [Changer(exp.fx, exp.node, poll) for exp in exps if exp.node is not None]
            try:
                changing = cpu_windows(exps, gpus, window, scrape)
            finally:
                for changer in changers:
                    changer.close()
                    changer.fx.write(changer.node)
            for exp, figures in zip(exps, changing):
                results[exp.name][key + "_changing"] = figures
            if poll < 1:  # the busy cadence: memory after >= 300 polls, then the latency tests
                wanted = 300
                for exp in exps:
                    wait_for(lambda exp=exp, wanted=wanted: exp.counters()[0] / gpus >= wanted, 600, f"{wanted} polls")
                    results[exp.name]["rss_mb_after_300_polls"] = exp.rss_mb()
                for exp in exps:  # one at a time, the other stopped (SIGSTOP): its polls would take the CPUs
                    others = [other for other in exps if other is not exp]
                    for other in others:
                        other.pause()
                    try:
                        results[exp.name]["scrapes"] = scrape_latency(exp, quick)
                    finally:
                        for other in others:
                            other.resume()
        finally:
            for exp in exps:
                exp.stop()
    return results


# -- report ---------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(gpus: int, r: dict, kind: str = "hgx") -> list[str]:
    g, n = r.get("gpuwatch", {}), r.get("nvitop-exporter", {})
    lines = [f"\n{NODES[kind][0]} x {gpus}", f"{'figure':58} {'gpuwatch':>12} {'nvitop':>12} {'ratio':>7}  target"]
    rows = [(f"poll_{poll:g}s_scrape_{scrape:g}s",
             f"CPU us per GPU per poll, poll {poll:g} s, scrape every {scrape:g} s") for poll, scrape in CADENCES]
    rows += [(f"poll_{poll:g}s_scrape_{scrape:g}s_changing", f"  the same at poll {poll:g} s, readings changing")
             for poll, scrape in CADENCES]
    for key, label in rows:
        a = g.get(key, {}).get("cpu_us_per_gpu_poll")
        b = n.get(key, {}).get("cpu_us_per_gpu_poll")
        ratio = a / b if a is not None and b else None
        target = "" if ratio is None else f"<= 1/3  {verdict(ratio <= TARGETS['cpu_ratio'])}"
        lines.append(f"{label:58} {_f(a):>12} {_f(b):>12} {_f(ratio, 2):>7}  {target}")
    rss_a, rss_b = g.get("rss_mb_after_300_polls"), n.get("rss_mb_after_300_polls")
    rss_t = TARGETS["rss_mb"].get(gpus)
    lines.append(f"{'VmRSS MB after 300 polls':58} {_f(rss_a, 1):>12} {_f(rss_b, 1):>12} {'':7}  "
                 + ("" if rss_a is None or rss_t is None else f"<= {rss_t:g}  {verdict(rss_a <= rss_t)}"))
    for label, path, targets in (("/metrics p99 ms alone", "alone", TARGETS["p99_ms"]),
                                 ("/metrics p99 ms, 20 concurrent scrapers", "concurrent_20",
                                  TARGETS["concurrent_p99_ms"])):
        a = g.get("scrapes", {}).get(path, {}).get("p99_ms")
        b = n.get("scrapes", {}).get(path, {}).get("p99_ms")
        t = targets.get(gpus)
        lines.append(f"{label:58} {_f(a, 2):>12} {_f(b, 2):>12} {'':7}  "
                     + ("" if a is None or t is None else f"<= {t:g}  {verdict(a <= t)}"))
    for label, key in (("/metrics bytes (text)", "bytes"),
                       ("/metrics bytes (OpenMetrics, gzip)", "bytes_gzip_openmetrics"),
                       ("series", "series")):
        mine, theirs = g.get("scrapes", {}).get(key), n.get("scrapes", {}).get(key)
        lines.append(f"{label:58} {_f(mine, 0):>12} {_f(theirs, 0):>12}")
    return lines


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--nodes", choices=sorted(NODES), nargs="+", default=["hgx", "pcie"],
                    help="node kinds: hgx (H200, NVLink, GPM), pcie (L40S, neither)")
    ap.add_argument("--only", choices=["gpuwatch", "nvitop-exporter"], help="measure one exporter")
    ap.add_argument("--quick", action="store_true", help="shorter windows")
    ap.add_argument("--cadence", type=float, nargs="+", choices=[poll for poll, _ in CADENCES],
                    default=[poll for poll, _ in CADENCES],
                    help="poll intervals to measure (RSS and latency are measured at 0.5 s)")
    ap.add_argument("--window", type=float, help="seconds of each CPU window (default 120; --quick 30 or 45): "
                    "a 45 s window at 2 s polls holds 22 polls, and what each costs moves with the VM's other work")
    ap.add_argument("--paired", action="store_true",
                    help="run both exporters at once and measure their CPU in the same windows (default: one "
                         "after the other)")
    ap.add_argument("--out", default=str(OUT / "results.json"))
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    python = {}
    names = [args.only] if args.only else ["gpuwatch", "nvitop-exporter"]
    if "gpuwatch" in names:
        python["gpuwatch"] = venv("gpuwatch-venv", str(ROOT))
        for how in ([], ["--force-reinstall", "--no-deps"]):  # a dependency added since the venv was made; then
            subprocess.run([str(python["gpuwatch"]), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            *how, str(ROOT)], check=True)  # this working tree, as of now, whatever pip decides
    if "nvitop-exporter" in names:
        python["nvitop-exporter"] = venv("nvitop-venv", PEER)
    fakenvml.build()
    results: dict = {"machine": machine(), "command": " ".join(["bench/bench.py", *(argv or sys.argv[1:])]),
                     "peer": PEER, "paired": args.paired, "nodes": {}}
    try:
        for kind in args.nodes:
            for gpus in args.gpus:
                per = results["nodes"].setdefault(kind, {})[str(gpus)] = {}
                cadences = tuple(c for c in CADENCES if c[0] in args.cadence)
                for group in [names] if args.paired else [[name] for name in names]:
                    per.update(measure(group, python, gpus, args.quick, OUT / "runs", kind, cadences, args.window))
                print("\n".join(report(gpus, per, kind)), flush=True)
    finally:
        for proc in list(_children):
            reap(proc)
    results["wall_s"] = round(time.monotonic() - started)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{results['machine']}\nwall {results['wall_s']} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
