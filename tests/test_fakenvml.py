"""Tests for the fake libnvidia-ml.so.1 (tests/fakenvml) driven through the real pynvml.

Each test starts a fresh Python subprocess with LD_LIBRARY_PATH pointing at the
fake library (it can only be picked up at process start) and runs a small
script that calls pynvml directly. The child prints JSON lines; interactive
tests talk to it over stdin/stdout while rewriting the state file.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fakenvml
from fakenvml import FakeNode, prepare, read_counts, read_cpu_seconds

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fake NVML needs Linux (LD_LIBRARY_PATH)"),
    pytest.mark.skipif(
        not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")),
        reason="no C compiler to build the fake libnvidia-ml.so.1",
    ),
]

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, sys, threading, time
    import pynvml as N

    def out(obj):
        print(json.dumps(obj), flush=True)

    def wait_parent():
        sys.stdin.readline()

    def call(fn, *args):
        '''The result, or the pynvml exception class name.'''
        try:
            return fn(*args)
        except (N.NVMLError, N.NVMLLibraryMismatchError) as exc:
            return type(exc).__name__

    def rpm(handle, fan):
        '''nvmlDeviceGetFanSpeedRPM for any fan (the wrapper hard-codes fan 0).'''
        info = N.c_nvmlFanSpeedInfo_t()
        info.version = N.nvmlFanSpeedInfo_v1
        info.fan = fan
        ret = N._nvmlGetFunctionPointer("nvmlDeviceGetFanSpeedRPM")(handle, ctypes.byref(info))
        N._nvmlCheckReturn(ret)
        return info.speed

    def xid_events(gpu=0):
        '''nvmlInit, then an event set with GPU ``gpu`` registered in it for XIDs.'''
        N.nvmlInit()
        es = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(gpu), N.nvmlEventTypeXidCriticalError, es)
        return es

    def fields(handle, ids):
        return [
            {"id": v.fieldId, "ret": v.nvmlReturn, "type": v.valueType,
             "ui": v.value.uiVal, "ull": v.value.ullVal, "si": v.value.siVal}
            for v in N.nvmlDeviceGetFieldValues(handle, ids)
        ]
    """
)


def wait_until(condition, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it is true (no fixed sleeps); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        time.sleep(0.01)


def run_child(fx, body: str, timeout: float = 20, **extra_env: str) -> dict:
    """Run PRELUDE + body in a subprocess using the fake; return its last JSON line."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        env={**fx.env, **extra_env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Child:
    """An interactive child: read JSON lines from it, poke it via stdin."""

    def __init__(self, fx, body: str, **extra_env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
            env={**fx.env, **extra_env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(f"child exited early:\n{self.proc.stderr.read()}")
        return json.loads(line)

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 10):
        rc = self.proc.wait(timeout=timeout)
        err = self.proc.stderr.read()
        assert rc == 0, f"child failed:\n{err}"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def child_factory():
    children: list[Child] = []

    def make(fx, body, **extra_env):
        c = Child(fx, body, **extra_env)
        children.append(c)
        return c

    yield make
    for c in children:
        c.kill()


# ---------------------------------------------------------------------------


def test_build_is_cached_and_variants_differ():
    new_dir = fakenvml.build()
    old_dir = fakenvml.build(old_driver=True)
    assert new_dir != old_dir
    lib = new_dir / fakenvml.LIB_NAME
    mtime = lib.stat().st_mtime_ns
    assert fakenvml.build() == new_dir and lib.stat().st_mtime_ns == mtime  # cached
    env = fakenvml.env(new_dir, "/x/state")
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(new_dir)
    assert env["FAKE_NVML_STATE"] == "/x/state" and "FAKE_NVML_COUNTS" not in env


def test_identity_and_values_round_trip(tmp_path):
    node = FakeNode.from_profiles(["h200", "rtx"])
    node.gpus[0].add_process(4242, 1536 * fakenvml.MIB)
    node.gpus[0].add_process(4343, None)
    node.gpus[0].set_field(250, 1.5, "d")
    fx = prepare(tmp_path, node)
    h200, rtx = node.gpus

    r = run_child(
        fx,
        """
        N.nvmlInit()
        res = {"driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
               "cuda": N.nvmlSystemGetCudaDriverVersion(), "cuda2": N.nvmlSystemGetCudaDriverVersion_v2(),
               "count": N.nvmlDeviceGetCount(), "bad_index": call(N.nvmlDeviceGetHandleByIndex, 2), "gpus": []}
        for i in range(2):
            h = N.nvmlDeviceGetHandleByIndex(i)
            pci = N.nvmlDeviceGetPciInfo(h)
            m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            m1 = N.nvmlDeviceGetMemoryInfo(h)
            res["gpus"].append({
                "uuid": N.nvmlDeviceGetUUID(h), "name": N.nvmlDeviceGetName(h), "bus": pci.busId,
                "bus_legacy": pci.busIdLegacy, "pci_dev": pci.pciDeviceId, "serial": N.nvmlDeviceGetSerial(h),
                "minor": N.nvmlDeviceGetMinorNumber(h), "vbios": N.nvmlDeviceGetVbiosVersion(h),
                "arch": N.nvmlDeviceGetArchitecture(h), "index": N.nvmlDeviceGetIndex(h),
                "by_uuid": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(h))),
                "tempV": N.nvmlDeviceGetTemperatureV(h, N.NVML_TEMPERATURE_GPU),
                "temp": N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
                "margin": call(N.nvmlDeviceGetMarginTemperature, h),
                "thresholds": [call(N.nvmlDeviceGetTemperatureThreshold, h, t) for t in range(4)],
                "num_fans": call(N.nvmlDeviceGetNumFans, h),
                "fan": call(N.nvmlDeviceGetFanSpeed, h),
                "fans": [call(N.nvmlDeviceGetFanSpeed_v2, h, f) for f in range(3)],
                "targets": [call(N.nvmlDeviceGetTargetFanSpeed, h, f) for f in range(2)],
                "rpm_wrapper": call(N.nvmlDeviceGetFanSpeedRPM, h),
                "rpms": [call(rpm, h, f) for f in range(3)],
                "power": N.nvmlDeviceGetPowerUsage(h), "energy": N.nvmlDeviceGetTotalEnergyConsumption(h),
                "enforced": N.nvmlDeviceGetEnforcedPowerLimit(h),
                "constraints": N.nvmlDeviceGetPowerManagementLimitConstraints(h),
                "pstate": N.nvmlDeviceGetPerformanceState(h),
                "util": [N.nvmlDeviceGetUtilizationRates(h).gpu, N.nvmlDeviceGetUtilizationRates(h).memory],
                "enc": N.nvmlDeviceGetEncoderUtilization(h),
                "mem_v2": [m2.version, m2.total, m2.reserved, m2.used, m2.free],
                "mem_v1": [m1.total, m1.used, m1.free],
                "mem_bad_version": call(N.nvmlDeviceGetMemoryInfo, h, 1),
                "clocks": [N.nvmlDeviceGetClockInfo(h, t) for t in range(4)],
                "max_clocks": [N.nvmlDeviceGetMaxClockInfo(h, t) for t in range(4)],
                "reasons": N.nvmlDeviceGetCurrentClocksEventReasons(h),
                "reasons_old": N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                "supported_reasons": N.nvmlDeviceGetSupportedClocksEventReasons(h),
                "pcie": [N.nvmlDeviceGetCurrPcieLinkGeneration(h), N.nvmlDeviceGetCurrPcieLinkWidth(h),
                         N.nvmlDeviceGetMaxPcieLinkGeneration(h), N.nvmlDeviceGetMaxPcieLinkWidth(h),
                         N.nvmlDeviceGetPcieReplayCounter(h)],
                "ecc_mode": call(N.nvmlDeviceGetEccMode, h),
                "ecc_dbe_agg": call(N.nvmlDeviceGetTotalEccErrors, h, 1, 1),
                "remapped": call(N.nvmlDeviceGetRemappedRows, h),
                "retired_pending": call(N.nvmlDeviceGetRetiredPagesPendingStatus, h),
                "fields": fields(h, [3, 31, 74, 82, 83, 94, 142, 193, 194, 195, 196, 269, 9999]),
                "double_field": call(lambda: N.nvmlDeviceGetFieldValues(h, [250])[0].value.dVal),
                "procs": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
                "procs_v2": [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)],
                "gfx": N.nvmlDeviceGetGraphicsRunningProcesses(h),
                "events": N.nvmlDeviceGetSupportedEventTypes(h),
            })
        N.nvmlShutdown()
        res["after_shutdown"] = call(N.nvmlDeviceGetCount)
        out(res)
        """,
    )
    assert r["driver"] == "590.48.01" and r["nvml"] == "13.590.48.01"
    assert r["cuda"] == r["cuda2"] == 13010
    assert r["count"] == 2
    assert r["bad_index"] == "NVMLError_InvalidArgument"
    assert r["after_shutdown"] == "NVMLError_Uninitialized"
    g0, g1 = r["gpus"]

    # identity
    for g, fake in ((g0, h200), (g1, rtx)):
        assert g["uuid"] == fake.uuid and g["serial"] == fake.serial and g["bus"] == fake.pci_bus_id
        assert g["name"] == fake.name and g["vbios"] == fake.vbios and g["arch"] == fake.architecture
    assert g0["uuid"] != g1["uuid"] and g0["bus"] != g1["bus"] and g0["serial"] != g1["serial"]
    assert g0["bus"] == "00000000:18:00.0" and g0["bus_legacy"] == "0000:18:00.0"
    assert g0["pci_dev"] == 0x233510DE and g0["arch"] == 9 and g1["arch"] == 8
    assert [g0["index"], g1["index"]] == [0, 1] and [g0["by_uuid"], g1["by_uuid"]] == [0, 1]
    assert [g0["minor"], g1["minor"]] == [0, 1]

    # H200: T.Limit world, no fans
    assert g0["tempV"] == g0["temp"] == 28 and g0["margin"] == 59
    assert g0["thresholds"] == ["NVMLError_NotSupported"] * 4
    for key in ("num_fans", "fan", "rpm_wrapper"):
        assert g0[key] == "NVMLError_NotSupported"
    assert g0["fans"] == ["NVMLError_NotSupported"] * 3 and g0["rpms"] == ["NVMLError_NotSupported"] * 3
    assert g0["power"] == 77_670 and g0["energy"] == 91_234_567 and g0["enforced"] == 700_000
    assert g0["constraints"] == [200_000, 700_000] and g0["pstate"] == 0
    mib = fakenvml.MIB
    assert g0["mem_v2"] == [0x02000028, 143_771 * mib, 614 * mib, 0, (143_771 - 614) * mib]
    assert g0["mem_v1"] == [143_771 * mib, 614 * mib, (143_771 - 614) * mib]
    assert g0["mem_bad_version"] == "NVMLError_ArgumentVersionMismatch"
    assert g0["clocks"] == [345, 345, 3201, 765] and g0["max_clocks"] == [1980, 1980, 3201, 1545]
    assert g0["reasons"] == g0["reasons_old"] == 0x1 and g0["supported_reasons"] == 0x1FF
    assert g0["pcie"] == [5, 16, 5, 16, 0]
    assert g0["ecc_mode"] == [1, 1] and g0["ecc_dbe_agg"] == 0 and g0["remapped"] == [0, 0, 0, 0]
    assert g0["retired_pending"] == "NVMLError_NotSupported"
    f0 = {f["id"]: f for f in g0["fields"]}
    assert (f0[3]["ret"], f0[3]["type"], f0[3]["ull"]) == (0, 3, 0)
    assert f0[31]["ret"] == 3  # retired pages: NOT_SUPPORTED on HBM3e parts
    assert (f0[82]["ret"], f0[82]["type"], f0[82]["ui"]) == (0, 1, 32)
    assert (f0[83]["type"], f0[83]["ull"]) == (3, 91_234_567)
    assert [(f0[i]["type"], f0[i]["si"]) for i in (193, 194, 195, 196)] == [(5, -8), (5, -2), (5, 0), (5, 0)]
    assert f0[269]["ret"] == 0 and f0[9999]["ret"] == 3
    assert g0["double_field"] == 1.5
    assert g0["procs"] == [[4242, 1536 * mib], [4343, None]] and g0["procs_v2"] == [4242, 4343]
    assert g0["gfx"] == [] and g0["events"] & 0x8

    # RTX: two fans, absolute thresholds, no margin / memory temperature / ECC / row remapping
    assert g1["tempV"] == 43 and g1["margin"] == "NVMLError_NotSupported"
    assert g1["thresholds"] == [101, 96, "NVMLError_NotSupported", 90]
    assert g1["num_fans"] == 2 and g1["fan"] == 38
    assert g1["fans"] == [38, 38, "NVMLError_InvalidArgument"]
    assert g1["targets"] == [38, 38]
    assert g1["rpm_wrapper"] == 1500 and g1["rpms"] == [1500, 1530, "NVMLError_InvalidArgument"]
    assert g1["mem_v2"][2:] == [434 * mib, 596 * mib, (16_376 - 434 - 596) * mib]
    assert g1["mem_v1"][1] == (434 + 596) * mib  # v1 "used" includes reserved
    assert g1["ecc_mode"] == g1["ecc_dbe_agg"] == g1["remapped"] == "NVMLError_NotSupported"
    f1 = {f["id"]: f for f in g1["fields"]}
    for fid in (3, 31, 82, 142, 193, 194, 195, 196, 9999):
        assert f1[fid]["ret"] == 3, fid
    assert f1[83]["ret"] == 0 and f1[74]["ret"] == 0 and f1[269]["ret"] == 0
    assert g1["double_field"] == "NVMLError_NotSupported"  # only entry failed -> call fails
    assert g1["pstate"] == 8 and g1["pcie"][:3] == [1, 16, 4]


def test_error_injection(tmp_path):
    node = FakeNode.h200(count=3)
    node.gpus[0].set_error("nvmlDeviceGetPowerUsage", 3)
    node.gpus[1].set_error("nvmlDeviceGetTemperatureV", fakenvml.ERROR_UNKNOWN)
    node.set_error("nvmlDeviceGetEnforcedPowerLimit", 4)  # every GPU
    node.gpus[2].set_field_error(83, 15)
    node.gpus[2].set_field_error(82, 3)
    node.gpus[2].unsupported.add("nvmlDeviceGetUtilizationRates")
    fx = prepare(tmp_path, node)
    r = run_child(
        fx,
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        out({
            "power": [call(N.nvmlDeviceGetPowerUsage, x) for x in h],
            "tempV": [call(N.nvmlDeviceGetTemperatureV, x, 0) for x in h],
            "enforced": [call(N.nvmlDeviceGetEnforcedPowerLimit, x) for x in h],
            "util": call(lambda: N.nvmlDeviceGetUtilizationRates(h[2]).gpu),
            "f2": [[f["id"], f["ret"]] for f in fields(h[2], [82, 83, 94])],
            "all_failed": call(N.nvmlDeviceGetFieldValues, h[2], [82, 83]),
            "is_not_supported": isinstance(call(lambda: N.nvmlDeviceGetPowerUsage(h[0])), str)
                and issubclass(N.nvmlExceptionClass(3), N.NVMLError),
        })
        """,
    )
    assert r["power"] == ["NVMLError_NotSupported", 77_670, 77_670]
    assert r["tempV"] == [28, "NVMLError_Unknown", 28]
    assert r["enforced"] == ["NVMLError_NoPermission"] * 3
    assert r["util"] == "NVMLError_NotSupported"
    assert r["f2"] == [[82, 3], [83, 15], [94, 0]]
    # no entry succeeded -> the call itself fails with the first entry's code
    assert r["all_failed"] == "NVMLError_NotSupported"


def test_lost_gpu(tmp_path, child_factory):
    node = FakeNode.h200(count=2)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        out("ready"); wait_parent()
        deadline = time.monotonic() + 5
        while call(N.nvmlDeviceGetTemperatureV, h[1], 0) == 28 and time.monotonic() < deadline:
            time.sleep(0.01)
        calls = {
            "name": lambda x: N.nvmlDeviceGetName(x), "uuid": lambda x: N.nvmlDeviceGetUUID(x),
            "pci": lambda x: N.nvmlDeviceGetPciInfo(x), "tempV": lambda x: N.nvmlDeviceGetTemperatureV(x, 0),
            "temp": lambda x: N.nvmlDeviceGetTemperature(x, 0),
            "margin": lambda x: N.nvmlDeviceGetMarginTemperature(x),
            "fans": lambda x: N.nvmlDeviceGetNumFans(x), "power": lambda x: N.nvmlDeviceGetPowerUsage(x),
            "energy": lambda x: N.nvmlDeviceGetTotalEnergyConsumption(x),
            "mem": lambda x: N.nvmlDeviceGetMemoryInfo(x, N.nvmlMemory_v2),
            "clock": lambda x: N.nvmlDeviceGetClockInfo(x, 0),
            "reasons": lambda x: N.nvmlDeviceGetCurrentClocksEventReasons(x),
            "pcie": lambda x: N.nvmlDeviceGetCurrPcieLinkGeneration(x),
            "ecc": lambda x: N.nvmlDeviceGetTotalEccErrors(x, 0, 0),
            "remap": lambda x: N.nvmlDeviceGetRemappedRows(x),
            "fields": lambda x: N.nvmlDeviceGetFieldValues(x, [83]),
            "procs": lambda x: N.nvmlDeviceGetComputeRunningProcesses(x),
            "index": lambda x: N.nvmlDeviceGetIndex(x),
        }
        out({
            "lost": {k: call(fn, h[1]) for k, fn in calls.items()},
            "other": call(N.nvmlDeviceGetTemperatureV, h[0], 0),
            "by_index": call(N.nvmlDeviceGetHandleByIndex, 1),
            "count": N.nvmlDeviceGetCount(),
        })
        """,
    )
    try:
        assert child.read() == "ready"
        node.gpus[1].lost = True
        node.write(fx.state_path)
        child.go()
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert set(r["lost"].values()) == {"NVMLError_GpuIsLost"}, r["lost"]
    assert r["other"] == 28 and r["by_index"] == "NVMLError_GpuIsLost" and r["count"] == 2


@pytest.mark.parametrize(
    "code, exc_name",
    [(9, "NVMLError_DriverNotLoaded"), (18, "NVMLError_LibRmVersionMismatch")],
)
def test_init_error_then_cleared_while_running(tmp_path, child_factory, code, exc_name):
    node = FakeNode.h200(count=1, init_error=code)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        out({"init": call(N.nvmlInit), "count_before_init": call(N.nvmlDeviceGetCount)})
        wait_parent()
        out({"init": call(N.nvmlInit), "count": N.nvmlDeviceGetCount()})
        """,
    )
    try:
        first = child.read()
        assert first == {"init": exc_name, "count_before_init": "NVMLError_Uninitialized"}
        node.init_error = 0
        node.write(fx.state_path)
        child.go()
        assert child.read() == {"init": None, "count": 1}
        child.finish()
    finally:
        child.kill()


def test_state_rewrite_changes_readings(tmp_path, child_factory):
    node = FakeNode.rtx(count=1)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out([N.nvmlDeviceGetTemperatureV(h, 0), N.nvmlDeviceGetFanSpeed_v2(h, 1)])
        wait_parent()
        start = time.monotonic()
        while N.nvmlDeviceGetTemperatureV(h, 0) == 43 and time.monotonic() - start < 20:
            pass  # tight loop until the new state shows (a deadline, not a timing: the fake stat()s every 50 ms)
        out({"temp": N.nvmlDeviceGetTemperatureV(h, 0), "fan1": N.nvmlDeviceGetFanSpeed_v2(h, 1),
             "rpm1": rpm(h, 1)})
        """,
    )
    try:
        assert child.read() == [43, 38]
        node.gpus[0].temperature = 91
        node.gpus[0].fan_speeds[1] = 100
        node.gpus[0].fan_rpms[1] = 0  # stuck fan
        node.write(fx.state_path)
        child.go()
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert (r["temp"], r["fan1"], r["rpm1"]) == (91, 100, 0)  # seen: the loop ended on the change


def test_xid_event_delivered_once(tmp_path, child_factory):
    node = FakeNode.h200(count=2)
    node.add_xid(gpu=1, xid=79)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        N.nvmlInit()
        es = N.nvmlEventSetCreate()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        for x in h:
            N.nvmlDeviceRegisterEvents(x, N.nvmlEventTypeXidCriticalError & N.nvmlDeviceGetSupportedEventTypes(x), es)
        d = N.nvmlEventSetWait_v2(es, 1000)
        first = {"type": d.eventType, "data": d.eventData, "gpu": N.nvmlDeviceGetIndex(d.device),
                 "gi": d.gpuInstanceId}
        second = call(N.nvmlEventSetWait_v2, es, 200)
        out({"first": first, "second": second,
             "bad_register": call(N.nvmlDeviceRegisterEvents, h[0], 0x40000000, es)})
        wait_parent()
        # the parent queues a new XID after this wait began: it returns that event (a timeout would raise)
        d = call(N.nvmlEventSetWait_v2, es, 60000)
        out({"data": d.eventData, "gpu": N.nvmlDeviceGetIndex(d.device), "then": call(N.nvmlEventSetWait, es, 0)})
        N.nvmlEventSetFree(es)
        """,
    )
    try:
        r = child.read()
        assert r["first"] == {"type": 0x8, "data": 79, "gpu": 1, "gi": 0xFFFFFFFF}
        assert r["second"] == "NVMLError_Timeout"
        assert r["bad_register"] == "NVMLError_NotSupported"
        child.go()
        node.add_xid(gpu=0, xid=48)
        node.write(fx.state_path)
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert (r["data"], r["gpu"], r["then"]) == (48, 0, "NVMLError_Timeout")


def test_event_wait_sleeps_until_the_state_file_changes(tmp_path, child_factory):
    """A wait with nothing queued sleeps as a real driver's does (it polled the state file every 10 ms: 100
    wake-ups a second, which a benchmark of the daemon then took off as the library's CPU), and wakes for a
    change of the state file, written in place as well as replaced."""
    node = FakeNode.l40s(count=1)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        import resource
        es = xid_events()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        idle = call(N.nvmlEventSetWait_v2, es, 1000)
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
        out({"idle": idle, "switches": switches})
        wait_parent()
        d = call(N.nvmlEventSetWait_v2, es, 60000)  # the parent writes the file in place: a timeout would raise
        out({"data": d.eventData})
        N.nvmlEventSetFree(es)
        """,
    )
    try:
        r = child.read()
        assert r["idle"] == "NVMLError_Timeout"
        assert r["switches"] <= 30, r  # at most one wake-up per 100 ms, and a few more
        child.go()
        node.add_xid(gpu=0, xid=79)
        fx.state_path.write_text(node.render())  # in place, not by a rename
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert r["data"] == 79


def test_a_long_event_wait_counts_its_cpu_as_it_goes(tmp_path, child_factory):
    """FAKE_NVML_CPU's sum takes in a wait's CPU at each of its wake-ups, not only when the call returns: a
    benchmark's window that ends in the middle of a 10 s wait (the daemon's events thread) would otherwise
    miss what the wait spent in the window and count it in the next, moving a window's figure by up to a
    wait's CPU at each of its edges."""
    node = FakeNode.l40s(count=1)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        es = xid_events()
        entered = threading.Event()
        def wait():
            entered.set()
            d = N.nvmlEventSetWait_v2(es, 60000)
            out({"data": d.eventData})
        t = threading.Thread(target=wait)
        t.start()
        entered.wait()
        out("waiting")
        t.join()
        N.nvmlEventSetFree(es)
        """,
        FAKE_NVML_CPU="1",
    )
    try:
        assert child.read() == "waiting"
        before = read_cpu_seconds(fx.counts_path)
        deadline = time.monotonic() + 20
        while read_cpu_seconds(fx.counts_path) == before:  # the wait wakes for each change of the state file
            assert time.monotonic() < deadline, "the wait's CPU was not counted while it waited"
            node.gpus[0].temperature = 30 + (node.gpus[0].temperature or 0) % 40
            fx.write(node)
            time.sleep(0.05)  # a poll for the condition above, with its deadline
        node.add_xid(gpu=0, xid=48)
        fx.write(node)
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert r["data"] == 48
    assert read_cpu_seconds(fx.counts_path) > before


def test_an_event_set_holds_one_watch_from_its_first_wait_until_it_is_freed(tmp_path):
    """Like a real event set, which holds its descriptors for its life, the fake's holds its one inotify
    descriptor from its first wait to nvmlEventSetFree: a process's descriptor count does not move with each
    wait (the soak's check that descriptors stay flat), and an event set that is never freed shows as one. A
    set freed while a thread waits on it is refused (IN_USE): NVML does not say what happens, and the waiter
    would read freed memory."""
    fx = prepare(tmp_path, FakeNode.l40s(count=1))
    r = run_child(
        fx,
        """
        import os
        def watches():
            links = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except FileNotFoundError:  # listdir's own descriptor, closed by now
                    pass
            return links.count("anon_inode:inotify")
        es = xid_events()
        seen = {"made": watches()}
        seen["waits"] = []
        for _ in range(3):
            seen["waits"].append(call(N.nvmlEventSetWait_v2, es, 20))
            seen.setdefault("between", []).append(watches())
        other = N.nvmlEventSetCreate()
        waiter = threading.Thread(target=call, args=(N.nvmlEventSetWait_v2, other, 1000))
        waiter.start()
        deadline = time.monotonic() + 10
        while watches() < 2 and time.monotonic() < deadline:  # the other set's wait made its watch
            time.sleep(0.01)
        seen["two_sets"] = watches()
        seen["freed_under_its_wait"] = call(N.nvmlEventSetFree, other)
        waiter.join()
        N.nvmlEventSetFree(other)
        N.nvmlEventSetFree(es)
        seen["freed"] = watches()
        out(seen)
        """,
    )
    assert r["waits"] == ["NVMLError_Timeout"] * 3
    assert r["made"] == 0  # not before its first wait
    assert r["between"] == [1, 1, 1]  # one, kept between the waits
    assert r["two_sets"] == 2
    assert r["freed_under_its_wait"] == "NVMLError_InUse"
    assert r["freed"] == 0


def test_blocked_call_really_blocks(tmp_path, child_factory):
    """A blocked call holds its thread until the block is lifted; meanwhile the same call on another GPU
    and other calls on the same GPU (other threads) answer. A timed block ends by itself."""
    node = FakeNode.h200(count=2)
    node.block("nvmlDeviceGetPowerUsage", seconds=None, gpu=1)
    node.block("nvmlDeviceGetTotalEnergyConsumption", seconds=0.05, gpu=0)
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        res = {}
        th = threading.Thread(target=lambda: res.update(p1=N.nvmlDeviceGetPowerUsage(h[1]))); th.start()
        out("started"); wait_parent()  # the parent has seen the call enter the library
        p0 = N.nvmlDeviceGetPowerUsage(h[0])
        temp = N.nvmlDeviceGetTemperatureV(h[1], 0)
        energy = N.nvmlDeviceGetTotalEnergyConsumption(h[0])  # a timed block: returns by itself
        out({"p0": p0, "temp": temp, "energy": energy, "still_blocked": th.is_alive()})
        th.join()
        out(res)
        """,
    )
    try:
        assert child.read() == "started"
        wait_until(lambda: read_counts(fx.counts_path).get("nvmlDeviceGetPowerUsage", 0) >= 1)
        child.go()
        r = child.read()
        assert r == {"p0": 77_670, "temp": 28, "energy": 91_234_567, "still_blocked": True}
        node.unblock("nvmlDeviceGetPowerUsage", gpu=1)
        node.write(fx.state_path)
        assert child.read() == {"p1": 77_670}
        child.finish()
    finally:
        child.kill()


def test_block_until_removed(tmp_path, child_factory):
    node = FakeNode.h200(count=1)
    node.block("nvmlDeviceGetTotalEnergyConsumption", seconds=None)  # hang (all GPUs) until unblocked
    fx = prepare(tmp_path, node)
    child = child_factory(
        fx,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out("calling")
        energy = N.nvmlDeviceGetTotalEnergyConsumption(h)
        out({"energy": energy})
        """,
    )
    try:
        assert child.read() == "calling"
        counts = fx.counts_path
        wait_until(lambda: read_counts(counts).get("nvmlDeviceGetTotalEnergyConsumption", 0) >= 1)
        assert child.proc.poll() is None and not select.select([child.proc.stdout], [], [], 0)[0]  # stuck inside
        node.unblock()
        node.write(fx.state_path)
        r = child.read()
        child.finish()
    finally:
        child.kill()
    assert r["energy"] == 91_234_567


def test_old_driver_variant(tmp_path):
    node = FakeNode.h200(count=1)
    fx = prepare(tmp_path, node, old_driver=True)
    r = run_child(
        fx,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out({
            "tempV": call(N.nvmlDeviceGetTemperatureV, h, 0),
            "temp": call(N.nvmlDeviceGetTemperature, h, 0),
            "margin": call(N.nvmlDeviceGetMarginTemperature, h),
            "mem_v2": call(N.nvmlDeviceGetMemoryInfo, h, N.nvmlMemory_v2),
            "mem_v1": call(lambda: N.nvmlDeviceGetMemoryInfo(h).total),
            "reasons": call(N.nvmlDeviceGetCurrentClocksEventReasons, h),
            "throttle": call(N.nvmlDeviceGetCurrentClocksThrottleReasons, h),
            "procs": call(N.nvmlDeviceGetComputeRunningProcesses, h),
            "procs_v2": call(N.nvmlDeviceGetComputeRunningProcesses_v2, h),
            "fields": [[f["id"], f["ret"]] for f in fields(h, [82, 196, 269, 9999])],
        })
        """,
    )
    assert r["tempV"] == "NVMLError_FunctionNotFound"
    assert r["temp"] == 28
    assert r["margin"] == r["mem_v2"] == r["reasons"] == "NVMLError_FunctionNotFound"
    assert r["mem_v1"] == 143_771 * fakenvml.MIB and r["throttle"] == 0x1
    # pynvml's unversioned process wrapper turns FunctionNotFound into a non-NVMLError
    assert r["procs"] == "NVMLLibraryMismatchError" and r["procs_v2"] == []
    assert r["fields"] == [[82, 0], [196, 0], [269, 2], [9999, 2]]


def test_call_counts(tmp_path):
    node = FakeNode.h200(count=2)
    fx = prepare(tmp_path, node)
    assert read_counts(fx.counts_path) == {}  # nothing loaded the library yet
    run_child(
        fx,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        for _ in range(5):
            N.nvmlDeviceGetPowerUsage(h)
        N.nvmlDeviceGetTemperatureV(h, 0)
        call(N.nvmlDeviceGetNumFans, h)  # failing calls count too
        out(None)
        """,
    )
    counts = read_counts(fx.counts_path)
    assert set(counts) == set(fakenvml.symbols())
    assert counts["nvmlDeviceGetPowerUsage"] == 5
    assert counts["nvmlDeviceGetTemperatureV"] == 1
    assert counts["nvmlDeviceGetNumFans"] == 1
    assert counts["nvmlInitWithFlags"] == 1 and counts["nvmlDeviceGetHandleByIndex_v2"] == 1
    assert counts["nvmlDeviceGetTemperature"] == 0


def test_build_without_compiler_fails_clearly(monkeypatch):
    monkeypatch.setattr(fakenvml, "_up_to_date", lambda lib: False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(fakenvml.FakeNvmlBuildError, match="no C compiler"):
        fakenvml.build()


def test_state_file_validation(tmp_path):
    node = FakeNode.h200(count=1)
    with pytest.raises(ValueError):
        node.set_error("nvmlDeviceGetPowerUsag", 3)  # typo
    with pytest.raises(ValueError):
        FakeNode.from_profiles(["nope"])
    with pytest.raises(ValueError):
        FakeNode.h200(count=65).render()
    text = node.write(tmp_path / "s").read_text()
    assert "gpu 0" in text and "field 193 si -8" in text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp file renamed away


def test_library_cpu_time_is_counted_only_when_asked(tmp_path):
    """FAKE_NVML_CPU=1 sums the CPU time spent inside the library: what bench/ subtracts from the
    agent's whole-process CPU. Without it the slot stays 0, and the counts never include it."""
    body = """
        import resource
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        for _ in range(2000):
            N.nvmlDeviceGetTemperatureV(h, 0)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out(ru.ru_utime + ru.ru_stime)
        """
    plain = prepare(tmp_path / "plain", FakeNode.h200(count=1))
    run_child(plain, body)
    assert read_cpu_seconds(plain.counts_path) == 0.0
    assert "__cpu_ns__" not in read_counts(plain.counts_path)

    timed = prepare(tmp_path / "timed", FakeNode.h200(count=1))
    process_cpu = run_child(timed, body, FAKE_NVML_CPU="1")
    inside = read_cpu_seconds(timed.counts_path)
    assert 0.0 < inside <= process_cpu
    assert read_counts(timed.counts_path)["nvmlDeviceGetTemperatureV"] == 2000
