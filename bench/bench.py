"""gpuwatch benchmark: CPU per poll, NVML calls per poll, /metrics latency, resident memory.

    .venv/bin/python bench/bench.py                 # H200 x 8 and x 64 (fake libnvidia-ml.so.1)
    .venv/bin/python bench/bench.py --gpus 8 --quick

Everything runs over the fake NVML library in tests/fakenvml (compiled on first use; needs cc),
whose calls cost next to nothing: the figures are gpuwatch's own cost, not a real driver's.
Prints one table per GPU count with the targets, writes bench/out/results.json. See
docs/performance.md for what each figure means and what it leaves out.
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
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402

OUT = ROOT / "bench" / "out" / "results.json"
SOURCE = ROOT  # the tree whose gpuwatch package the children import; main() points it at a copy

# Targets. CPU: per GPU per fast poll, excluding the estimated time inside the library.
TARGET_CPU_US = 150.0
TARGET_CALLS = 15.0
TARGET_P99_MS = {8: 5.0, 64: 25.0}
TARGET_RSS_MB = 50.0  # MB = 10^6 bytes

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;"
                     "version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")

_children: list[subprocess.Popen] = []


# -- child processes ---------------------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL if this process dies (Linux), so nothing is left behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    # cwd = the source tree: `python -m gpuwatch` puts the cwd first on sys.path.
    proc = subprocess.Popen(argv, env=env, cwd=SOURCE, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                            **kw)
    _children.append(proc)
    return proc


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc in _children:
        _children.remove(proc)


def _reap_all() -> None:
    for proc in list(_children):
        _reap(proc)


def child_env(fx: fakenvml.FakeNvmlEnv) -> dict[str, str]:
    env = dict(fx.env)
    env.pop("GPUWATCH_CONFIG", None)
    for key in [k for k in env if k.startswith("GPUWATCH_")]:
        env.pop(key)
    env["PYTHONUNBUFFERED"] = "1"
    # SOURCE first: it wins over the editable install of the working tree in .venv.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE), env.get("PYTHONPATH", "")) if p)
    return env


class Daemon:
    """The real `gpuwatch run` on 127.0.0.1:<free port> over the fake library."""

    def __init__(self, workdir: Path, fx: fakenvml.FakeNvmlEnv, fast: float, slow: float,
                 extra: list[str] | None = None) -> None:
        self.log_path = workdir / "gpuwatch.log"
        self._log = open(self.log_path, "w")
        argv = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:0",
                "--poll.interval", str(fast), "--poll.slow-interval", str(slow),
                "--log.format", "json", "--log.level", "info"] + (extra or [])
        self.proc = _spawn(argv, child_env(fx), stdout=self._log, stderr=subprocess.STDOUT)
        started = wait_for(self._started, 30, "gpuwatch to start listening")
        self.host, port = started["listen"][0].rsplit(":", 1)
        self.port = int(port)
        wait_for(lambda: self.get("/healthz")[0] == 200, 30, "/healthz to answer 200")

    def _started(self) -> dict | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"gpuwatch exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "started":
                    return event
        return None

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        status, body, response_headers, _, _ = self.timed_get(path, headers)
        return status, body, response_headers

    def timed_get(self, path: str, headers: dict[str, str] | None = None
                  ) -> tuple[int, bytes, dict[str, str], float, float]:
        """One GET on a new connection (the server speaks HTTP/1.0 and closes after each answer):
        status, body, headers, seconds to connect, seconds from before connect to the last body byte."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            t0 = time.perf_counter()
            conn.connect()
            t1 = time.perf_counter()
            conn.request("GET", path, headers=headers or {})
            response = conn.getresponse()
            body = response.read()
            t2 = time.perf_counter()
            return response.status, body, dict(response.getheaders()), t1 - t0, t2 - t0
        finally:
            conn.close()

    def rss_kib(self) -> dict[str, int]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile") if k in fields}

    def stop(self) -> None:
        _reap(self.proc)
        self._log.close()


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# -- statistics --------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def latency_summary(seconds: list[float]) -> dict:
    return {
        "requests": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p90_ms": percentile(seconds, 90) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
    }


# -- 1 + 2: in-process CPU and call counts -----------------------------------------------------
def measure_inproc(workdir: Path, gpus: int, quick: bool) -> dict:
    fx = fakenvml.prepare(workdir / "inproc", fakenvml.FakeNode.h200(gpus))
    out = workdir / "inproc.json"
    scale = 0.1 if quick else 1.0
    rounds_fast = max(20, int(16000 * scale) // gpus)
    argv = [sys.executable, str(ROOT / "bench" / "inproc.py"), "--out", str(out),
            "--rounds-fast", str(rounds_fast), "--rounds-poll", str(rounds_fast),
            "--rounds-slow", str(max(10, rounds_fast // 4)),
            "--rounds-agent", str(20 if quick else max(50, 1600 // gpus)), *(["--quick"] if quick else []),
            "--call-iterations", str(int(20000 * scale))]
    proc = _spawn(argv, child_env(fx))
    try:
        rc = proc.wait(timeout=240)
    finally:
        _reap(proc)
    if rc != 0:
        raise RuntimeError(f"bench/inproc.py failed with exit status {rc}")
    return json.loads(out.read_text())


# -- 3: /metrics latency -----------------------------------------------------------------------
def measure_scrapes(workdir: Path, gpus: int, quick: bool) -> dict:
    fx = fakenvml.prepare(workdir / "scrape", fakenvml.FakeNode.h200(gpus), counts=False)
    daemon = Daemon(workdir / "scrape", fx, fast=2, slow=30)
    try:
        status, body, _ = daemon.get("/metrics")
        assert status == 200, body[:200]
        exposition = {
            "bytes": len(body),
            "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#")),
            "series_gpuwatch": sum(1 for line in body.splitlines() if line.startswith(b"gpuwatch_")),
        }
        for _ in range(5):  # warm-up
            daemon.get("/metrics")

        connects: list[float] = []

        def timed(headers: dict[str, str] | None = None) -> float:
            status, body, _, connect, total = daemon.timed_get("/metrics", headers)
            if status != 200 or not body:
                raise RuntimeError(f"/metrics answered {status}")
            connects.append(connect)
            return total

        def run_for(n: int, seconds: float, headers: dict[str, str] | None = None) -> list[float]:
            """Up to n sequential requests, stopping early after `seconds` (keeps the run short)."""
            deadline = time.monotonic() + seconds
            out = []
            while len(out) < n and (len(out) < 20 or time.monotonic() < deadline):
                out.append(timed(headers))
            return out

        n_seq = 60 if quick else 300
        sequential = latency_summary(run_for(n_seq, 45))
        sequential["connect_p99_ms"] = percentile(connects, 99) * 1e3

        # What Prometheus sends: OpenMetrics preferred, gzip accepted.
        prom_headers = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
        status, body, headers = daemon.get("/metrics", prom_headers)
        n_prom = 30 if quick else 100
        prometheus = latency_summary(run_for(n_prom, 20, prom_headers)) | {
            "content_type": headers.get("Content-Type"), "content_encoding": headers.get("Content-Encoding"),
            "bytes": len(body)}

        threads_n, per_thread = (20, 10) if quick else (20, 50)
        samples: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()
        barrier = threading.Barrier(threads_n + 1)

        stop_at: list[float] = []

        def scraper() -> None:
            mine = []
            barrier.wait()
            for i in range(per_thread):
                if i >= 3 and time.monotonic() > stop_at[0]:
                    break  # keeps the run short at high GPU counts; the counts actually done are reported
                try:
                    mine.append(timed())
                except Exception as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
            with lock:
                samples.extend(mine)

        connects.clear()
        workers = [threading.Thread(target=scraper, daemon=True) for _ in range(threads_n)]
        for w in workers:
            w.start()
        stop_at.append(time.monotonic() + 30)
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join(timeout=300)
        wall = time.perf_counter() - t0
        concurrent = latency_summary(samples) | {
            "threads": threads_n, "max_requests_per_thread": per_thread, "errors": len(errors),
            "error_examples": errors[:3], "wall_s": wall, "throughput_rps": len(samples) / wall,
            "connect_p50_ms": percentile(connects, 50) * 1e3, "connect_p99_ms": percentile(connects, 99) * 1e3,
            "connects_over_900ms": sum(1 for c in connects if c > 0.9)}
        return {"exposition": exposition, "sequential": sequential, "prometheus_headers": prometheus,
                "concurrent": concurrent}
    finally:
        daemon.stop()


# -- 4: resident memory ------------------------------------------------------------------------
def measure_memory(workdir: Path, gpus: int, quick: bool) -> dict:
    """`gpuwatch run` polling 5x faster than the default (every 0.4 s, the slow tier every 6 s) with
    the rules' history window scaled the same way (60 s instead of 300 s), so the daemon keeps what a
    real one keeps at the default 2 s: 150 fast samples per GPU. A scraper GETs /metrics every 10
    fast intervals. 300 fast polls = 10 minutes at the default 2 s; VmRSS is read after the first
    poll, after 150 polls (the history window full) and after 300 polls (the target). Polls are
    counted with the fake library's call counters, so skipped (overrun) polls do not count."""
    fast, window = 0.4, 60.0
    slow, scrape_every = round(15 * fast, 3), round(10 * fast, 3)
    full_window_polls, target_polls = (30, 60) if quick else (150, 300)
    fx = fakenvml.prepare(workdir / "memory", fakenvml.FakeNode.h200(gpus))

    def fast_polls() -> float:
        # GetPowerUsage is called once per GPU at discovery (probe), then once per GPU per fast poll.
        return (fx.counts().get("nvmlDeviceGetPowerUsage", 0) - gpus) / gpus

    def slow_polls() -> float:
        # GetMaxClockInfo: 4 clocks per GPU, probed once at discovery, then per slow poll.
        return fx.counts().get("nvmlDeviceGetMaxClockInfo", 0) / (4 * gpus) - 1

    # The slow tier's look-back (pcie_replays_rising, 300 s) is compressed like the window, so that the
    # daemon keeps as many slow samples (10 per GPU) as a real one does.
    config = workdir / "memory" / "gpuwatch.yml"
    config.write_text(f"rules: {{pcie_replays_rising: {{lookback_seconds: {window:g}}}}}\n")
    daemon = Daemon(workdir / "memory", fx, fast=fast, slow=slow,
                    extra=["--rules.window", f"{window:g}", "--config", str(config)])
    stop = threading.Event()
    scrapes = {"ok": 0, "failed": 0}

    def scraper() -> None:
        while not stop.wait(scrape_every):
            try:
                status, _, _ = daemon.get("/metrics")
                scrapes["ok" if status == 200 else "failed"] += 1
            except Exception:
                scrapes["failed"] += 1

    def point(t0: float) -> dict:
        return {"fast_polls": fast_polls(), "slow_polls": slow_polls(), "scrapes": scrapes["ok"],
                "seconds": time.monotonic() - t0, "kib": daemon.rss_kib()}

    thread = threading.Thread(target=scraper, daemon=True)
    try:
        t0 = time.monotonic()
        start = point(t0)
        thread.start()
        wait_for(lambda: fast_polls() >= full_window_polls, 300, f"{full_window_polls} fast polls")
        at_window = point(t0)
        wait_for(lambda: fast_polls() >= target_polls, 300, f"{target_polls} fast polls")
        at_target = point(t0)
        stop.set()
        thread.join(timeout=30)
        overruns = sum(1 for line in daemon.log_path.read_text().splitlines() if '"poll_overrun"' in line)
        return {
            "poll_interval_s": fast, "slow_interval_s": slow, "scrape_every_s": scrape_every, "rules_window_s": window,
            "start": start, "end": at_target, "full_window": at_window,
            "scrapes": dict(scrapes), "poll_overrun_log_events": overruns,
        }
    finally:
        stop.set()
        daemon.stop()


# -- report ------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def checks(gpus: int, r: dict) -> list[dict]:
    """(figure, value, target, pass) rows for one GPU count."""
    rows = []
    inproc, scrapes, memory = r.get("inproc"), r.get("scrapes"), r.get("memory")
    p99_target = TARGET_P99_MS.get(gpus, TARGET_P99_MS[8] if gpus <= 8 else TARGET_P99_MS[64])
    if inproc:
        poll, read = inproc["poll_fast"], inproc["read_fast"]
        agent = inproc.get("agent_poll_fast")
        if agent:
            rows.append({"figure": "fast poll CPU per GPU, daemon wiring (cli.Agent), excl. library",
                         "value": agent["cpu_us_excluding_library"], "unit": "µs", "target": f"≤ {TARGET_CPU_US:g}",
                         "pass": agent["cpu_us_excluding_library"] <= TARGET_CPU_US})
        rows += [
            {"figure": "fast poll CPU per GPU, Poller.poll_fast + Store, excl. library",
             "value": poll["cpu_us_excluding_library"], "unit": "µs", "target": f"≤ {TARGET_CPU_US:g}",
             "pass": poll["cpu_us_excluding_library"] <= TARGET_CPU_US},
            {"figure": "fast poll CPU per GPU, backend only (read_fast), excl. library",
             "value": read["cpu_us_excluding_library"], "unit": "µs", "target": f"≤ {TARGET_CPU_US:g}",
             "pass": read["cpu_us_excluding_library"] <= TARGET_CPU_US},
            {"figure": "NVML calls per GPU per fast poll", "value": read["calls_per_gpu_poll"]["total"],
             "unit": "calls", "target": f"≤ {TARGET_CALLS:g}",
             "pass": read["calls_per_gpu_poll"]["total"] <= TARGET_CALLS},
        ]
    if scrapes:
        p99 = scrapes["sequential"]["p99_ms"]
        rows.append({"figure": "/metrics p99, sequential (alone)", "value": p99, "unit": "ms",
                     "target": f"≤ {p99_target:g}", "pass": p99 <= p99_target})
    if memory:
        mb = memory["end"]["kib"]["VmRSS"] * 1024 / 1e6
        rows.append({"figure": f"resident memory (VmRSS) after {memory['end']['fast_polls']:.0f} fast polls",
                     "value": mb, "unit": "MB", "target": f"≤ {TARGET_RSS_MB:g}", "pass": mb <= TARGET_RSS_MB})
    return rows


def print_report(gpus: int, r: dict) -> None:
    print(f"\n== H200 x {gpus} (fake libnvidia-ml.so.1) ==")
    for row in r["checks"]:
        print(f"  {row['figure']:<70} {row['value']:>9.2f} {row['unit']:<5} target {row['target']:<6} "
              f"{verdict(row['pass'])}")
    inproc, scrapes, memory = r.get("inproc"), r.get("scrapes"), r.get("memory")
    if inproc:
        c = inproc["call_costs"]
        print("  CPU per GPU per poll, median over rounds (time.process_time):")
        if "agent_poll_fast_error" in inproc:
            print(f"    cli.Agent path not measured: {inproc['agent_poll_fast_error']}")
        for key, label in (("agent_poll_fast", "cli.Agent poll"), ("poll_fast", "Poller.poll_fast"),
                           ("read_fast", "read_fast"), ("read_slow", "read_slow")):
            if key not in inproc:
                continue
            x = inproc[key]
            print(f"    {label:<18} total {x['cpu_us_median']:7.1f} µs   library estimate "
                  f"{x['library_estimate_us']:5.1f} µs   excl. library {x['cpu_us_excluding_library']:7.1f} µs   "
                  f"({x['calls_per_gpu_poll']['total']:.0f} calls, {x['rounds']} rounds)")
        agent = inproc.get("agent_poll_fast", {})
        if agent:
            print(f"    cli.Agent poll measured on a FakeClock moved {agent['fast_interval_s']:g} s per poll, after "
                  f"{agent['polls_before_measuring']} polls (rules window {agent['rules_window_s']:g} s "
                  f"{'full' if agent['window_full'] else 'NOT full'})")
        if "rules_evaluate_cpu_us_median" in agent:
            print(f"    rules alone (Poller.evaluate, which the daemon also runs on its own timer every fast "
                  f"interval): {agent['rules_evaluate_cpu_us_median']:.1f} µs per GPU")
            per_interval = agent["cpu_us_median"] + agent["rules_evaluate_cpu_us_median"]
            print(f"    daemon CPU per fast interval (poll + the timer's evaluation): {per_interval:.0f} µs per GPU, "
                  f"{per_interval * gpus / 1e6 / agent['fast_interval_s'] * 100:.2f} % of one core for {gpus} GPUs "
                  f"every {agent['fast_interval_s']:g} s, scrapes not included")
        print(f"    per call: raw ctypes into the fake {c['raw_scalar_call_us']:.2f} µs, same via pynvml "
              f"{c['pynvml_scalar_call_us']:.2f} µs, GetFieldValues({c['fast_field_ids']} ids, prebuilt array) "
              f"{c['raw_fieldvalues_fast_call_us']:.2f} µs, ctypes->libc labs {c['ctypes_libc_labs_call_us']:.2f} µs")
        by = inproc["read_fast"]["calls_per_gpu_poll"]["by_symbol"]
        print("  NVML calls per GPU per fast poll: " + ", ".join(f"{k.removeprefix('nvmlDevice')} {v:g}"
                                                              for k, v in by.items()))
    if scrapes:
        e = scrapes["exposition"]
        print(f"  /metrics: {e['bytes']} bytes, {e['series']} series ({e['series_gpuwatch']} gpuwatch_*)")
        for key, label in (("sequential", "sequential, text 0.0.4"),
                           ("prometheus_headers", "sequential, Prometheus Accept + gzip"),
                           ("concurrent", "20 threads concurrently")):
            s = scrapes[key]
            extra = ""
            if key == "concurrent":
                extra = (f"  {s['throughput_rps']:.1f} req/s, {s['errors']} errors; TCP connect p99 "
                         f"{s['connect_p99_ms']:.1f} ms, {s['connects_over_900ms']} connects > 0.9 s")
            elif key == "prometheus_headers":
                extra = f"  ({s['bytes']} bytes {s['content_encoding'] or 'identity'})"
            print(f"    {label:<38} n={s['requests']:<5} p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms  "
                  f"max {s['max_ms']:7.2f} ms{extra}")
    if memory:
        def mb(point: dict, key: str = "VmRSS") -> str:
            return f"{point['kib'][key] * 1024 / 1e6:.1f} MB"

        print(f"  memory (MB = 10^6 bytes), polling every {memory['poll_interval_s']} s with the rules window "
              f"scaled to {memory.get('rules_window_s', 300):g} s, scraped every "
              f"{memory['scrape_every_s']} s ({memory['poll_overrun_log_events']} poll_overrun events):")
        for key in ("start", "full_window", "end"):
            p = memory[key]
            label = ("after the first poll" if key == "start" else
                     f"= {p['fast_polls'] * 2 / 60:.0f} min at 2 s" + (" (target)" if key == "end" else ""))
            print(f"    {label:<26} VmRSS {mb(p):>8}  VmHWM {mb(p, 'VmHWM'):>8}  after {p['fast_polls']:4.0f} fast / "
                  f"{p['slow_polls']:3.0f} slow polls, {p['scrapes']:3d} scrapes, {p['seconds']:5.1f} s")


def machine() -> dict:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu_model": model, "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "loadavg_at_start": os.getloadavg()}


def source_info(rev: str | None) -> dict:
    def git(*a: str) -> str:
        proc = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    commit = git("rev-parse", rev or "HEAD")
    changed = [] if rev else [line.split(maxsplit=1)[-1]
                              for line in git("status", "--porcelain", "--", "gpuwatch").splitlines()]
    describe = f"commit {commit[:12]}" if rev else f"working tree on {commit[:12]}" + (
        f" with uncommitted changes in {len(changed)} gpuwatch/ file(s)" if changed else "")
    return {"rev": rev, "commit": commit, "uncommitted": changed, "describe": describe}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64], help="GPU counts (H200 profile), 1-64")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (fewer rounds, requests, polls)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"JSON results (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--rev", help="benchmark this git commit (exported with `git archive`) instead of the "
                                  "working tree")
    ap.add_argument("--source", type=Path, help="benchmark the gpuwatch package in this directory (e.g. a patched "
                                                "copy) instead of the working tree")
    args = ap.parse_args(argv)
    if args.rev and args.source:
        ap.error("--rev and --source exclude each other")
    if any(not 1 <= n <= fakenvml.MAX_GPUS for n in args.gpus):
        ap.error(f"--gpus: the fake library supports 1-{fakenvml.MAX_GPUS} GPUs")

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    results: dict = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
                     "quick": args.quick, "targets": {"cpu_us_excl_library": TARGET_CPU_US,
                                                      "calls_per_gpu_fast_poll": TARGET_CALLS,
                                                      "metrics_p99_ms": TARGET_P99_MS, "rss_mb": TARGET_RSS_MB},
                     "runs": {}}
    started = time.monotonic()
    global SOURCE
    try:
        fakenvml.build()
        with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as tmp:
            if args.source:
                SOURCE = args.source.resolve()
            elif not args.rev:
                # A copy of the working tree's package, so that edits made meanwhile do not mix versions.
                SOURCE = Path(tmp) / "src"
                shutil.copytree(ROOT / "gpuwatch", SOURCE / "gpuwatch",
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                SOURCE = Path(tmp) / "src"
                SOURCE.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev], capture_output=True,
                                         check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(SOURCE)], input=archive, check=True)
            results["source"] = source_info(args.rev) if not args.source else {
                "path": str(SOURCE), "describe": f"the gpuwatch package in {SOURCE}"}
            print(f"benchmarking {results['source']['describe']}", file=sys.stderr, flush=True)
            for gpus in args.gpus:
                workdir = Path(tmp) / f"h200x{gpus}"
                r: dict = {}
                print(f"H200 x {gpus}: in-process CPU and call counts ...", file=sys.stderr, flush=True)
                r["inproc"] = measure_inproc(workdir, gpus, args.quick)
                print(f"H200 x {gpus}: /metrics latency ...", file=sys.stderr, flush=True)
                r["scrapes"] = measure_scrapes(workdir, gpus, args.quick)
                print(f"H200 x {gpus}: resident memory ...", file=sys.stderr, flush=True)
                r["memory"] = measure_memory(workdir, gpus, args.quick)
                r["checks"] = checks(gpus, r)
                results["runs"][str(gpus)] = r
                print_report(gpus, r)
    except BaseException as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _reap_all()
        results["duration_s"] = time.monotonic() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    failed = [f"{g} GPUs: {c['figure']}" for g, r in results["runs"].items() for c in r["checks"] if not c["pass"]]
    print(f"\n{len(failed)} target(s) missed{': ' + '; '.join(failed) if failed else ''}. "
          f"Results: {args.out} ({results['duration_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
