"""In-process measurements, run by bench.py in a subprocess whose environment loads the fake
libnvidia-ml.so.1 (LD_LIBRARY_PATH must be set before Python starts, so this cannot run inside
bench.py itself).

    FAKE_NVML_STATE=... FAKE_NVML_COUNTS=... LD_LIBRARY_PATH=<fake lib dir> \
        python bench/inproc.py --out result.json [--rounds-fast N ...]

Measures, with ``time.process_time`` (CPU time of this process; only the main thread runs):

- ``NvmlBackend.read_fast`` / ``read_slow`` for every GPU, per GPU per poll (median over rounds);
- ``Poller.poll_fast`` over a ``Store`` with a ``SystemClock`` (the whole fast poll path, store
  updates included; no scheduler threads are started), per GPU per poll;
- NVML calls per GPU per poll, from the fake library's call counters (FAKE_NVML_COUNTS);
- the CPU cost of one call into the fake library through ctypes without pynvml (the estimate of
  the time spent "inside the library"), through pynvml, and of a ctypes call into a trivial libc
  function (the FFI floor).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # fakenvml (read_counts)

import fakenvml  # noqa: E402
import pynvml as N  # noqa: E402

from gpuwatch import logs  # noqa: E402
from gpuwatch.backends.nvml import _FAST_FIELDS, _SLOW_FIELDS, NvmlBackend  # noqa: E402
from gpuwatch.clock import SystemClock  # noqa: E402
from gpuwatch.poller import Poller  # noqa: E402
from gpuwatch.store import Store  # noqa: E402


def counts() -> dict[str, int]:
    return fakenvml.read_counts(os.environ["FAKE_NVML_COUNTS"])


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def per_gpu_rounds(fn, uuids: list[str], rounds: int, warmup: int) -> dict:
    """CPU (and wall) seconds per GPU per poll, one sample per round over all GPUs."""
    for _ in range(warmup):
        for uuid in uuids:
            fn(uuid)
    before = counts()
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        for uuid in uuids:
            fn(uuid)
        c1, w1 = time.process_time(), time.perf_counter()
        cpu.append((c1 - c0) / len(uuids))
        wall.append((w1 - w0) / len(uuids))
    calls = diff(counts(), before)
    return summary(cpu, wall) | {"calls_per_gpu_poll": per_poll(calls, rounds * len(uuids))}


def summary(cpu: list[float], wall: list[float]) -> dict:
    return {
        "rounds": len(cpu),
        "cpu_us_median": statistics.median(cpu) * 1e6,
        "cpu_us_mean": statistics.fmean(cpu) * 1e6,
        "cpu_us_min": min(cpu) * 1e6,
        "wall_us_median": statistics.median(wall) * 1e6,
    }


def per_poll(calls: dict[str, int], gpu_polls: int) -> dict:
    by_symbol = {k: v / gpu_polls for k, v in sorted(calls.items())}
    return {"total": sum(by_symbol.values()), "by_symbol": by_symbol}


def cost_per_call(fn, iterations: int, repeats: int = 5) -> float:
    """Median over repeats of CPU seconds per call of fn()."""
    samples = []
    for _ in range(repeats):
        c0 = time.process_time()
        for _ in range(iterations):
            fn()
        samples.append((time.process_time() - c0) / iterations)
    return statistics.median(samples)


def call_costs(iterations: int) -> dict:
    """Per-call CPU cost: raw ctypes into the fake library, the same through pynvml, the FFI floor."""
    handle = N.nvmlDeviceGetHandleByIndex(0)
    lib = N.nvmlLib  # the CDLL pynvml loaded: the fake libnvidia-ml.so.1
    power = lib.nvmlDeviceGetPowerUsage
    out = ctypes.c_uint()
    out_ref = ctypes.byref(out)

    def raw_power():
        power(handle, out_ref)

    def pynvml_power():
        N.nvmlDeviceGetPowerUsage(handle)

    field_fn = lib.nvmlDeviceGetFieldValues

    def raw_fields(ids):
        arr = (N.c_nvmlFieldValue_t * len(ids))()
        for i, fid in enumerate(ids):
            arr[i].fieldId = fid
        n = ctypes.c_int32(len(ids))
        ref = ctypes.byref(arr)
        return lambda: field_fn(handle, n, ref)  # prebuilt array: only the C call is timed

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    labs = libc.labs
    arg = ctypes.c_long(-3)

    def ffi_floor():
        labs(arg)

    fast_ids, slow_ids = list(_FAST_FIELDS), list(_SLOW_FIELDS)
    return {
        "iterations": iterations,
        "raw_scalar_call_us": cost_per_call(raw_power, iterations) * 1e6,
        "pynvml_scalar_call_us": cost_per_call(pynvml_power, iterations) * 1e6,
        "raw_fieldvalues_fast_call_us": cost_per_call(raw_fields(fast_ids), iterations) * 1e6,
        "raw_fieldvalues_slow_call_us": cost_per_call(raw_fields(slow_ids), iterations) * 1e6,
        "fast_field_ids": len(fast_ids),
        "slow_field_ids": len(slow_ids),
        "ctypes_libc_labs_call_us": cost_per_call(ffi_floor, iterations) * 1e6,
    }


def library_estimate_us(calls: dict, costs: dict, tier: str) -> float:
    """Calls per GPU per poll x raw ctypes cost per call (GetFieldValues priced on its own)."""
    by = calls["by_symbol"]
    fields = by.get("nvmlDeviceGetFieldValues", 0.0)
    others = calls["total"] - fields
    return others * costs["raw_scalar_call_us"] + fields * costs[f"raw_fieldvalues_{tier}_call_us"]


def agent_poll(gpus: int, rounds: int, warmup: int, fill_window: bool) -> dict:
    """Agent.poller.poll_fast, with the daemon's defaults (2 s / 30 s), on a FakeClock moved by one fast
    interval per poll, so that time-bounded state (the rules' history window) holds what it holds in a
    real daemon: polling back to back on the system clock would pile every poll into the window."""
    from gpuwatch import cli
    from gpuwatch import config as configuration
    from gpuwatch.clock import FakeClock

    config = configuration.load(cli._parser().parse_args(["run"]))
    clock = FakeClock()
    agent = cli.Agent(config, clock=clock)
    poller = agent.poller
    interval = config.poll_interval
    slow_every = max(1, round(config.poll_slow_interval / interval))
    window = float(getattr(config, "rules_window", 0.0) or 0.0)
    steady = math.ceil(window / interval) if window else 0  # fast polls that fill the rules' window
    polls = 0

    def tick() -> None:
        nonlocal polls
        clock.advance(interval)
        polls += 1
        if polls % slow_every == 0:
            poller.poll_slow()  # outside the timed region, as often as the daemon does it

    poller.poll_fast()
    assert poller.backend_up, "the agent's backend did not come up"
    for _ in range(max(warmup, steady if fill_window else min(steady, 60))):
        tick()
        poller.poll_fast()
    cpu, wall = [], []
    calls: dict[str, int] = {}
    for _ in range(rounds):
        tick()
        before = counts()  # around each fast poll only: the slow polls in tick() are not counted
        c0, w0 = time.process_time(), time.perf_counter()
        poller.poll_fast()
        c1, w1 = time.process_time(), time.perf_counter()
        for symbol, n in diff(counts(), before).items():
            calls[symbol] = calls.get(symbol, 0) + n
        cpu.append((c1 - c0) / gpus)
        wall.append((w1 - w0) / gpus)
    out = summary(cpu, wall) | {
        "calls_per_gpu_poll": per_poll(calls, rounds * gpus), "fast_interval_s": interval,
        "rules_window_s": window, "polls_before_measuring": polls - rounds, "window_full": polls - rounds >= steady}
    evaluate = getattr(poller, "evaluate", None)
    if evaluate is not None and getattr(agent, "engine", None) is not None:
        # The rules also run on their own timer, once per fast interval, between polls.
        samples = []
        for _ in range(max(20, rounds // 2)):
            c0 = time.process_time()
            evaluate()
            samples.append((time.process_time() - c0) / gpus)
        out["rules_evaluate_cpu_us_median"] = statistics.median(samples) * 1e6
    poller.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds-fast", type=int, default=400)
    ap.add_argument("--rounds-slow", type=int, default=100)
    ap.add_argument("--rounds-poll", type=int, default=400)
    ap.add_argument("--rounds-agent", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="do not fill the rules' window before measuring")
    ap.add_argument("--call-iterations", type=int, default=20000)
    args = ap.parse_args()
    logs.configure("error", "json")

    backend = NvmlBackend()
    backend.open()
    gpus = backend.discover()
    uuids = [g.identity.uuid for g in gpus]
    result: dict = {"gpus": len(uuids)}
    result["read_fast"] = per_gpu_rounds(backend.read_fast, uuids, args.rounds_fast, args.warmup)
    result["read_slow"] = per_gpu_rounds(backend.read_slow, uuids, args.rounds_slow, args.warmup)

    # The whole fast poll path: Poller.poll_fast -> backend.read_fast -> Store.put_fast, per GPU.
    clock = SystemClock()
    store = Store(clock, "nvml")
    poller = Poller(NvmlBackend(), store, clock, fast_interval=2.0, slow_interval=30.0)
    poller.poll_fast()  # opens the backend, discovers, runs the first slow poll
    assert poller.backend_up and len(store.visible_uuids()) == len(uuids), "poller did not come up"
    for _ in range(args.warmup):
        poller.poll_fast()
    before = counts()
    cpu, wall = [], []
    for _ in range(args.rounds_poll):
        c0, w0 = time.process_time(), time.perf_counter()
        poller.poll_fast()
        c1, w1 = time.process_time(), time.perf_counter()
        cpu.append((c1 - c0) / len(uuids))
        wall.append((w1 - w0) / len(uuids))
    calls = per_poll(diff(counts(), before), args.rounds_poll * len(uuids))
    result["poll_fast"] = summary(cpu, wall) | {"calls_per_gpu_poll": calls}
    snap = store.snapshot()
    result["poll_fast"]["last_success"] = snap.tiers["fast"].success
    poller.stop()

    # The same through the daemon's own wiring (gpuwatch.cli.Agent): whatever `gpuwatch run` does per
    # fast poll (e.g. the rule engine after every poll) is included. No HTTP server, no scheduler.
    try:
        result["agent_poll_fast"] = agent_poll(len(uuids), args.rounds_agent, args.warmup, not args.quick)
    except Exception as exc:
        result["agent_poll_fast_error"] = f"{type(exc).__name__}: {exc}"

    costs = call_costs(args.call_iterations)
    result["call_costs"] = costs
    for key, tier in (("read_fast", "fast"), ("read_slow", "slow"), ("poll_fast", "fast"),
                      ("agent_poll_fast", "fast")):
        if key not in result:
            continue
        lib = library_estimate_us(result[key]["calls_per_gpu_poll"], costs, tier)
        result[key]["library_estimate_us"] = lib
        result[key]["cpu_us_excluding_library"] = result[key]["cpu_us_median"] - lib
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
