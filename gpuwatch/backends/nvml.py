"""The NVML backend: the only module that imports pynvml (nvidia-ml-py), and the one funnel for every NVML call.

The reading groups (gpuwatch/groups/) say what to probe and read, by the NVML functions' C names;
this module resolves them, runs them and maps NVML errors to outcomes:

- NOT_SUPPORTED, INVALID_ARGUMENT, NO_PERMISSION, FUNCTION_NOT_FOUND, DEPRECATED while probing:
  the GPU has no such reading. Probed once per GPU at discovery, cached, exported as
  gpuwatch_gpu_feature_supported, never polled (nor logged) again.
- GPU_IS_LOST: DeviceLost for that GPU; the others go on.
- UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH: BackendUnavailable
  with a hint; the poller backs off and re-initialises.
- anything else (UNKNOWN, TIMEOUT, ...): that reading is absent from this poll, its error name is
  counted in gpuwatch_poll_errors_total and its group's gpuwatch_collector_success is 0.

Only enabled groups are probed and read: a disabled group makes no NVML call at all. The groups'
field ids of a tier are read in one nvmlDeviceGetFieldValues call per GPU and poll, on an array
built once at discovery and reset from a pristine copy before each call (go-nvml #46: a reused
buffer accumulates); each entry's own return code and value type are checked. Text is decoded
here (``_Texts``): bytes that are not UTF-8 become U+FFFD and are counted, never an exception.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pynvml as N

from gpuwatch import groups
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.groups import fieldids
from gpuwatch.groups.base import NvmlReader, Unsupported
from gpuwatch.logs import get_logger
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, GpuIdentity, SlowSample, XidEvent

ERROR_NAMES: dict[int, str] = {
    getattr(N, name): name[len("NVML_ERROR_"):].lower()
    for name in dir(N)
    if name.startswith("NVML_ERROR_") and isinstance(getattr(N, name), int)
}
_UNSUPPORTED = {
    N.NVML_ERROR_NOT_SUPPORTED,
    N.NVML_ERROR_INVALID_ARGUMENT,
    N.NVML_ERROR_NO_PERMISSION,
    N.NVML_ERROR_FUNCTION_NOT_FOUND,
    getattr(N, "NVML_ERROR_DEPRECATED", 26),
}
_LOST = N.NVML_ERROR_GPU_IS_LOST
_BACKEND_GONE = {
    N.NVML_ERROR_UNINITIALIZED: (
        "uninitialized", "NVML lost its initialisation; gpuwatch re-initialises it by itself"),
    N.NVML_ERROR_DRIVER_NOT_LOADED: (
        "driver_not_loaded",
        "the nvidia kernel module is not loaded: check `lsmod | grep nvidia` and `dmesg`, load it with "
        "`modprobe nvidia`; gpuwatch keeps retrying"),
    N.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "library_not_found",
        "libnvidia-ml.so.1 cannot be loaded: install the NVIDIA driver (in a container: the NVIDIA container "
        "toolkit), or run `gpuwatch demo` for a simulated node"),
    N.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "driver_version_mismatch",
        "the NVIDIA driver was upgraded without a reboot: libnvidia-ml.so and the kernel module differ; "
        "reboot the node (or reload the nvidia kernel modules)"),
    N.NVML_ERROR_NO_PERMISSION: (
        "no_permission",
        "no access to /dev/nvidiactl: run gpuwatch as a user that may open the NVIDIA device nodes"),
}

_LIBRARY = "libnvidia-ml.so.1"  # what pynvml loads on Linux
_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}
class _Texts:
    """NVML's strings, decoded here and nowhere else.

    pynvml decodes char buffers strictly (``bytes.decode()``), so one byte that is not UTF-8 (a
    corrupted InfoROM's serial) raises UnicodeDecodeError out of any call. Here the raw bytes are
    taken from under pynvml's decoding (its ``convertStrBytes`` wrapper keeps the undecorated call
    as ``__wrapped__``; structures are read with ctypes' own attribute access), decoded with U+FFFD
    for each bad byte, and every such text is remembered as ``invalid_utf8``.
    """

    __slots__ = ("invalid",)

    def __init__(self) -> None:
        self.invalid: list[str] = []  # which texts had bad bytes

    def decode(self, what: str, raw: Any) -> str:
        if not isinstance(raw, bytes):
            return str(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.invalid.append(what)
            return raw.decode("utf-8", "replace")

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> str:
        return self.decode(what, getattr(fn, "__wrapped__", fn)(*args))

    def field(self, what: str, struct: Any, name: str) -> str:
        return self.decode(what, ctypes.Structure.__getattribute__(struct, name))


_XID_EVENT = groups.xid.XID_CRITICAL_ERROR
_MIG_CONFIG_EVENT = 0x100  # nvmlEventMigConfigChange
_NO_SHARES: Mapping[str, float] = {}
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _plain(printable: Any) -> Any:
    """A plain ctypes type with the layout (``_fields_``) of one of pynvml's printable structures or
    unions, whose Python __getattribute__ runs on every attribute read."""
    base = ctypes.Union if issubclass(printable, ctypes.Union) else ctypes.Structure
    return type(f"_Plain{printable.__name__}", (base,), {"_fields_": printable._fields_})


class _FieldValue(ctypes.Structure):
    """nvmlFieldValue_t, laid out as pynvml's c_nvmlFieldValue_t, read with ctypes' own attributes."""

    _fields_ = [("fieldId", ctypes.c_uint32), ("scopeId", ctypes.c_uint32), ("timestamp", ctypes.c_int64),
                ("latencyUsec", ctypes.c_int64), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", _plain(N.c_nvmlValue_t))]


# The getters of every fast poll, called here the way pynvml's wrappers call them (make the output,
# call, check the return, read the output) but with the output made once per GPU and the function
# resolved once: about a microsecond less per call. C name -> (output type; its version member's
# value, or None; the output's members that take the arguments, in order, or () when the arguments
# are passed to the C function after the handle (as unsigned ints); what to return: None the
# scalar's value, "" the structure (read it at once: the next call overwrites it), else that
# member). The layouts are pynvml's own (_plain), the same ABI as its wrappers.
_DIRECT: Mapping[str, tuple[Any, int | None, tuple[str, ...], str | None]] = {
    "nvmlDeviceGetTemperatureV": (_plain(N.c_nvmlTemperature_v1_t), N.nvmlTemperature_v1, ("sensorType",),
                                  "temperature"),
    "nvmlDeviceGetTemperature": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetMarginTemperature": (_plain(N.c_nvmlMarginTemperature_v1_t), N.nvmlMarginTemperature_v1, (),
                                       "marginTemperature"),
    "nvmlDeviceGetPerformanceState": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetPowerUsage": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetUtilizationRates": (_plain(N.c_nvmlUtilization_t), None, (), ""),
    "nvmlDeviceGetMemoryInfo_v2": (_plain(N.c_nvmlMemory_v2_t), N.nvmlMemory_v2, (), ""),
    "nvmlDeviceGetClockInfo": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetCurrentClocksEventReasons": (ctypes.c_ulonglong, None, (), None),
}


def _direct(function: str, handle: Any, args: tuple[Any, ...]) -> Callable[[], Any] | None:
    """``function(handle, *args)`` as a call of no arguments with its output made once; None when
    it is not one of _DIRECT or this library has no such symbol (the caller falls back to pynvml's
    wrapper, which then says FUNCTION_NOT_FOUND)."""
    spec = _DIRECT.get(function)
    if spec is None:
        return None
    kind, version, into, result = spec
    try:
        cfn = N._nvmlGetFunctionPointer(function)
    except N.NVMLError:
        return None
    out = kind()
    if version is not None:
        out.version = version
    for member, value in zip(into, args):
        setattr(out, member, value)
    passed = () if into else tuple(ctypes.c_uint(a) for a in args)
    cargs = (handle, *passed, ctypes.byref(out))
    error = N.NVMLError

    if result is None:
        def call() -> Any:
            ret = cfn(*cargs)
            if ret:
                raise error(ret)
            return out.value
    elif result == "":
        def call() -> Any:
            ret = cfn(*cargs)
            if ret:
                raise error(ret)
            return out
    else:
        def call() -> Any:
            ret = cfn(*cargs)
            if ret:
                raise error(ret)
            return getattr(out, result)
    return call


FieldKey = Any  # a field id (scope 0), or (field id, scopeId): a link, "all links" (0xFFFFFFFF)


class _Batch:
    """One GPU's field-values call for one tier: the keys fixed at discovery, the array built once."""

    __slots__ = ("ids", "owners", "shares", "_pristine", "_buffer", "_size", "_count", "_fn")

    def __init__(self, owners: Mapping[FieldKey, str]) -> None:
        """``owners``: field key (an id, or (id, scopeId)) -> the group that reads it."""
        self.ids = tuple(owners)
        self.owners = dict(owners)
        # group -> its share of the call's ids: the share of the call's time put down to it
        self.shares = {group: sum(1 for g in owners.values() if g == group) / len(owners)
                       for group in set(owners.values())}
        self._count = ctypes.c_int32(len(self.ids))
        self._pristine = (_FieldValue * len(self.ids))()
        for entry, key in zip(self._pristine, self.ids):
            if isinstance(key, tuple):
                entry.fieldId, entry.scopeId = key
            else:
                entry.fieldId = key
        self._buffer = (_FieldValue * len(self.ids))()
        self._size = ctypes.sizeof(self._pristine)
        self._fn = N._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")  # after nvmlInit; pynvml caches it

    def run(self, handle: Any) -> Any:
        ctypes.memmove(self._buffer, self._pristine, self._size)
        N._nvmlCheckReturn(self._fn(handle, self._count, self._buffer))
        return self._buffer


# -- versioned calls pynvml does not wrap the way gpuwatch needs -------------------------------------
def _fan_rpm(handle: Any, fan: int) -> int:
    # pynvml's wrapper hard-codes fan 0; build the versioned struct for any fan.
    info = N.c_nvmlFanSpeedInfo_t()
    info.version = N.nvmlFanSpeedInfo_v1
    info.fan = fan
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetFanSpeedRPM")
    N._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
    return int(info.speed)


def _memory_v2(handle: Any) -> Any:
    return N.nvmlDeviceGetMemoryInfo(handle, version=N.nvmlMemory_v2)


_VERSION_MISMATCH = getattr(N, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25)
# nvmlDeviceGetGpuFabricInfoV's structures, newest first: v3 (R570+) adds the health summary; a driver
# that does not know a version answers ARGUMENT_VERSION_MISMATCH and is asked the next one
_FABRIC_VERSIONS: tuple[tuple[str, str], ...] = tuple(
    (struct, version) for struct, version in (("c_nvmlGpuFabricInfo_v3_t", "nvmlGpuFabricInfo_v3"),
                                              ("c_nvmlGpuFabricInfo_v2_t", "nvmlGpuFabricInfo_v2"))
    if hasattr(N, struct) and hasattr(N, version))


def _fabric_answer(info: Any, versioned: bool) -> dict[str, Any]:
    # nvml.h declares the state an unsigned char; pynvml's structure reads a c_uint: keep the low byte
    return {"state": int(info.state) & 0xFF, "status": "success" if info.status == 0 else ERROR_NAMES.get(
                info.status, "unknown"),
            "clique_id": int(info.cliqueId), "cluster_uuid": bytes(info.clusterUuid),
            "health_mask": int(info.healthMask) if versioned else None,
            "health_summary": int(info.healthSummary) if hasattr(info, "healthSummary") else None}


class _FabricInfoV:
    """nvmlDeviceGetGpuFabricInfoV with the newest structure the driver takes: v3 (the health summary)
    first; ARGUMENT_VERSION_MISMATCH (a driver before R570) -> v2 from then on. pynvml's wrapper passes
    the caller's structure as is, so it is built here (once) and passed by reference."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._fn: Any = None
        self._versions = [(_plain(getattr(N, struct))(), getattr(N, version)) for struct, version in _FABRIC_VERSIONS]

    def __call__(self) -> dict[str, Any]:
        if self._fn is None:  # FUNCTION_NOT_FOUND from a library without it: unsupported when probed
            self._fn = N._nvmlGetFunctionPointer("nvmlDeviceGetGpuFabricInfoV")
        while True:
            info, version = self._versions[0]
            info.version = version
            ret = self._fn(self._handle, ctypes.byref(info))
            if ret == _VERSION_MISMATCH and len(self._versions) > 1:
                self._versions.pop(0)  # this driver does not know the version: never ask it again
                continue
            N._nvmlCheckReturn(ret)
            return _fabric_answer(info, versioned=True)

    def free(self) -> None:
        return None


def _fabric_info(handle: Any) -> dict[str, Any]:
    """The unversioned nvmlDeviceGetGpuFabricInfo (drivers without the versioned call: no health)."""
    info = _plain(N.c_nvmlGpuFabricInfo_t)()
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetGpuFabricInfo")
    N._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
    return _fabric_answer(info, versioned=False)


_OWN: Mapping[str, Callable[..., Any]] = {
    "nvmlDeviceGetFanSpeedRPM": _fan_rpm,
    "nvmlDeviceGetMemoryInfo_v2": _memory_v2,
    "nvmlDeviceGetGpuFabricInfo": _fabric_info,
}


class _GpmPair:
    """GPM for one GPU (nvmlGpmMetricsGet over two samples): the two samples are allocated on the
    first call and swapped from then on; each call takes one sample (nvmlGpmSampleGet) and, from the
    second call on, returns ({metric id: value} of the metrics whose own return code is SUCCESS,
    seconds between the two samples). The first call returns None (no interval yet)."""

    def __init__(self, handle: Any, metric_ids: tuple[int, ...], gpu_instance: int | None = None) -> None:
        """``gpu_instance``: sample that GPU instance of a MIG-enabled GPU (nvmlGpmMigSampleGet)."""
        self._handle = handle
        self._gi = None if gpu_instance is None else ctypes.c_uint(gpu_instance)
        self._ids = metric_ids
        self._samples: list[Any] | None = None
        self._next = 0
        self._taken: float | None = None
        metric = _plain(N.c_nvmlGpmMetric_t)
        fields = [(name, kind) for name, kind in N.c_nvmlGpmMetricsGet_t._fields_ if name != "metrics"]
        request = type("_GpmMetricsGet", (ctypes.Structure,),
                       {"_fields_": [*fields, ("metrics", metric * N.NVML_GPM_METRIC_MAX)]})
        assert ctypes.sizeof(request) == ctypes.sizeof(N.c_nvmlGpmMetricsGet_t)
        self._request = request()
        self._request.version = N.NVML_GPM_METRICS_GET_VERSION
        self._request.numMetrics = len(metric_ids)
        for slot, mid in zip(self._request.metrics, metric_ids):
            slot.metricId = mid
        self._sample_get: Any = None
        self._metrics_get: Any = None

    def __call__(self) -> tuple[dict[int, float], float] | None:
        if self._samples is None:  # resolved here, inside the funnel's error handling (an old driver lacks them)
            self._sample_get = N._nvmlGetFunctionPointer(
                "nvmlGpmSampleGet" if self._gi is None else "nvmlGpmMigSampleGet")
            self._metrics_get = N._nvmlGetFunctionPointer("nvmlGpmMetricsGet")
            first = N.nvmlGpmSampleAlloc()
            try:
                self._samples = [first, N.nvmlGpmSampleAlloc()]
            except N.NVMLError:
                N.nvmlGpmSampleFree(first)
                raise
        current = self._samples[self._next]
        ret = (self._sample_get(self._handle, current) if self._gi is None
               else self._sample_get(self._handle, self._gi, current))
        if ret:
            raise N.NVMLError(ret)
        now, before = time.monotonic(), self._taken
        self._taken = now
        self._next ^= 1
        if before is None:
            return None
        request = self._request
        request.sample1, request.sample2 = self._samples[self._next], current
        ret = self._metrics_get(ctypes.byref(request))
        if ret:
            raise N.NVMLError(ret)
        values = {m.metricId: m.value for m in request.metrics[:len(self._ids)] if m.nvmlReturn == 0}
        return values, now - before

    def free(self) -> None:
        samples, self._samples = self._samples, None
        for sample in samples or ():
            try:
                N.nvmlGpmSampleFree(sample)
            except N.NVMLError:
                pass


class _MigDevices:
    """The MIG devices of one MIG-enabled GPU, for the mig group (``dev.call("gpuwatch.mig", metric
    ids)``). ``instances`` enumerates them (slow tier: MIG handles go invalid when an instance is
    destroyed, so they are looked up again each time) and ``readings`` reads each one (fast tier):
    its frame buffer (nvmlDeviceGetMemoryInfo on the MIG handle) and its GPM metrics over the last
    interval (nvmlGpmMigSampleGet on the parent with the GPU instance id, a sample pair per instance).
    An instance that went away since the enumeration is left out of the readings. One lock: the slow
    poll and the events thread enumerate, the fast poll reads, close() frees; a sample pair is never
    freed under a call that uses it."""

    def __init__(self, handle: Any, metric_ids: tuple[int, ...]) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self._ids = metric_ids
        self._devices: list[tuple[int, int, Any]] = []  # (gpu instance, compute instance, MIG handle)
        self._gpm: dict[int, _GpmPair] = {}  # gpu instance -> its sample pair
        self.gpm = bool(metric_ids) and hasattr(N, "c_nvmlGpmMetricsGet_t")
        self.instances = self._instances
        self.readings = self._readings

    def _instances(self) -> tuple[dict[str, Any], ...]:
        with self._lock:
            return self._enumerate()

    def _enumerate(self) -> tuple[dict[str, Any], ...]:
        count = N.nvmlDeviceGetMaxMigDeviceCount(self._handle)
        found, devices = [], []
        for index in range(count):
            try:
                mig = N.nvmlDeviceGetMigDeviceHandleByIndex(self._handle, index)
            except N.NVMLError as exc:
                if exc.value == N.NVML_ERROR_NOT_FOUND:  # an empty slot
                    continue
                raise
            gi, ci = N.nvmlDeviceGetGpuInstanceId(mig), N.nvmlDeviceGetComputeInstanceId(mig)
            name = _Texts().call("mig_name", N.nvmlDeviceGetName, mig)
            found.append({"gpu_instance": int(gi), "compute_instance": int(ci),
                          "mig_uuid": _Texts().call("mig_uuid", N.nvmlDeviceGetUUID, mig),
                          "profile": name.rsplit("MIG ", 1)[-1] if "MIG " in name else name})
            devices.append((int(gi), int(ci), mig))
        self._devices = devices
        for gi in set(self._gpm) - {gi for gi, _, _ in devices}:  # destroyed instances
            pair = self._gpm.pop(gi, None)
            if pair is not None:
                pair.free()
        return tuple(found)

    def _readings(self) -> tuple[dict[str, Any], ...]:
        with self._lock:
            return self._read()

    def _read(self) -> tuple[dict[str, Any], ...]:
        out, seen = [], set()
        for gi, _ci, mig in self._devices:
            if gi in seen:  # a GPU instance split into several compute instances: its memory and GPM once
                continue
            seen.add(gi)
            try:
                memory = N.nvmlDeviceGetMemoryInfo(mig)
            except N.NVMLError as exc:
                if exc.value in (N.NVML_ERROR_INVALID_ARGUMENT, N.NVML_ERROR_NOT_FOUND):
                    continue  # destroyed since the enumeration: the next one drops it
                raise
            reading: dict[str, Any] = {"gpu_instance": gi, "memory_total": int(memory.total),
                                       "memory_used": int(memory.used), "gpm": None}
            if self.gpm:
                pair = self._gpm.get(gi)
                if pair is None:
                    pair = self._gpm[gi] = _GpmPair(self._handle, self._ids, gi)
                try:
                    got = pair()
                except N.NVMLError as exc:
                    if exc.value not in _UNSUPPORTED and exc.value != N.NVML_ERROR_NOT_FOUND:
                        raise
                    got = None
                    if exc.value in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_FUNCTION_NOT_FOUND):
                        self.gpm = False  # this driver has no per-instance GPM: stop asking
                    # INVALID_ARGUMENT, NOT_FOUND: the instance went away; the next enumeration drops it
                reading["gpm"] = None if got is None else got[0]
            out.append(reading)
        return tuple(out)

    def free(self) -> None:
        with self._lock:
            for pair in self._gpm.values():
                pair.free()
            self._gpm = {}
            self._devices = []


def _stateful(function: str, handle: Any, args: tuple[Any, ...]) -> Any:
    """The funnel's calls that keep state between polls (GPM's sample pair, MIG devices, the fabric
    structure version the driver takes); None for the others."""
    if function == "nvmlGpmMetricsGet":
        return _GpmPair(handle, tuple(args[0])) if hasattr(N, "c_nvmlGpmMetricsGet_t") else None
    if function == "gpuwatch.mig":
        return _MigDevices(handle, tuple(args[0]) if args else ())
    if function == "nvmlDeviceGetGpuFabricInfoV":  # a binding without the v2/v3 structures: unsupported
        return _FabricInfoV(handle) if _FABRIC_VERSIONS else None
    return None


def _resolve(function: str) -> Callable[..., Any] | None:
    """The callable for an NVML C function name: the funnel's own wrapper, else pynvml's; None when
    this binding has none (an older nvidia-ml-py): unsupported, like FUNCTION_NOT_FOUND."""
    own = _OWN.get(function)
    return own if own is not None else getattr(N, function, None)


def _copied_symlink_hint() -> str | None:
    """A libnvidia-ml.so.1 on LD_LIBRARY_PATH that is no library but a few bytes of text naming one beside it: a
    symlink copied as a file (a tarball or a copy tool that does not keep links). The hint says how to mend it."""
    for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        path = os.path.join(directory, _LIBRARY)
        try:
            if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 255:
                continue
            with open(path, "rb") as stub:
                target = stub.read().decode("utf-8", "replace").strip()
        except OSError:
            continue
        if target and "/" not in target and os.path.isfile(os.path.join(directory, target)):
            real = os.path.join(os.path.abspath(directory), target)
            return (f"{path} is not a library but a text file naming {target}: a symlink copied as a file. Link "
                    f"it in a directory of your own (`mkdir -p /tmp/nvml && ln -sf {real} /tmp/nvml/{_LIBRARY}`) "
                    "and put that directory first on LD_LIBRARY_PATH; gpuwatch keeps retrying")
    return None


def _handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _is_gone(code: int) -> bool:
    """GPU_IS_LOST or the backend as a whole went away: errors that must not be taken for "unsupported"."""
    return code == _LOST or (code in _BACKEND_GONE and code != N.NVML_ERROR_NO_PERMISSION)


class _Probe:
    """groups.base.Device for one GPU at discovery."""

    def __init__(self, handle: Any, fields: Mapping[int, int | None], options: Mapping[str, Any],
                 numbering: fieldids.Numbering = fieldids.DEFAULT, identity: GpuIdentity | None = None) -> None:
        self.handle = handle
        self.fields: set[FieldKey] = set(fields)  # the keys the GPU answered at discovery
        self._types: dict[FieldKey, int | None] = dict(fields)  # key -> NVML value type it answered in
        self.options = options  # "<group>.<option>" -> value
        self.numbering = numbering
        self.numbering_known = numbering.known
        self.architecture = None if identity is None else identity.architecture
        self._identity = identity
        self._rejected: set[str] = set()
        self.features: dict[str, bool] = {}
        self.used: dict[str, dict[FieldKey, str]] = {"fast": {}, "slow": {}}  # tier -> field key -> group
        self.cleanups: list[Callable[[], None]] = []  # what to free before NVML shuts down (GPM samples)
        self.mig: _MigDevices | None = None  # the GPU's MIG devices, when the mig group reads them
        self.group = ""

    def call(self, function: str, *args: Any) -> Any:
        """A call of no arguments (None: this binding has no such function)."""
        stateful = _stateful(function, self.handle, args)
        if stateful is not None:
            self.cleanups.append(stateful.free)
            if isinstance(stateful, _MigDevices):
                self.mig = stateful
            return stateful
        direct = _direct(function, self.handle, args)
        if direct is not None:
            return direct
        fn = _resolve(function)
        return None if fn is None else functools.partial(fn, self.handle, *args)

    def probe(self, call: Any) -> Any:
        if call is None:
            raise Unsupported
        try:
            return call()
        except N.NVMLError as exc:
            if exc.value in _UNSUPPORTED:
                raise Unsupported from None
            if _is_gone(exc.value):
                raise
            return None  # transient: polled anyway, its errors counted then

    def supported(self, call: Any) -> bool:
        try:
            self.probe(call)
            return True
        except Unsupported:
            return False

    def first(self, *calls: Any) -> Any:
        return next((call for call in calls if self.supported(call)), None)

    def has_field(self, field_id: int) -> bool:
        return field_id in self.fields

    def field_id(self, name: str) -> int | None:
        return self.numbering.id(name)

    def value_type(self, key: FieldKey) -> int | None:
        return self._types.get(key)

    def reject(self, what: str, why: str) -> None:
        if what in self._rejected:
            return
        self._rejected.add(what)
        identity = self._identity
        get_logger(component="nvml").warning(
            "nvml_reading_implausible", reading=what, error_detail=why, group=self.group,
            gpu=None if identity is None else str(identity.index), uuid=None if identity is None else identity.uuid,
            driver_version=self.numbering.driver_version, branch=self.numbering.branch,
            hint="the reading is left out and shown as an unsupported feature; please report the driver version "
                 "and `nvidia-smi -q` output so gpuwatch can learn this branch")

    def values(self, keys: Any) -> dict[FieldKey, float | int]:
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        try:
            entries = _Batch({key: self.group for key in keys}).run(self.handle)
        except N.NVMLError as exc:
            if _is_gone(exc.value):
                raise
            return {}
        answered: dict[FieldKey, float | int] = {}
        for key, entry in zip(keys, entries):
            if entry.nvmlReturn == _LOST:
                raise N.NVMLError(_LOST)
            if entry.nvmlReturn == N.NVML_SUCCESS and entry.valueType < len(_VALUE_MEMBERS):
                answered[key] = getattr(entry.value, _VALUE_MEMBERS[entry.valueType])
                self._types[key] = int(entry.valueType)
        self.fields.update(answered)
        return answered

    def field(self, field_id: FieldKey, tier: str) -> bool:
        if field_id not in self.fields:
            return False
        self.used[tier][field_id] = self.group
        return True

    def feature(self, name: str, supported: bool | None) -> None:
        if supported is not None:  # None: no such hardware, nothing to say
            self.features[name] = bool(supported)

    def option(self, name: str) -> Any:
        return self.options[f"{self.group}.{name}"]


class _Query:
    """groups.base.Query for one poll of one GPU: a lost GPU and lifecycle errors raise, any other error
    leaves the reading out and is remembered (by lowercase name) for gpuwatch_poll_errors_total."""

    __slots__ = ("_backend", "_uuid", "errors", "_values", "field_errors")

    def __init__(self, backend: NvmlBackend, uuid: str) -> None:
        self._backend = backend
        self._uuid = uuid
        self.errors: list[str] = []
        self._values: dict[FieldKey, float | int] = {}
        self.field_errors: dict[str, int] = {}  # group -> failed entries of this poll's batch

    def __call__(self, call: Any) -> Any:
        try:
            return call()
        except N.NVMLError as exc:
            failure = self._backend._fail(exc, self._uuid)
            if failure is not None:
                raise failure from None
            self.errors.append(ERROR_NAMES.get(exc.value, "unknown"))
            return None

    def field(self, field_id: FieldKey) -> float | int | None:
        return self._values.get(field_id)

    def load(self, batch: _Batch, handle: Any) -> None:
        """Run the tier's one field-values call and keep the entries that succeeded."""
        try:
            entries = batch.run(handle)
        except N.NVMLError as exc:
            failure = self._backend._fail(exc, self._uuid)
            if failure is not None:
                raise failure from None
            self.errors.append(ERROR_NAMES.get(exc.value, "unknown"))
            for group in set(batch.owners.values()):
                self.field_errors[group] = self.field_errors.get(group, 0) + 1
            return
        values = self._values
        members, known = _VALUE_MEMBERS, len(_VALUE_MEMBERS)
        for key, entry in zip(batch.ids, entries):
            code = entry.nvmlReturn
            if code == 0:  # NVML_SUCCESS
                kind = entry.valueType
                if kind < known:
                    values[key] = getattr(entry.value, members[kind])
                    continue
            if code == _LOST:
                raise DeviceLost(self._uuid, "NVML: GPU is lost")
            self.errors.append(ERROR_NAMES.get(code, "unknown") if code != N.NVML_SUCCESS else "bad_value_type")
            group = batch.owners.get(key, "")
            self.field_errors[group] = self.field_errors.get(group, 0) + 1


@dataclass
class _Gpu:
    """A GPU's handle and what its enabled groups probed at discovery."""

    handle: Any
    identity: GpuIdentity
    features: dict[str, bool] = field(default_factory=dict)
    fast: tuple[tuple[str, str, NvmlReader], ...] = ()  # (group, FastSample attribute, reader)
    slow: tuple[tuple[str, str, NvmlReader], ...] = ()
    batches: dict[str, _Batch] = field(default_factory=dict)  # tier -> its field-values call
    events: bool = False  # registered for XID events
    cleanups: list[Callable[[], None]] = field(default_factory=list)  # run before NVML shuts down
    mig: _MigDevices | None = None  # re-enumerated on a MIG configuration-change event
    lost_while_probing: bool = False  # GPU_IS_LOST at discovery: down until the next discovery


class NvmlBackend:
    name = "nvml"

    def __init__(self, enabled: Collection[str] = groups.DEFAULT_ENABLED,
                 options: Mapping[str, Any] | None = None) -> None:
        self._groups = tuple(g for g in groups.GROUPS if g.name in enabled and g.nvml is not None)
        self._options = {f"{g.name}.{name}": default for g in groups.GROUPS
                         for name, (default, _) in g.options.items()}
        self._options.update(options or {})
        self._numbering = fieldids.DEFAULT
        self._field_ids = self._resolve_fields()
        self._devices: dict[str, _Gpu] = {}
        self._by_handle: dict[int | None, str] = {}
        self._event_set: Any = None
        self._events_lock = threading.Lock()
        self._open = False
        self._failed_groups: set[tuple[str, str]] = set()  # (uuid, group) whose read raised, logged once

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self) -> DriverInfo:
        try:
            N.nvmlInit()
        except N.NVMLError as exc:
            raise self._unavailable(exc) from None
        self._open = True
        texts = _Texts()
        try:
            driver = texts.call("driver_version", N.nvmlSystemGetDriverVersion)
            nvml = texts.call("nvml_version", N.nvmlSystemGetNVMLVersion)
            try:
                cuda_int = N.nvmlSystemGetCudaDriverVersion()
                cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
            except N.NVMLError:
                cuda = ""
        except N.NVMLError as exc:
            self.close()
            raise self._unavailable(exc) from None
        if texts.invalid:
            get_logger(component="nvml").warning("nvml_invalid_text", texts=texts.invalid,
                                                 hint="the driver reported text that is not UTF-8; shown with U+FFFD")
        self._numbering = fieldids.numbering(driver)
        self._field_ids = self._resolve_fields()
        if not self._numbering.known:
            get_logger(component="nvml").warning(
                "nvml_field_numbering_unknown", driver_version=driver, branch=self._numbering.branch,
                hint=f"this driver is newer than gpuwatch's table of NVML field ids (up to R{fieldids.NEWEST_KNOWN}): "
                     "the newest numbering is assumed and every moved field is checked before it is read; "
                     "a field that does not fit is left out and logged (upgrade gpuwatch for this branch)")
        return DriverInfo(driver_version=driver, nvml_version=nvml, cuda_driver_version=cuda,
                          errors=("invalid_utf8",) * len(texts.invalid))

    def _resolve_fields(self) -> dict[int, str]:
        """The enabled groups' field ids under this driver's numbering (groups name the ids that moved)."""
        ids: dict[int, str] = {}
        for g in self._groups:
            for key in g.fields:
                fid = self._numbering.id(key) if isinstance(key, str) else key
                if fid is not None:
                    ids[fid] = g.name
        return ids

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        # Do not shut NVML down under a thread that is inside nvmlEventSetWait (nvml.md §12).
        have_events_lock = self._events_lock.acquire(timeout=2 * 1.0)
        try:
            if self._event_set is not None and have_events_lock:
                try:
                    N.nvmlEventSetFree(self._event_set)
                except N.NVMLError:
                    pass
            self._event_set = None
            self._free_devices()
            self._by_handle = {}
            if have_events_lock:
                try:
                    N.nvmlShutdown()
                except N.NVMLError:
                    pass
        finally:
            if have_events_lock:
                self._events_lock.release()

    def _free_devices(self) -> None:
        """Free what the groups' calls hold in NVML (GPM samples); errors do not matter here."""
        devices, self._devices = self._devices, {}
        for gpu in devices.values():
            for cleanup in gpu.cleanups:
                try:
                    cleanup()
                except N.NVMLError:
                    pass

    @staticmethod
    def _unavailable(exc: N.NVMLError) -> BackendUnavailable:
        reason, hint = _BACKEND_GONE.get(
            exc.value, (ERROR_NAMES.get(exc.value, "unknown"), "check `nvidia-smi`; gpuwatch keeps retrying"))
        if exc.value == N.NVML_ERROR_LIBRARY_NOT_FOUND:
            hint = _copied_symlink_hint() or hint
        return BackendUnavailable(reason, f"NVML: {exc}", hint)

    def _fail(self, exc: N.NVMLError, uuid: str) -> Exception:
        """Map an error raised while polling to DeviceLost / BackendUnavailable, else None."""
        if exc.value == _LOST:
            return DeviceLost(uuid, f"NVML: {exc}")
        if exc.value in _BACKEND_GONE and exc.value != N.NVML_ERROR_NO_PERMISSION:
            return self._unavailable(exc)
        return None  # type: ignore[return-value]

    # -- discovery ------------------------------------------------------------------------------
    def discover(self) -> list[DiscoveredGpu]:
        try:
            count = N.nvmlDeviceGetCount()
        except N.NVMLError as exc:
            raise self._unavailable(exc) from None
        found: list[DiscoveredGpu] = []
        devices: dict[str, _Gpu] = {}
        self._free_devices()
        for index in range(count):
            texts = _Texts()
            try:
                handle = N.nvmlDeviceGetHandleByIndex(index)
                identity = self._identity(handle, index, texts)
            except N.NVMLError as exc:
                if _is_gone(exc.value) and exc.value != _LOST:
                    raise self._unavailable(exc) from None
                # The GPU cannot even be identified (lost, no permission): gpuwatch_gpus says how many are seen.
                get_logger(component="nvml").error(
                    "gpu_unidentifiable", gpu=str(index), error=f"NVML: {exc}",
                    hint="the driver counts this GPU but cannot open it: check `nvidia-smi` and `dmesg`")
                continue
            gpu = _Gpu(handle=handle, identity=identity)
            try:
                self._probe(gpu)
            except N.NVMLError as exc:
                if _is_gone(exc.value) and exc.value != _LOST:
                    raise self._unavailable(exc) from None
                # lost while probing: no reading is prepared, so no poll would ever call NVML for it and
                # it would show up with no readings; every read reports it lost instead
                gpu.features, gpu.fast, gpu.slow, gpu.batches = {}, (), (), {}
                gpu.lost_while_probing = True
            devices[identity.uuid] = gpu
            errors: tuple[str, ...] = ()
            if texts.invalid:
                errors = ("invalid_utf8",) * len(texts.invalid)
                get_logger(component="nvml").warning(
                    "nvml_invalid_text", gpu=str(index), uuid=identity.uuid, texts=texts.invalid,
                    hint="the GPU reported text that is not UTF-8 (a corrupted InfoROM?); it is shown with U+FFFD "
                         "and the GPU is monitored as usual; check `nvidia-smi -q -i " + str(index) + "`")
            found.append(DiscoveredGpu(identity=identity, features=dict(gpu.features), errors=errors))
        self._devices = devices
        self._by_handle = {_handle_key(d.handle): uuid for uuid, d in devices.items()}
        self._register_events()
        return found

    @staticmethod
    def _identity(handle: Any, index: int, texts: _Texts) -> GpuIdentity:
        def optional(fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except N.NVMLError as exc:
                if exc.value == _LOST or exc.value in _BACKEND_GONE:
                    raise
                return None

        arch = optional(lambda: N.nvmlDeviceGetArchitecture(handle))
        minor = optional(lambda: N.nvmlDeviceGetMinorNumber(handle))
        return GpuIdentity(
            index=index,
            uuid=texts.call("uuid", N.nvmlDeviceGetUUID, handle),
            name=texts.call("name", N.nvmlDeviceGetName, handle),
            pci_bus_id=texts.field("pci_bus_id", N.nvmlDeviceGetPciInfo(handle), "busId"),
            serial=optional(lambda: texts.call("serial", N.nvmlDeviceGetSerial, handle)),
            minor_number=minor,
            vbios_version=optional(lambda: texts.call("vbios_version", N.nvmlDeviceGetVbiosVersion, handle)),
            architecture=None if arch is None else _ARCHITECTURES.get(arch, "unknown"),
        )

    def _probe(self, gpu: _Gpu) -> None:
        """Probe the enabled groups once: the fields of all of them in one call, then each group."""
        dev = _Probe(gpu.handle, self._probe_fields(gpu.handle), self._options, self._numbering,
                     gpu.identity)
        gpu.cleanups = dev.cleanups  # freed with the GPU even when it is lost while probing
        fast, slow = [], []
        for group in self._groups:
            dev.group = group.name
            reader = group.nvml(dev)  # type: ignore[misc]
            if group.fast is not None:
                fast.append((group.name, group.fast, reader))
            if group.slow is not None:
                slow.append((group.name, group.slow, reader))
            if group.name == "xid":
                gpu.events = bool(getattr(reader, "supported", False))
        gpu.fast, gpu.slow, gpu.features = tuple(fast), tuple(slow), dev.features
        gpu.mig = dev.mig if dev.features.get("mig") else None
        gpu.batches = {tier: _Batch(owners) for tier, owners in dev.used.items() if owners}

    def _probe_fields(self, handle: Any) -> dict[int, int | None]:
        """The enabled groups' field ids this GPU answers (one call), with the value type each answered in."""
        ids = list(self._field_ids)
        if not ids:
            return {}
        try:
            values = _Batch(self._field_ids).run(handle)
        except N.NVMLError as exc:
            if exc.value in _UNSUPPORTED:
                return {}
            if _is_gone(exc.value):
                raise
            return dict.fromkeys(ids)  # transient: keep them all, errors are counted when polled
        return {int(v.fieldId): int(v.valueType) for v in values if v.nvmlReturn == N.NVML_SUCCESS}

    def _register_events(self) -> None:
        wanted = [d for d in self._devices.values() if d.events]
        mig = [d for d in self._devices.values() if d.mig is not None]
        if not wanted and not mig:
            return
        with self._events_lock:
            try:
                if self._event_set is None:
                    self._event_set = N.nvmlEventSetCreate()
                for d in wanted:
                    try:
                        N.nvmlDeviceRegisterEvents(d.handle, _XID_EVENT, self._event_set)
                    except N.NVMLError:
                        d.events = False
                        d.features["xid_events"] = False
                for d in mig:  # its own registration: a GPU that cannot deliver it keeps its XIDs
                    try:
                        N.nvmlDeviceRegisterEvents(d.handle, _MIG_CONFIG_EVENT, self._event_set)
                    except N.NVMLError:
                        pass  # the slow tier enumerates the instances anyway
            except N.NVMLError:
                self._event_set = None

    # -- polls ----------------------------------------------------------------------------------
    def _device(self, uuid: str) -> _Gpu:
        try:
            return self._devices[uuid]
        except KeyError:
            raise BackendUnavailable("uninitialized", "NVML backend is not initialised",
                                     "gpuwatch re-initialises it by itself") from None

    def _read(self, uuid: str, tier: str) -> tuple[dict[str, Any], list[str], tuple[tuple[str, float, bool], ...]]:
        gpu = self._device(uuid)
        if gpu.lost_while_probing:
            raise DeviceLost(uuid, "NVML: GPU is lost (it was lost while gpuwatch probed it at discovery)")
        q = _Query(self, uuid)
        clock = time.perf_counter
        batch_seconds, shares = 0.0, _NO_SHARES
        batch = gpu.batches.get(tier)
        if batch is not None:
            started = clock()
            q.load(batch, gpu.handle)
            batch_seconds, shares = clock() - started, batch.shares
        fast = tier == "fast"
        readings: dict[str, Any] = {}
        collected = []
        errors, field_errors = q.errors, q.field_errors
        for name, attr, reader in gpu.fast if fast else gpu.slow:
            before = len(errors)
            started = clock()
            try:
                readings[attr] = reader.read_fast(q) if fast else reader.read_slow(q)
            except (DeviceLost, BackendUnavailable):
                raise
            except Exception as exc:  # a bug, or an answer the group did not expect: that group, that GPU only
                errors.append("internal")
                self._group_failed(uuid, name, exc)
            seconds = clock() - started + batch_seconds * shares.get(name, 0.0)
            collected.append((name, seconds, len(errors) == before and not field_errors.get(name)))
        return readings, errors, tuple(collected)

    def _group_failed(self, uuid: str, group: str, exc: Exception) -> None:
        """Log a group's read that raised, once per GPU and group (a value it cannot take repeats every poll)."""
        if (uuid, group) in self._failed_groups:
            return
        self._failed_groups.add((uuid, group))
        get_logger(component="nvml").error(
            "group_read_failed", uuid=uuid, group=group, error=f"{type(exc).__name__}: {exc}",
            hint="a gpuwatch bug or an NVML answer it cannot read: please report it with `nvidia-smi -q`; the "
                 "group's reading on this GPU is left out (gpuwatch_collector_success 0), everything else goes on")

    def read_fast(self, uuid: str) -> FastSample:
        readings, errors, collected = self._read(uuid, "fast")
        return FastSample(**readings, errors=tuple(errors), collected=collected)

    def read_slow(self, uuid: str) -> SlowSample:
        readings, errors, collected = self._read(uuid, "slow")
        return SlowSample(**readings, errors=tuple(errors), collected=collected)

    # -- events ---------------------------------------------------------------------------------
    def _mig_changed(self, handle: Any) -> None:
        """A MIG instance was created or destroyed: enumerate that GPU's MIG devices again now, so the
        fast tier reads the new set at once (the slow tier's instance list follows at its next poll)."""
        uuid = self._by_handle.get(_handle_key(handle))
        gpu = self._devices.get(uuid) if uuid is not None else None
        if gpu is None or gpu.mig is None:
            return
        try:
            instances = gpu.mig.instances()
        except N.NVMLError as exc:
            get_logger(component="nvml").warning("mig_enumeration_failed", uuid=uuid, error=f"NVML: {exc}",
                                                 hint="the next slow poll enumerates the MIG instances again")
            return
        get_logger(component="nvml").info("mig_config_changed", uuid=uuid, instances=len(instances))

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        if not self._open:
            raise BackendUnavailable("uninitialized", "NVML backend is not initialised", "")
        if self._event_set is None:  # no GPU delivers XID events
            time.sleep(timeout_seconds)
            return []
        if not self._events_lock.acquire(timeout=timeout_seconds):
            return []
        try:
            event_set = self._event_set
            if event_set is None:
                return []
            events: list[XidEvent] = []
            wait_ms = max(0, int(timeout_seconds * 1000))
            while True:
                try:
                    data = N.nvmlEventSetWait_v2(event_set, wait_ms)
                except N.NVMLError as exc:
                    if exc.value == N.NVML_ERROR_TIMEOUT:
                        return events
                    if exc.value in _BACKEND_GONE:
                        raise self._unavailable(exc) from None
                    return events  # e.g. GPU_IS_LOST on the event's device: the polls report it
                wait_ms = 0  # drain what is queued, then return
                if data.eventType & _MIG_CONFIG_EVENT:
                    self._mig_changed(data.device)
                if not data.eventType & _XID_EVENT:
                    continue
                uuid = self._by_handle.get(_handle_key(data.device))
                if uuid is not None:
                    events.append(XidEvent(uuid=uuid, xid=int(data.eventData), timestamp=time.time()))
        finally:
            self._events_lock.release()
