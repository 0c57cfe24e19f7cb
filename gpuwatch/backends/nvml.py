"""The NVML backend: the only module that imports pynvml (nvidia-ml-py).

Every NVML call goes through this module's funnel, which maps NVML errors to outcomes:

- NOT_SUPPORTED, INVALID_ARGUMENT, NO_PERMISSION, FUNCTION_NOT_FOUND, DEPRECATED while probing:
  the GPU has no such reading. Probed once per GPU at discovery, cached, exported as
  gpuwatch_gpu_feature_supported, never polled (nor logged) again.
- GPU_IS_LOST: DeviceLost for that GPU; the others go on.
- UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH: BackendUnavailable
  with a hint; the poller backs off and re-initialises.
- anything else (UNKNOWN, TIMEOUT, ...): that reading is absent from this poll and its error name is
  counted in gpuwatch_poll_errors_total.

Newer APIs are tried first and older ones used on FUNCTION_NOT_FOUND (older driver):
GetTemperatureV -> GetTemperature, GetCurrentClocksEventReasons -> GetCurrentClocksThrottleReasons,
memory info v2 -> v1. Counters come in one nvmlDeviceGetFieldValues batch per tier, each entry's own
return code and value type checked. Values are converted to base units here, at the edge.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml as N

from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.logs import get_logger
from gpuwatch.model import (
    DiscoveredGpu,
    DriverInfo,
    FanReading,
    FastSample,
    GpuIdentity,
    GpuProcess,
    SlowSample,
    XidEvent,
    decode_clocks_event_reasons,
)

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

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}
_CLOCK_TYPES = {"graphics": N.NVML_CLOCK_GRAPHICS, "sm": N.NVML_CLOCK_SM, "memory": N.NVML_CLOCK_MEM,
                "video": N.NVML_CLOCK_VIDEO}
_THRESHOLDS = {"shutdown": 0, "slowdown": 1, "memory_max": 2, "gpu_max": 3}
_XID_EVENT = N.nvmlEventTypeXidCriticalError

# field id -> (kind, key). Fast tier.
_FAST_FIELDS: dict[int, tuple[str, str]] = {
    82: ("memory_temperature", ""),
    83: ("energy", ""),
    74: ("throttle", "sw_power_cap"),
    75: ("throttle", "thermal"),
    76: ("throttle", "sync_boost"),
    77: ("throttle", "board_limit"),
    78: ("throttle", "low_utilization"),
    79: ("throttle", "reliability"),
    269: ("throttle", "sw_thermal_slowdown"),
    270: ("throttle", "hw_thermal_slowdown"),
    271: ("throttle", "hw_power_brake_slowdown"),
}
# Slow tier.
_SLOW_FIELDS: dict[int, tuple[str, Any]] = {
    3: ("ecc", ("corrected", "volatile")),
    4: ("ecc", ("uncorrected", "volatile")),
    5: ("ecc", ("corrected", "aggregate")),
    6: ("ecc", ("uncorrected", "aggregate")),
    31: ("retired_pending", None),
    94: ("pcie_replays", None),
    142: ("remap", "correctable"),
    143: ("remap", "uncorrectable"),
    144: ("remap_pending", None),
    145: ("remap_failed", None),
    193: ("tlimit", "shutdown"),
    194: ("tlimit", "slowdown"),
    195: ("tlimit", "memory_max"),
    196: ("tlimit", "gpu_max"),
}
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _field_value(entry: Any) -> float | int:
    return getattr(entry.value, _VALUE_MEMBERS[entry.valueType])


class _Unsupported(Exception):
    """A probe found that the GPU has no such reading."""


def _probe(fn: Callable[..., Any], *args: Any) -> Any:
    """Call once at discovery: the value, or _Unsupported. GPU_IS_LOST and lifecycle errors propagate."""
    try:
        return fn(*args)
    except N.NVMLError as exc:
        if exc.value in _UNSUPPORTED:
            raise _Unsupported from None
        raise


def _first_supported(*candidates: tuple[Callable[..., Any], tuple[Any, ...]]) -> Callable[..., Any] | None:
    """The first API that works (newest first). None if the GPU supports none of them."""
    for fn, args in candidates:
        try:
            _probe(fn, *args)
            return fn
        except _Unsupported:
            continue
        except N.NVMLError:
            return fn  # exists, failed for another reason: keep it, errors are counted when polled
    return None


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


def _fan_rpm(handle: Any, fan: int) -> int:
    # pynvml's wrapper hard-codes fan 0; build the versioned struct for any fan.
    info = N.c_nvmlFanSpeedInfo_t()
    info.version = N.nvmlFanSpeedInfo_v1
    info.fan = fan
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetFanSpeedRPM")
    N._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
    return info.speed


def _memory_v2(handle: Any) -> Any:
    return N.nvmlDeviceGetMemoryInfo(handle, version=N.nvmlMemory_v2)


def _temperature_v(handle: Any) -> int:
    return N.nvmlDeviceGetTemperatureV(handle, N.NVML_TEMPERATURE_GPU)


def _temperature_v1(handle: Any) -> int:
    return N.nvmlDeviceGetTemperature(handle, N.NVML_TEMPERATURE_GPU)


def _handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


@dataclass
class _Device:
    """A GPU's handle and the capabilities probed once at discovery."""

    handle: Any
    identity: GpuIdentity
    features: dict[str, bool] = field(default_factory=dict)
    temperature: Callable[[Any], int] | None = None
    margin: bool = False
    fans: int = 0
    fan_target: bool = False
    fan_rpm: bool = False
    power: bool = False
    pstate: bool = False
    utilization: bool = False
    encoder: bool = False
    decoder: bool = False
    memory: Callable[[Any], Any] | None = None
    clocks: tuple[tuple[str, int], ...] = ()
    reasons: Callable[[Any], int] | None = None
    supported_reasons: int = 0
    fast_fields: tuple[int, ...] = ()
    slow_fields: tuple[int, ...] = ()
    thresholds: tuple[tuple[str, int], ...] = ()
    power_limits: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    max_clocks: tuple[tuple[str, int], ...] = ()
    pcie: bool = False
    processes: Callable[[Any], Any] | None = None


class _Query:
    """Calls NVML for one GPU's poll: lost GPU and lifecycle errors raise, any other error leaves the
    reading out and is remembered (by lowercase name) for gpuwatch_poll_errors_total."""

    __slots__ = ("_backend", "_uuid", "errors")

    def __init__(self, backend: NvmlBackend, uuid: str) -> None:
        self._backend = backend
        self._uuid = uuid
        self.errors: list[str] = []

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except N.NVMLError as exc:
            failure = self._backend._fail(exc, self._uuid)
            if failure is not None:
                raise failure from None
            self.errors.append(ERROR_NAMES.get(exc.value, "unknown"))
            return None


class NvmlBackend:
    name = "nvml"

    def __init__(self) -> None:
        self._devices: dict[str, _Device] = {}
        self._by_handle: dict[int | None, str] = {}
        self._event_set: Any = None
        self._events_lock = threading.Lock()
        self._open = False

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
        return DriverInfo(driver_version=driver, nvml_version=nvml, cuda_driver_version=cuda,
                          errors=("invalid_utf8",) * len(texts.invalid))

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
            self._devices = {}
            self._by_handle = {}
            if have_events_lock:
                try:
                    N.nvmlShutdown()
                except N.NVMLError:
                    pass
        finally:
            if have_events_lock:
                self._events_lock.release()

    @staticmethod
    def _unavailable(exc: N.NVMLError) -> BackendUnavailable:
        reason, hint = _BACKEND_GONE.get(
            exc.value, (ERROR_NAMES.get(exc.value, "unknown"), "check `nvidia-smi`; gpuwatch keeps retrying"))
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
        devices: dict[str, _Device] = {}
        for index in range(count):
            texts = _Texts()
            try:
                handle = N.nvmlDeviceGetHandleByIndex(index)
                identity = self._identity(handle, index, texts)
            except N.NVMLError as exc:
                if exc.value in _BACKEND_GONE and exc.value != N.NVML_ERROR_NO_PERMISSION:
                    raise self._unavailable(exc) from None
                # The GPU cannot even be identified (lost, no permission): gpuwatch_gpus says how many are seen.
                get_logger(component="nvml").error(
                    "gpu_unidentifiable", gpu=str(index), error=f"NVML: {exc}",
                    hint="the driver counts this GPU but cannot open it: check `nvidia-smi` and `dmesg`")
                continue
            device = _Device(handle=handle, identity=identity)
            try:
                self._probe_device(device)
            except N.NVMLError as exc:
                if exc.value in _BACKEND_GONE and exc.value != N.NVML_ERROR_NO_PERMISSION:
                    raise self._unavailable(exc) from None
                device.features = {}  # lost while probing: its polls report it down
            devices[identity.uuid] = device
            errors = ()
            if texts.invalid:
                errors = ("invalid_utf8",) * len(texts.invalid)
                get_logger(component="nvml").warning(
                    "nvml_invalid_text", gpu=str(index), uuid=identity.uuid, texts=texts.invalid,
                    hint="the GPU reported text that is not UTF-8 (a corrupted InfoROM?); it is shown with U+FFFD "
                         "and the GPU is monitored as usual; check `nvidia-smi -q -i " + str(index) + "`")
            found.append(DiscoveredGpu(identity=identity, features=dict(device.features), errors=errors))
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

    def _probe_device(self, d: _Device) -> None:
        h = d.handle
        f = d.features

        def supported(fn: Callable[..., Any], *args: Any) -> bool:
            try:
                _probe(fn, *args)
                return True
            except _Unsupported:
                return False
            except N.NVMLError as exc:
                if exc.value == _LOST or exc.value in _BACKEND_GONE:
                    raise
                return True  # transient failure: keep polling it, errors get counted

        d.temperature = _first_supported((_temperature_v, (h,)), (_temperature_v1, (h,)))
        d.margin = f["temperature_margin"] = supported(N.nvmlDeviceGetMarginTemperature, h)
        try:
            d.fans = int(_probe(N.nvmlDeviceGetNumFans, h))
        except _Unsupported:
            d.fans = 0
        if d.fans and not supported(N.nvmlDeviceGetFanSpeed_v2, h, 0):
            d.fans = 0
        f["fan"] = d.fans > 0
        d.fan_target = f["fan_target"] = d.fans > 0 and supported(N.nvmlDeviceGetTargetFanSpeed, h, 0)
        d.fan_rpm = f["fan_rpm"] = d.fans > 0 and supported(_fan_rpm, h, 0)
        d.power = f["power"] = supported(N.nvmlDeviceGetPowerUsage, h)
        d.pstate = supported(N.nvmlDeviceGetPerformanceState, h)
        d.utilization = f["utilization"] = supported(N.nvmlDeviceGetUtilizationRates, h)
        d.encoder = supported(N.nvmlDeviceGetEncoderUtilization, h)
        d.decoder = supported(N.nvmlDeviceGetDecoderUtilization, h)
        d.memory = _first_supported((_memory_v2, (h,)), (N.nvmlDeviceGetMemoryInfo, (h,)))
        d.clocks = tuple((n, t) for n, t in _CLOCK_TYPES.items() if supported(N.nvmlDeviceGetClockInfo, h, t))
        d.max_clocks = tuple((n, t) for n, t in _CLOCK_TYPES.items() if supported(N.nvmlDeviceGetMaxClockInfo, h, t))
        d.reasons = _first_supported((N.nvmlDeviceGetCurrentClocksEventReasons, (h,)),
                                     (N.nvmlDeviceGetCurrentClocksThrottleReasons, (h,)))
        f["clocks_event_reasons"] = d.reasons is not None
        if d.reasons is not None:
            mask_fn = _first_supported((N.nvmlDeviceGetSupportedClocksEventReasons, (h,)),
                                       (N.nvmlDeviceGetSupportedClocksThrottleReasons, (h,)))
            try:
                d.supported_reasons = int(mask_fn(h)) if mask_fn else 0x1FF
            except N.NVMLError:
                d.supported_reasons = 0x1FF
        d.fast_fields = self._probe_fields(h, _FAST_FIELDS)
        d.slow_fields = self._probe_fields(h, _SLOW_FIELDS)
        fast_kinds = {_FAST_FIELDS[i][0] for i in d.fast_fields}
        slow_kinds = {_SLOW_FIELDS[i][0] for i in d.slow_fields}
        f["memory_temperature"] = "memory_temperature" in fast_kinds
        f["energy"] = "energy" in fast_kinds
        f["clocks_event_time"] = "throttle" in fast_kinds
        f["ecc"] = "ecc" in slow_kinds
        f["remapped_rows"] = "remap" in slow_kinds
        f["retired_pages"] = "retired_pending" in slow_kinds
        d.thresholds = tuple((n, t) for n, t in _THRESHOLDS.items()
                             if supported(N.nvmlDeviceGetTemperatureThreshold, h, t))
        limits = {
            "enforced": N.nvmlDeviceGetEnforcedPowerLimit,
            "default": N.nvmlDeviceGetPowerManagementDefaultLimit,
            "constraints": N.nvmlDeviceGetPowerManagementLimitConstraints,
        }
        d.power_limits = {k: fn for k, fn in limits.items() if supported(fn, h)}
        f["power_limit"] = "enforced" in d.power_limits
        d.pcie = f["pcie"] = supported(N.nvmlDeviceGetCurrPcieLinkGeneration, h)
        # The versioned calls, newest first: the unversioned wrapper raises NVMLLibraryMismatchError,
        # which is no NVMLError, when _v3 is missing (nvml.md §9).
        d.processes = _first_supported((N.nvmlDeviceGetComputeRunningProcesses_v3, (h,)),
                                       (N.nvmlDeviceGetComputeRunningProcesses_v2, (h,)))
        try:
            f["xid_events"] = bool(int(_probe(N.nvmlDeviceGetSupportedEventTypes, h)) & _XID_EVENT)
        except _Unsupported:
            f["xid_events"] = False

    @staticmethod
    def _probe_fields(handle: Any, table: dict[int, Any]) -> tuple[int, ...]:
        try:
            values = _probe(N.nvmlDeviceGetFieldValues, handle, list(table))
        except _Unsupported:
            return ()
        except N.NVMLError as exc:
            if exc.value == _LOST or exc.value in _BACKEND_GONE:
                raise
            return tuple(table)
        return tuple(v.fieldId for v in values if v.nvmlReturn == N.NVML_SUCCESS)

    def _register_events(self) -> None:
        wanted = [d for d in self._devices.values() if d.features.get("xid_events")]
        if not wanted:
            return
        with self._events_lock:
            try:
                if self._event_set is None:
                    self._event_set = N.nvmlEventSetCreate()
                for d in wanted:
                    try:
                        N.nvmlDeviceRegisterEvents(d.handle, _XID_EVENT, self._event_set)
                    except N.NVMLError:
                        d.features["xid_events"] = False
            except N.NVMLError:
                self._event_set = None

    # -- polls ----------------------------------------------------------------------------------
    def _device(self, uuid: str) -> _Device:
        try:
            return self._devices[uuid]
        except KeyError:
            raise BackendUnavailable("uninitialized", "NVML backend is not initialised",
                                     "gpuwatch re-initialises it by itself") from None

    def read_fast(self, uuid: str) -> FastSample:
        d = self._device(uuid)
        h = d.handle
        q = _Query(self, uuid)
        errors = q.errors

        temperature = q(d.temperature, h) if d.temperature else None
        margin = q(N.nvmlDeviceGetMarginTemperature, h) if d.margin else None
        fans = []
        for i in range(d.fans):
            speed = q(N.nvmlDeviceGetFanSpeed_v2, h, i)
            target = q(N.nvmlDeviceGetTargetFanSpeed, h, i) if d.fan_target else None
            rpm = q(_fan_rpm, h, i) if d.fan_rpm else None
            fans.append(FanReading(
                fan=i,
                speed_ratio=None if speed is None else speed / 100.0,
                target_speed_ratio=None if target is None else target / 100.0,
                speed_rpm=None if rpm is None else float(rpm),
            ))
        power_mw = q(N.nvmlDeviceGetPowerUsage, h) if d.power else None
        pstate = q(N.nvmlDeviceGetPerformanceState, h) if d.pstate else None
        utilization: dict[str, float] = {}
        if d.utilization:
            rates = q(N.nvmlDeviceGetUtilizationRates, h)
            if rates is not None:
                utilization["gpu"] = rates.gpu / 100.0
                utilization["memory"] = rates.memory / 100.0
        if d.encoder:
            enc = q(N.nvmlDeviceGetEncoderUtilization, h)
            if enc is not None:
                utilization["encoder"] = enc[0] / 100.0
        if d.decoder:
            dec = q(N.nvmlDeviceGetDecoderUtilization, h)
            if dec is not None:
                utilization["decoder"] = dec[0] / 100.0
        memory = q(d.memory, h) if d.memory else None
        clocks = {}
        for name, clock_type in d.clocks:
            mhz = q(N.nvmlDeviceGetClockInfo, h, clock_type)
            if mhz is not None:
                clocks[name] = mhz * 1e6
        active: dict[str, bool] = {}
        if d.reasons is not None:
            mask = q(d.reasons, h)
            if mask is not None:
                active = decode_clocks_event_reasons(int(mask), d.supported_reasons)
        memory_temperature = energy = None
        throttle: dict[str, float] = {}
        if d.fast_fields:
            values = q(N.nvmlDeviceGetFieldValues, h, list(d.fast_fields))
            for entry in values or ():
                if entry.nvmlReturn != N.NVML_SUCCESS:
                    if entry.nvmlReturn == _LOST:
                        raise DeviceLost(uuid, "NVML: GPU is lost")
                    errors.append(ERROR_NAMES.get(entry.nvmlReturn, "unknown"))
                    continue
                kind, key = _FAST_FIELDS[entry.fieldId]
                value = _field_value(entry)
                if kind == "memory_temperature":
                    memory_temperature = float(value)
                elif kind == "energy":
                    energy = value / 1000.0
                else:
                    throttle[key] = value / 1e9
        has_v2 = memory is not None and hasattr(memory, "reserved")
        return FastSample(
            temperature_celsius=None if temperature is None else float(temperature),
            memory_temperature_celsius=memory_temperature,
            temperature_margin_celsius=None if margin is None else float(margin),
            fans=tuple(fans),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            energy_joules=energy,
            performance_state=None if pstate is None or pstate > 15 else int(pstate),
            utilization_ratio=utilization,
            memory_total_bytes=None if memory is None else int(memory.total),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_free_bytes=None if memory is None else int(memory.free),
            memory_reserved_bytes=int(memory.reserved) if has_v2 else None,
            clock_hertz=clocks,
            clocks_event_active=active,
            clocks_event_seconds=throttle,
            errors=tuple(errors),
        )

    def read_slow(self, uuid: str) -> SlowSample:
        d = self._device(uuid)
        h = d.handle
        q = _Query(self, uuid)
        errors = q.errors

        thresholds = {}
        for name, kind in d.thresholds:
            value = q(N.nvmlDeviceGetTemperatureThreshold, h, kind)
            if value is not None:
                thresholds[name] = float(value)
        limits: dict[str, float] = {}
        if "enforced" in d.power_limits:
            value = q(d.power_limits["enforced"], h)
            if value is not None:
                limits["enforced"] = value / 1000.0
        if "default" in d.power_limits:
            value = q(d.power_limits["default"], h)
            if value is not None:
                limits["default"] = value / 1000.0
        if "constraints" in d.power_limits:
            value = q(d.power_limits["constraints"], h)
            if value is not None:
                limits["min"], limits["max"] = value[0] / 1000.0, value[1] / 1000.0
        max_clocks = {}
        for name, clock_type in d.max_clocks:
            mhz = q(N.nvmlDeviceGetMaxClockInfo, h, clock_type)
            if mhz is not None:
                max_clocks[name] = mhz * 1e6
        generation: dict[str, int] = {}
        width: dict[str, int] = {}
        if d.pcie:
            for target, fn in ((generation, N.nvmlDeviceGetCurrPcieLinkGeneration),
                               (width, N.nvmlDeviceGetCurrPcieLinkWidth)):
                value = q(fn, h)
                if value is not None:
                    target["current"] = int(value)
            for target, fn in ((generation, N.nvmlDeviceGetMaxPcieLinkGeneration),
                               (width, N.nvmlDeviceGetMaxPcieLinkWidth)):
                value = q(fn, h)
                if value is not None:
                    target["max"] = int(value)
        ecc: dict[tuple[str, str], int] = {}
        remap: dict[str, int] = {}
        tlimit: dict[str, float] = {}
        pending = failed = retired = None
        replays = None
        if d.slow_fields:
            values = q(N.nvmlDeviceGetFieldValues, h, list(d.slow_fields))
            for entry in values or ():
                if entry.nvmlReturn != N.NVML_SUCCESS:
                    if entry.nvmlReturn == _LOST:
                        raise DeviceLost(uuid, "NVML: GPU is lost")
                    errors.append(ERROR_NAMES.get(entry.nvmlReturn, "unknown"))
                    continue
                kind, key = _SLOW_FIELDS[entry.fieldId]
                value = _field_value(entry)
                if kind == "ecc":
                    ecc[key] = int(value)
                elif kind == "remap":
                    remap[key] = int(value)
                elif kind == "remap_pending":
                    pending = bool(value)
                elif kind == "remap_failed":
                    failed = bool(value)
                elif kind == "retired_pending":
                    retired = bool(value)
                elif kind == "pcie_replays":
                    replays = int(value)
                elif kind == "tlimit":
                    tlimit[key] = float(value)
        processes = None
        if d.processes is not None:
            listed = q(d.processes, h)
            if listed is not None:
                processes = tuple(
                    GpuProcess(pid=int(p.pid), used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                    for p in listed
                )
        return SlowSample(
            temperature_threshold_celsius=thresholds,
            temperature_margin_threshold_celsius=tlimit,
            power_limit_watts=limits,
            clock_max_hertz=max_clocks,
            ecc_errors=ecc,
            remapped_rows=remap,
            remapped_rows_pending=pending,
            remapped_rows_failed=failed,
            retired_pages_pending=retired,
            pcie_link_generation=generation,
            pcie_link_width=width,
            pcie_replays=replays,
            processes=processes,
            errors=tuple(errors),
        )

    # -- events ---------------------------------------------------------------------------------
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
                if not data.eventType & _XID_EVENT:
                    continue
                uuid = self._by_handle.get(_handle_key(data.device))
                if uuid is not None:
                    events.append(XidEvent(uuid=uuid, xid=int(data.eventData), timestamp=time.time()))
        finally:
            self._events_lock.release()
