"""On a real GPU machine: what the driver answers, what a poll costs, and gpuwatch beside nvitop-exporter.

    python3 bench/realgpu.py probe            # the raw answers docs/hardware.md's assumptions rest on
    python3 bench/realgpu.py calls [--polls N] # NVML calls and CPU per GPU per fast poll, in-process
    python3 bench/realgpu.py cost --peer-path DIR [--seconds S]  # whole processes, one after the other
    python3 bench/realgpu.py inside           # which reading failed where, each field's cost, the imports

Run by scripts/gpu-smoke with gpuwatch and its dependencies on PYTHONPATH. Nothing here is faked:
the CPU figures include the time spent inside the real libnvidia-ml (the driver's ioctls), unlike
bench.py's, which subtract the fake library's own time. Output: one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any


def _try(fn: Any, *args: Any) -> Any:
    import pynvml as N

    try:
        return fn(*args)
    except N.NVMLError as e:
        return f"error: {e}"
    except Exception as e:
        return f"exception: {type(e).__name__}: {e}"


def _field(handle: Any, fid: int, scope: int = 0) -> Any:
    import pynvml as N

    v = N.nvmlDeviceGetFieldValues(handle, [(fid, scope)])[0]
    if v.nvmlReturn:
        return f"error: {N.NVMLError(v.nvmlReturn)}"
    kind = v.valueType
    val = {0: v.value.dVal, 1: v.value.uiVal, 2: v.value.ulVal, 3: v.value.ullVal, 4: v.value.sllVal,
           5: v.value.siVal, 6: v.value.usVal}.get(kind, v.value.ullVal)
    return {"type": kind, "value": val}


def _median_us(fn: Any, n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            pass
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def _call_times(h: Any, links: int) -> dict[str, float]:
    import pynvml as N

    return {
        "GetTemperature": _median_us(lambda: N.nvmlDeviceGetTemperature(h, 0)),
        "GetPowerUsage": _median_us(lambda: N.nvmlDeviceGetPowerUsage(h)),
        "GetUtilizationRates": _median_us(lambda: N.nvmlDeviceGetUtilizationRates(h)),
        "GetMemoryInfo": _median_us(lambda: N.nvmlDeviceGetMemoryInfo(h)),
        "GetClockInfo(SM)": _median_us(lambda: N.nvmlDeviceGetClockInfo(h, 1)),
        "GetCurrentClocksEventReasons": _median_us(lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "GetFieldValues(83 energy)": _median_us(lambda: N.nvmlDeviceGetFieldValues(h, [83])),
        f"GetFieldValues({links} links x 165)": _median_us(
            lambda: N.nvmlDeviceGetFieldValues(h, [(165, k) for k in range(max(links, 1))]), 50),
        "GetComputeRunningProcesses": _median_us(lambda: N.nvmlDeviceGetComputeRunningProcesses(h), 50),
        "GpmSampleGet": _median_us(lambda: N.nvmlGpmSampleGet(h, _gpm_sample()), 50),
    }


_SAMPLE: list[Any] = []


def _gpm_sample() -> Any:
    import pynvml as N

    if not _SAMPLE:
        _SAMPLE.append(N.nvmlGpmSampleAlloc())
    return _SAMPLE[0]


def probe() -> dict:
    import pynvml as N

    N.nvmlInit()
    out: dict[str, Any] = {"driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
                           "count": N.nvmlDeviceGetCount(), "gpus": []}
    for i in range(out["count"]):
        h = N.nvmlDeviceGetHandleByIndex(i)
        g: dict[str, Any] = {"name": _try(N.nvmlDeviceGetName, h), "num_fans": _try(N.nvmlDeviceGetNumFans, h),
                             "margin_temperature": _try(N.nvmlDeviceGetMarginTemperature, h),
                             "temperature": _try(N.nvmlDeviceGetTemperature, h, 0)}
        g["thresholds"] = {t: _try(N.nvmlDeviceGetTemperatureThreshold, h, t) for t in range(0, 8)}
        g["fields"] = {fid: _try(_field, h, fid) for fid in
                       (31, 75, 82, 83, 91, 138, 139, 160, 185, 193, 194, 195, 196, 199, 200, 230,
                        251, 252, 253, 258, 263, 269, 270, 271)}
        g["fields_scope_all"] = {fid: _try(_field, h, fid, 0xFFFFFFFF) for fid in (138, 139, 213, 214, 220)}
        links = g["fields"][91]["value"] if isinstance(g["fields"][91], dict) else 0
        g["link_state_165"] = [_try(_field, h, 165, link) for link in range(links)]
        g["link_remote_type"] = [_try(N.nvmlDeviceGetNvLinkRemoteDeviceType, h, link) for link in range(links)]
        g["nvlink_error_totals"] = {fid: _try(_field, h, fid) for fid in (38, 45, 52, 59)}
        g["nvlink_error_link0"] = {fid: _try(_field, h, fid, 0) for fid in (161, 162, 163)}
        gs = _try(N.nvmlGpmQueryDeviceSupport, h)
        g["gpm_supported"] = gs if isinstance(gs, str) else gs.isSupportedDevice
        for name, kind in (("fabric_v3", getattr(N, "c_nvmlGpuFabricInfo_v3_t", None)),
                           ("fabric_v2", N.c_nvmlGpuFabricInfo_v2_t)):
            if kind is None:
                continue
            info = kind()
            r = _try(N.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))  # pynvml passes it on as is
            g[name] = r if isinstance(r, str) else {
                "state": info.state, "status": info.status, "cliqueId": info.cliqueId, "healthMask": info.healthMask,
                "healthSummary": getattr(info, "healthSummary", None)}
        c2c = _try(N.nvmlDeviceGetC2cModeInfoV, h)
        g["c2c"] = c2c if isinstance(c2c, str) else c2c.isC2cEnabled
        g["mig_mode"] = _try(N.nvmlDeviceGetMigMode, h)
        g["clocks_event_reasons"] = _try(N.nvmlDeviceGetCurrentClocksEventReasons, h)
        g["remapped_rows"] = _try(N.nvmlDeviceGetRemappedRows, h)
        procs = _try(N.nvmlDeviceGetComputeRunningProcesses, h)
        g["compute_processes"] = procs if isinstance(procs, str) else [p.pid for p in procs]
        g["call_median_us"] = _call_times(h, links)
        out["gpus"].append(g)
    return out


class _Counted:
    """A libnvidia-ml function that counts its calls; attributes go to the real one."""

    def __init__(self, name: str, fn: Any, counts: dict[str, int]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_counts", counts)

    def __call__(self, *args: Any) -> Any:
        self._counts[self._name] = self._counts.get(self._name, 0) + 1
        t0 = time.thread_time()
        try:
            return self._fn(*args)
        finally:
            key = self._name + " cpu_s"
            self._counts[key] = self._counts.get(key, 0) + time.thread_time() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


def calls(polls: int) -> dict:
    import pynvml as N

    memory = {"start": _memory()}
    counts: dict[str, Any] = {}
    real = N._nvmlGetFunctionPointer
    N._nvmlGetFunctionPointer = lambda name: _Counted(name, real(name), counts)

    from gpuwatch import logs
    from gpuwatch.agent import Agent
    from gpuwatch.config import Config

    logs.configure("error", "json")
    memory["imported"] = _memory()
    agent = Agent(Config())
    memory["agent"] = _memory()
    poller = agent.poller
    poller.poll_slow()
    poller.poll_fast()
    gpus = len(agent.store.snapshot().gpus)
    for _ in range(20):
        poller.poll_fast()
    counts.clear()
    cpu, wall = [], []
    for _ in range(polls):
        c0, w0 = time.process_time(), time.perf_counter()
        poller._poll("fast")  # poll_fast without its rules
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    polled = dict(counts)
    rules = []
    for _ in range(50):
        c0 = time.process_time()
        agent.evaluate_rules()
        rules.append(time.process_time() - c0)
    c0 = time.process_time()
    for _ in range(20):
        agent.exposition.render(openmetrics=False, compress=False)
        poller._poll("fast")
    render_and_poll = (time.process_time() - c0) / 20
    memory["polled"] = _memory()
    per = {k: round(v / polls / max(gpus, 1), 2) for k, v in sorted(polled.items()) if not k.endswith("cpu_s")}
    cpu_us = {k[:-6]: round(v / polls / max(gpus, 1) * 1e6, 1)
              for k, v in sorted(polled.items()) if k.endswith("cpu_s")}
    return {"gpus": gpus, "polls": polls, "nvml_calls_per_gpu_per_fast_poll": round(sum(per.values()), 2),
            "by_call": per, "cpu_us_per_gpu_per_poll_by_call": cpu_us, "memory_kb": memory,
            "fast_poll_cpu_ms_median": round(statistics.median(cpu) * 1e3, 3),
            "fast_poll_wall_ms_median": round(statistics.median(wall) * 1e3, 3),
            "rules_cpu_ms_median": round(statistics.median(rules) * 1e3, 3),
            "render_plus_poll_cpu_ms": round(render_and_poll * 1e3, 3)}


_IMPORTS = """
import json, sys, time
def rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS:')) / 1024
out = {'bare_mib': rss()}
import gpuwatch.cli.run, gpuwatch.agent, gpuwatch.config
out['imported_mib'] = rss()
from gpuwatch import logs
logs.configure('error', 'json')
agent = gpuwatch.agent.Agent(gpuwatch.config.Config())
agent.poller.poll_slow()
for _ in range(50):
    agent.poller.poll_fast()
agent.exposition.render(openmetrics=False, compress=False)
out['after_50_polls_mib'] = rss()
std = set(sys.stdlib_module_names)
top = {}
for name in sys.modules:
    head = name.split('.')[0]
    if head not in std and not head.startswith('_'):
        top[head] = top.get(head, 0) + 1
out['modules'] = len(sys.modules)
out['third_party_modules'] = dict(sorted(top.items(), key=lambda kv: -kv[1]))
print(json.dumps(out))
"""


def inside() -> dict:
    """Which reading fails where (the group's code line, or the field id), what each field costs, the imports."""
    import pynvml as N

    from gpuwatch import logs
    from gpuwatch.agent import Agent
    from gpuwatch.backends.nvml import calls as C
    from gpuwatch.backends.nvml import funnel as F
    from gpuwatch.config import Config

    failures: dict[str, int] = {}
    original_call, original_run = F.Query.__call__, C.Batch.run

    def call(self: Any, fn: Any) -> Any:
        before = len(self.errors)
        result = original_call(self, fn)
        if len(self.errors) > before:
            caller = sys._getframe(1)
            key = f"{caller.f_code.co_filename.rsplit('/', 2)[-1]}:{caller.f_lineno} {self.errors[-1]}"
            failures[key] = failures.get(key, 0) + 1
        return result

    def run(self: Any, handle: Any) -> Any:
        entries = original_run(self, handle)
        frame: Any = sys._getframe(1)
        depth = 0
        while frame is not None and depth < 8:  # a probe at discovery asks what is there: no failure
            if frame.f_code.co_name in ("_probe", "_probe_fields", "values"):
                return entries
            frame, depth = frame.f_back, depth + 1
        for key, entry in zip(self.ids, entries):
            if entry.nvmlReturn:
                name = f"field {key} ({self.owners.get(key)}): {N.NVMLError(entry.nvmlReturn)}"
                failures[name] = failures.get(name, 0) + 1
        return entries

    F.Query.__call__, C.Batch.run = call, run  # type: ignore[method-assign, assignment]
    logs.configure("error", "json")
    agent = Agent(Config())
    agent.poller.poll_slow()
    for _ in range(5):
        agent.poller.poll_fast()
    agent.poller.poll_slow()
    out: dict[str, Any] = {"failures": dict(failures)}
    backend = agent.backend
    try:
        out["batch_vs_alone"] = _batch_vs_alone(backend)
    except Exception as exc:
        out["batch_vs_alone"] = f"failed: {type(exc).__name__}: {exc}"
    fields: dict[str, Any] = {}
    for gpu in getattr(backend, "_devices", {}).values():
        for tier, batch in gpu.batches.items():
            def whole(b: Any = batch, h: Any = gpu.handle) -> None:
                b.run(h)
            fields[f"{tier} batch of {len(batch.ids)}"] = _cost(whole)
            for key in batch.ids:
                one = C.Batch({key: batch.owners[key]})
                fields[f"{tier} {key} {batch.owners[key]}"] = _cost(lambda o=one, h=gpu.handle: o.run(h))
        energy = N._nvmlGetFunctionPointer("nvmlDeviceGetTotalEnergyConsumption")
        joules = ctypes.c_ulonglong()
        fields["nvmlDeviceGetTotalEnergyConsumption"] = _cost(
            lambda h=gpu.handle, f=energy, v=joules: f(h, ctypes.byref(v)))
        break  # one GPU is enough
    out["cost_us"] = fields
    imports = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120)
    out["imports"] = json.loads(imports.stdout) if imports.returncode == 0 else imports.stderr[-3000:]
    timing = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gpuwatch.cli.run, gpuwatch.agent"],
                            capture_output=True, text=True, timeout=120)
    rows = []
    for line in timing.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    out["importtime_top_us"] = [f"{us} {name}" for us, name in sorted(rows, reverse=True)[:30]]
    return out


def _answer(entry: Any) -> Any:
    from gpuwatch.backends.nvml.structs import VALUE_MEMBERS

    if entry.nvmlReturn:
        return f"ret {entry.nvmlReturn}"
    kind = entry.valueType
    return [kind, getattr(entry.value, VALUE_MEMBERS[kind]) if kind < len(VALUE_MEMBERS) else None]


def _batch_vs_alone(backend: Any) -> dict[str, Any]:
    """The discovery's one batch of every field beside each field asked alone: where the answers differ."""
    from gpuwatch.backends.nvml import calls as C

    ids = dict(getattr(backend, "_field_ids", {}))
    out: dict[str, Any] = {"ids": len(ids)}
    for gpu in getattr(backend, "_devices", {}).values():
        together = dict(zip(ids, (_answer(e) for e in C.Batch(ids).run(gpu.handle))))
        for key, group in ids.items():
            try:
                alone = _answer(C.Batch({key: group}).run(gpu.handle)[0])
            except Exception as exc:  # the whole call refused
                alone = f"call: {exc}"
            both = together[key]
            if isinstance(both, str) != isinstance(alone, str):  # answered one way, refused the other
                out[f"{key} {group}"] = {"in the batch": both, "alone": alone}
        break
    return out


def _cost(fn: Any, n: int = 30) -> dict[str, float]:
    """Median CPU and wall time of one call, in microseconds."""
    cpu, wall = [], []
    for _ in range(n):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            fn()
        except Exception:
            pass
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu": round(statistics.median(cpu) * 1e6, 1), "wall": round(statistics.median(wall) * 1e6, 1)}


def _memory() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _exporter(name: str, argv: list[str], env: dict, port: int, poll: float, seconds: float,
              scrape_every: float) -> dict:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                said = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")[-2000:]
                return {"error": f"{name} did not answer: {said}"}
            time.sleep(0.2)
    time.sleep(5)  # warm-up: the first slow-tier reads, the caches
    lat: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(scrape_every):
            t0 = time.perf_counter()
            urllib.request.urlopen(url, timeout=10).read()
            lat.append(time.perf_counter() - t0)

    t = threading.Thread(target=scraper)
    c0, w0 = _cpu_seconds(proc.pid), time.monotonic()
    if scrape_every:
        t.start()
    time.sleep(seconds)
    stop.set()
    if scrape_every:
        t.join()
    cpu, wall = _cpu_seconds(proc.pid) - c0, time.monotonic() - w0
    alone = []
    for _ in range(100):
        t0 = time.perf_counter()
        urllib.request.urlopen(url, timeout=10).read()
        alone.append(time.perf_counter() - t0)
    rss = _rss_mib(proc.pid)
    proc.terminate()
    proc.wait(timeout=20)
    alone.sort()
    return {"poll_s": poll, "scrape_every_s": scrape_every, "seconds": round(wall, 1),
            "cpu_ms_per_s": round(cpu / wall * 1e3, 2), "cpu_ms_per_poll": round(cpu / (wall / poll) * 1e3, 3),
            "rss_mib": round(rss, 1), "scrapes": len(lat),
            "scrape_p50_ms": round(alone[49] * 1e3, 2), "scrape_p99_ms": round(alone[98] * 1e3, 2)}


def cost(peer_path: str | None, seconds: float, cases: str = "all") -> dict:
    out: dict[str, Any] = {}
    env = dict(os.environ)
    chosen = ((0.5, 1.0), (2.0, 15.0), (2.0, 0.0)) if cases == "all" else ((0.5, 1.0),)
    for poll, scrape in chosen:
        key = f"poll {poll} s, scrape {'every ' + str(scrape) + ' s' if scrape else 'none'}"
        out[key] = {"gpuwatch": _exporter(
            "gpuwatch", [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:19501",
                         "--poll.interval", str(poll), "--log.level", "warning"], env, 19501, poll, seconds, scrape)}
        if peer_path and scrape:
            penv = dict(env, PYTHONPATH=peer_path)
            out[key]["nvitop-exporter"] = _exporter(
                "nvitop-exporter", [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1",
                                    "--port", "19502", "--interval", str(poll)], penv, 19502, poll, seconds, scrape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["probe", "calls", "cost", "inside"])
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--cases", choices=["all", "fast"], default="all",
                    help="cost: every cadence, or the 0.5 s polls with a scrape a second alone")
    ap.add_argument("--peer-path", help="a folder holding nvitop, nvitop-exporter and their dependencies")
    args = ap.parse_args()
    chosen = {"probe": probe, "calls": lambda: calls(args.polls), "inside": inside,
              "cost": lambda: cost(args.peer_path, args.seconds, args.cases)}
    result = chosen[args.what]()
    json.dump(result, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main()
