"""How NVML is called: text decoding, the direct getters of every fast poll, the batched
field-values call, and the funnel's own wrappers where pynvml's do not fit."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.fabric import fabric_info
from gpuwatch.backends.nvml.structs import FieldValue, plain


class Texts:
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



# The getters of every fast poll, called here the way pynvml's wrappers call them (make the output,
# call, check the return, read the output) but with the output made once per GPU and the function
# resolved once: about a microsecond less per call. C name -> (output type; its version member's
# value, or None; the output's members that take the arguments, in order, or () when the arguments
# are passed to the C function after the handle (as unsigned ints); what to return: None the
# scalar's value, "" the structure (read it at once: the next call overwrites it), else that
# member). The layouts are pynvml's own (plain), the same ABI as its wrappers.
_DIRECT: Mapping[str, tuple[Any, int | None, tuple[str, ...], str | None]] = {
    "nvmlDeviceGetTemperatureV": (plain(N.c_nvmlTemperature_v1_t), N.nvmlTemperature_v1, ("sensorType",),
                                  "temperature"),
    "nvmlDeviceGetTemperature": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetMarginTemperature": (plain(N.c_nvmlMarginTemperature_v1_t), N.nvmlMarginTemperature_v1, (),
                                       "marginTemperature"),
    "nvmlDeviceGetPerformanceState": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetPowerUsage": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetUtilizationRates": (plain(N.c_nvmlUtilization_t), None, (), ""),
    "nvmlDeviceGetMemoryInfo_v2": (plain(N.c_nvmlMemory_v2_t), N.nvmlMemory_v2, (), ""),
    "nvmlDeviceGetClockInfo": (ctypes.c_uint, None, (), None),
    "nvmlDeviceGetCurrentClocksEventReasons": (ctypes.c_ulonglong, None, (), None),
}


def direct(function: str, handle: Any, args: tuple[Any, ...]) -> Callable[[], Any] | None:
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


# nvmlFieldValue_t's value union read as each nvmlValueType_t (dVal, uiVal, ulVal, ullVal, sllVal, siVal, usVal:
# VALUE_MEMBERS' order), padded to the union's 8 bytes; native byte order, no alignment (the layout is checked).
_VALUE_FORMATS = ("d", "I4x", "Q" if ctypes.sizeof(ctypes.c_ulong) == 8 else "I4x", "Q", "q", "i4x", "H6x")


class Batch:
    """One GPU's field-values call for one tier: the keys fixed at discovery, the array built once.

    ``values`` reads the answer with one ``struct`` unpack, in the value types of the last answer in which
    every entry succeeded (``learn``), instead of ctypes' attribute reads of each entry (a third of a
    fast poll's decoding; the same values: Python ints and floats); None when the answer is not in that
    shape (an entry failed, a type changed): the caller reads the entries one by one then."""

    __slots__ = ("ids", "owners", "shares", "_pristine", "_buffer", "_size", "_count", "_fn", "_kinds", "_layout")

    def __init__(self, owners: Mapping[FieldKey, str]) -> None:
        """``owners``: field key (an id, or (id, scopeId)) -> the group that reads it."""
        self.ids = tuple(owners)
        self.owners = dict(owners)
        # group -> its share of the call's ids: the share of the call's time put down to it
        self.shares = {group: sum(1 for g in owners.values() if g == group) / len(owners)
                       for group in set(owners.values())}
        self._count = ctypes.c_int32(len(self.ids))
        self._pristine = (FieldValue * len(self.ids))()
        for entry, key in zip(self._pristine, self.ids):
            if isinstance(key, tuple):
                entry.fieldId, entry.scopeId = key
            else:
                entry.fieldId = key
        self._buffer = (FieldValue * len(self.ids))()
        self._size = ctypes.sizeof(self._pristine)
        self._fn = N._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")  # after nvmlInit; pynvml caches it
        self._kinds: tuple[int, ...] | None = None
        self._layout: struct.Struct | None = None

    def run(self, handle: Any) -> Any:
        ctypes.memmove(self._buffer, self._pristine, self._size)
        N._nvmlCheckReturn(self._fn(handle, self._count, self._buffer))
        return self._buffer

    def learn(self, kinds: tuple[int, ...]) -> None:
        """The value type of each entry of an answer in which every entry succeeded: ``values`` reads the next
        answers in them."""
        if kinds == self._kinds or len(kinds) != len(self.ids) or not all(0 <= k < len(_VALUE_FORMATS) for k in kinds):
            return
        # per entry: fieldId, scopeId, timestamp, latencyUsec (24 bytes), valueType, nvmlReturn, the value
        layout = struct.Struct("=" + "".join("24xII" + _VALUE_FORMATS[k] for k in kinds))
        if layout.size != self._size:  # not the layout this code knows: the entries are read one by one
            return
        self._kinds, self._layout = kinds, layout

    def values(self) -> tuple[Any, ...] | None:
        """The last answer's values in ``ids``' order, when every entry succeeded in the learnt value types."""
        layout = self._layout
        if layout is None:
            return None
        flat = layout.unpack_from(self._buffer)  # (valueType, nvmlReturn, value) per entry
        if flat[0::3] != self._kinds or any(flat[1::3]):
            return None
        return flat[2::3]



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



_OWN: Mapping[str, Callable[..., Any]] = {
    "nvmlDeviceGetFanSpeedRPM": _fan_rpm,
    "nvmlDeviceGetMemoryInfo_v2": _memory_v2,
    "nvmlDeviceGetGpuFabricInfo": fabric_info,
}



def resolve(function: str) -> Callable[..., Any] | None:
    """The callable for an NVML C function name: the funnel's own wrapper, else pynvml's; None when
    this binding has none (an older nvidia-ml-py): unsupported, like FUNCTION_NOT_FOUND."""
    own = _OWN.get(function)
    return own if own is not None else getattr(N, function, None)



def handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value
