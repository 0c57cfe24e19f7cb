"""Traces: what a backend reported, recorded as versioned JSON lines, read back for replay.

The format (docs/trace-format.md) is one JSON object per line: a header, then records in time order,
each with ``t`` (seconds since the recording started) and a ``type``. Samples are stored flat, field
by field, in the units of model.py; ``None`` readings and empty mappings are left out, so "absent" in
the file means exactly "not supported" in the sample.

- ``encode_*``/``decode_*`` turn model objects into JSON-ready dicts and back; the round trip is exact.
- ``TraceWriter`` writes a trace, one flushed line per record, so a killed recorder leaves a readable
  prefix.
- ``Recorder`` wraps any Backend, forwards every call and writes what came back.
- ``read_trace`` reads and validates a whole file; every problem is a ReplayFormatError naming the
  file, the line and what is wrong. A last line cut short (recorder killed mid-write) is dropped,
  with a note in ``Trace.notes``.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Union

from gpuwatch import __version__
from gpuwatch.backends.base import Backend
from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost, ReplayFormatError
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
)

FORMAT = "gpuwatch-trace"
#: The format version this module writes.
VERSION = 1
#: Format versions this module reads.
READABLE_VERSIONS: tuple[int, ...] = (1,)
#: Separator of the two parts of a tuple key (SlowSample.ecc_errors: ("uncorrected", "volatile")).
KEY_SEPARATOR = "/"
TIERS = ("fast", "slow")

# ------------------------------------------------------------------------------------ field codecs
#
# A codec is (encode, decode). ``encode`` takes a non-empty model value and returns a JSON value
# (ValueError for what JSON cannot hold: NaN, infinity); ``decode`` takes a JSON value and the field
# name and returns the model value (ReplayFormatError saying what is wrong).


@dataclass(frozen=True, slots=True)
class _Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any, str], Any]
    kind: str  # what the docs call it, for messages


def _describe(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(name: str, expected: str, value: Any) -> ReplayFormatError:
    return ReplayFormatError(f"field {name!r}: expected {expected}, got {_describe(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode_float(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{number} cannot be recorded: readings must be finite numbers")
    return number


def _decode_float(value: Any, name: str) -> float:
    if (_is_int(value) or isinstance(value, float)) and math.isfinite(value):
        return float(value)
    raise _bad(name, "a number", value)


def _encode_int(value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _decode_int(value: Any, name: str) -> int:
    if _is_int(value):
        return int(value)
    raise _bad(name, "a whole number", value)


def _encode_bool(value: Any) -> bool:
    return bool(value)


def _decode_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _bad(name, "true or false", value)


def _decode_str(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    raise _bad(name, "a string", value)


FLOAT = _Codec(_encode_float, _decode_float, "number")
INT = _Codec(_encode_int, _decode_int, "whole number")
BOOL = _Codec(_encode_bool, _decode_bool, "true/false")
STR = _Codec(str, _decode_str, "string")


def _mapping(value_codec: _Codec) -> _Codec:
    """A mapping with string keys, as a JSON object."""

    def encode(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {str(key): value_codec.encode(value) for key, value in mapping.items()}

    def decode(value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _bad(name, f"an object of {value_codec.kind}s", value)
        return {key: value_codec.decode(item, f"{name}.{key}") for key, item in value.items()}

    return _Codec(encode, decode, f"object of {value_codec.kind}s")


def _pair_mapping(value_codec: _Codec) -> _Codec:
    """A mapping with (str, str) keys, as a JSON object with "first/second" keys."""

    def encode(mapping: Mapping[tuple[str, str], Any]) -> dict[str, Any]:
        result = {}
        for key, value in mapping.items():
            if len(key) != 2 or any(KEY_SEPARATOR in part or not part for part in key):
                raise ValueError(f"key {key!r} cannot be encoded as 'first{KEY_SEPARATOR}second'")
            result[KEY_SEPARATOR.join(key)] = value_codec.encode(value)
        return result

    def decode(value: Any, name: str) -> dict[tuple[str, str], Any]:
        if not isinstance(value, dict):
            raise _bad(name, f"an object of {value_codec.kind}s", value)
        result = {}
        for key, item in value.items():
            parts = tuple(key.split(KEY_SEPARATOR))
            if len(parts) != 2 or not all(parts):
                raise ReplayFormatError(
                    f"field {name!r}: key {key!r} is not of the form 'first{KEY_SEPARATOR}second' "
                    f"(e.g. 'uncorrected{KEY_SEPARATOR}volatile')"
                )
            result[parts] = value_codec.decode(item, f"{name}.{key}")
        return result

    return _Codec(encode, decode, f"object of {value_codec.kind}s")


def _decode_strings(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _bad(name, "a list of strings", value)
    return tuple(_decode_str(item, f"{name}[{i}]") for i, item in enumerate(value))


STRINGS = _Codec(lambda value: [str(item) for item in value], _decode_strings, "list of strings")

FAN_FIELDS: Mapping[str, _Codec] = {
    "fan": INT,
    "speed_ratio": FLOAT,
    "target_speed_ratio": FLOAT,
    "speed_rpm": FLOAT,
}


def _encode_fans(fans: Sequence[FanReading]) -> list[dict[str, Any]]:
    return [_encode_fields(fan, FAN_FIELDS) for fan in fans]


def _decode_fans(value: Any, name: str) -> tuple[FanReading, ...]:
    if not isinstance(value, list):
        raise _bad(name, "a list of fan objects", value)
    fans = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "a fan object", item)
        if "fan" not in item:
            raise ReplayFormatError(f"field {where!r}: missing 'fan' (the fan's index)")
        fans.append(FanReading(**_decode_fields(item, FAN_FIELDS, where + ".")))
    return tuple(fans)


FANS = _Codec(_encode_fans, _decode_fans, "list of fan objects")

PROCESS_FIELDS: Mapping[str, _Codec] = {"pid": INT, "used_memory_bytes": INT}


def _encode_processes(processes: Sequence[GpuProcess]) -> list[dict[str, Any]]:
    return [_encode_fields(process, PROCESS_FIELDS) for process in processes]


def _decode_processes(value: Any, name: str) -> tuple[GpuProcess, ...]:
    if not isinstance(value, list):
        raise _bad(name, "a list of process objects", value)
    processes = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict) or "pid" not in item:
            raise _bad(where, "a process object with a 'pid'", item)
        processes.append(GpuProcess(**_decode_fields(item, PROCESS_FIELDS, where + ".")))
    return tuple(processes)


PROCESSES = _Codec(_encode_processes, _decode_processes, "list of process objects")

#: FastSample field -> codec. Every field of FastSample must be here (tests/test_trace.py checks).
FAST_FIELDS: Mapping[str, _Codec] = {
    "temperature_celsius": FLOAT,
    "memory_temperature_celsius": FLOAT,
    "temperature_margin_celsius": FLOAT,
    "fans": FANS,
    "power_watts": FLOAT,
    "energy_joules": FLOAT,
    "performance_state": INT,
    "utilization_ratio": _mapping(FLOAT),
    "memory_total_bytes": INT,
    "memory_used_bytes": INT,
    "memory_free_bytes": INT,
    "memory_reserved_bytes": INT,
    "clock_hertz": _mapping(FLOAT),
    "clocks_event_active": _mapping(BOOL),
    "clocks_event_seconds": _mapping(FLOAT),
    "errors": STRINGS,
}

#: SlowSample field -> codec. Every field of SlowSample must be here (tests/test_trace.py checks).
SLOW_FIELDS: Mapping[str, _Codec] = {
    "temperature_threshold_celsius": _mapping(FLOAT),
    "temperature_margin_threshold_celsius": _mapping(FLOAT),
    "power_limit_watts": _mapping(FLOAT),
    "clock_max_hertz": _mapping(FLOAT),
    "ecc_errors": _pair_mapping(INT),
    "remapped_rows": _mapping(INT),
    "remapped_rows_pending": BOOL,
    "remapped_rows_failed": BOOL,
    "retired_pages_pending": BOOL,
    "pcie_link_generation": _mapping(INT),
    "pcie_link_width": _mapping(INT),
    "pcie_replays": INT,
    "processes": PROCESSES,
    "errors": STRINGS,
}

IDENTITY_FIELDS: Mapping[str, _Codec] = {
    "index": INT,
    "uuid": STR,
    "name": STR,
    "pci_bus_id": STR,
    "serial": STR,
    "minor_number": INT,
    "vbios_version": STR,
    "architecture": STR,
}
_IDENTITY_REQUIRED = ("index", "uuid", "name", "pci_bus_id")

DRIVER_FIELDS: Mapping[str, _Codec] = {
    "driver_version": STR,
    "nvml_version": STR,
    "cuda_driver_version": STR,
}


def _encode_fields(obj: Any, table: Mapping[str, _Codec]) -> dict[str, Any]:
    """The non-empty fields of ``obj``: None, empty mappings and empty tuples are left out."""
    result = {}
    for name, codec in table.items():
        value = getattr(obj, name)
        if value is None or (isinstance(value, (Mapping, tuple, list)) and not value):
            continue
        try:
            result[name] = codec.encode(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{type(obj).__name__}.{name}: {exc}") from None
    return result


def _decode_fields(data: Mapping[str, Any], table: Mapping[str, _Codec], prefix: str = "") -> dict[str, Any]:
    """Keyword arguments for the model class; keys not in ``table`` are ignored (compatibility)."""
    return {
        name: codec.decode(data[name], prefix + name)
        for name, codec in table.items()
        if name in data and data[name] is not None
    }


def _need_object(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise ReplayFormatError(f"{what}: expected a JSON object, got {_describe(data)}")
    return data


def encode_fast(sample: FastSample) -> dict[str, Any]:
    """The fields of a FastSample as a JSON-ready dict (absent readings left out)."""
    return _encode_fields(sample, FAST_FIELDS)


def decode_fast(data: Mapping[str, Any]) -> FastSample:
    """The FastSample of a dict made by ``encode_fast``; other keys (``t``, ``uuid``...) are ignored."""
    return FastSample(**_decode_fields(_need_object(data, "fast sample"), FAST_FIELDS))


def encode_slow(sample: SlowSample) -> dict[str, Any]:
    """The fields of a SlowSample as a JSON-ready dict; ecc_errors keys become "error/counter"."""
    return _encode_fields(sample, SLOW_FIELDS)


def decode_slow(data: Mapping[str, Any]) -> SlowSample:
    return SlowSample(**_decode_fields(_need_object(data, "slow sample"), SLOW_FIELDS))


def encode_identity(identity: GpuIdentity) -> dict[str, Any]:
    return _encode_fields(identity, IDENTITY_FIELDS)


def decode_identity(data: Mapping[str, Any]) -> GpuIdentity:
    data = _need_object(data, "GPU identity")
    missing = [name for name in _IDENTITY_REQUIRED if data.get(name) is None]
    if missing:
        raise ReplayFormatError(f"GPU identity: missing {', '.join(repr(m) for m in missing)}")
    return GpuIdentity(**_decode_fields(data, IDENTITY_FIELDS))


def encode_gpu(gpu: DiscoveredGpu) -> dict[str, Any]:
    """A discovered GPU: its identity fields plus ``features`` (feature -> supported)."""
    result = encode_identity(gpu.identity)
    result["features"] = {str(name): bool(on) for name, on in gpu.features.items()}
    return result


def decode_gpu(data: Mapping[str, Any]) -> DiscoveredGpu:
    data = _need_object(data, "GPU")
    identity = decode_identity(data)
    features = _mapping(BOOL).decode(data.get("features", {}), "features")
    return DiscoveredGpu(identity=identity, features=features)


def encode_driver(driver: DriverInfo) -> dict[str, Any]:
    return {name: str(getattr(driver, name)) for name in DRIVER_FIELDS}


def decode_driver(data: Any, name: str = "driver") -> DriverInfo:
    data = _need_object(data, f"field {name!r}")
    missing = [f for f in DRIVER_FIELDS if f not in data]
    if missing:
        raise ReplayFormatError(f"field {name!r}: missing {', '.join(repr(m) for m in missing)}")
    return DriverInfo(**_decode_fields(data, DRIVER_FIELDS, name + "."))


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class GpusRecord:
    """A discovery: the GPUs the backend listed, with their probed features."""

    t: float
    gpus: tuple[DiscoveredGpu, ...]


@dataclass(frozen=True, slots=True)
class FastRecord:
    t: float
    uuid: str
    sample: FastSample


@dataclass(frozen=True, slots=True)
class SlowRecord:
    t: float
    uuid: str
    sample: SlowSample


@dataclass(frozen=True, slots=True)
class LostRecord:
    """A read of this GPU raised DeviceLost (``tier``: which read, when known)."""

    t: float
    uuid: str
    tier: str | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class XidRecord:
    """An XID event; ``timestamp`` is the wall-clock time the backend gave it, when known."""

    t: float
    uuid: str
    xid: int
    timestamp: float | None = None


@dataclass(frozen=True, slots=True)
class BackendDownRecord:
    """A call raised BackendUnavailable."""

    t: float
    reason: str
    message: str
    hint: str = ""


@dataclass(frozen=True, slots=True)
class BackendUpRecord:
    """The backend opened; ``driver`` is what open() returned."""

    t: float
    driver: DriverInfo


Record = Union[GpusRecord, FastRecord, SlowRecord, LostRecord, XidRecord, BackendDownRecord, BackendUpRecord]

RECORD_TYPES: tuple[str, ...] = ("gpus", "fast", "slow", "lost", "xid", "backend_down", "backend_up")


def _need(data: Mapping[str, Any], name: str, codec: _Codec) -> Any:
    if data.get(name) is None:
        raise ReplayFormatError(f"missing field {name!r}")
    return codec.decode(data[name], name)


def _optional(data: Mapping[str, Any], name: str, codec: _Codec) -> Any:
    return None if data.get(name) is None else codec.decode(data[name], name)


def _decode_record(data: Mapping[str, Any], t: float) -> Record:
    kind = data["type"]
    if kind == "gpus":
        gpus = data.get("gpus")
        if not isinstance(gpus, list):
            raise _bad("gpus", "a list of GPU objects", gpus)
        decoded = []
        for i, gpu in enumerate(gpus):
            try:
                decoded.append(decode_gpu(gpu))
            except ReplayFormatError as exc:
                raise ReplayFormatError(f"gpus[{i}]: {exc}") from None
        return GpusRecord(t, tuple(decoded))
    if kind == "fast":
        return FastRecord(t, _need(data, "uuid", STR), decode_fast(data))
    if kind == "slow":
        return SlowRecord(t, _need(data, "uuid", STR), decode_slow(data))
    if kind == "lost":
        tier = _optional(data, "tier", STR)
        return LostRecord(t, _need(data, "uuid", STR), tier, _optional(data, "message", STR))
    if kind == "xid":
        return XidRecord(t, _need(data, "uuid", STR), _need(data, "xid", INT), _optional(data, "timestamp", FLOAT))
    if kind == "backend_down":
        return BackendDownRecord(
            t, _need(data, "reason", STR), _optional(data, "message", STR) or "", _optional(data, "hint", STR) or ""
        )
    if kind == "backend_up":
        if data.get("driver") is None:
            raise ReplayFormatError("missing field 'driver'")
        return BackendUpRecord(t, decode_driver(data["driver"]))
    raise ReplayFormatError(
        f"unknown record type {kind!r}; version {VERSION} has: {', '.join(RECORD_TYPES)}"
    )


# ----------------------------------------------------------------------------------------- writer


class TraceWriter:
    """Writes a trace: the header at once, then one line per ``write_*`` call, flushed.

    ``target`` is a path (the file is created or truncated, and closed by ``close()``) or an open
    text file (left open). ``t`` of a record is, unless given, seconds since the writer was made by
    ``clock.monotonic()``; given times must not go backwards. Safe to use from several threads.
    ``write_*`` raise ValueError for what cannot be recorded (a NaN reading), before writing
    anything, and OSError when the file cannot be written.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | IO[str],
        clock: Clock,
        *,
        backend: str,
        fast_interval: float,
        slow_interval: float,
        driver: DriverInfo | None = None,
    ) -> None:
        for name, value in (("fast_interval", fast_interval), ("slow_interval", slow_interval)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self._clock = clock
        self._lock = threading.Lock()
        self._last_t = 0.0
        self._records = 0
        if isinstance(target, (str, os.PathLike)):
            self.name = os.fspath(target)
            self._file: IO[str] = open(target, "w", encoding="utf-8", newline="\n")
            self._owned = True
        else:
            self.name = getattr(target, "name", "<stream>")
            self._file = target
            self._owned = False
        self._closed = False
        self.start = clock.monotonic()
        self.created = clock.wall()
        header: dict[str, Any] = {
            "type": "header",
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "backend": backend,
            "driver": None if driver is None else encode_driver(driver),
            "fast_interval": float(fast_interval),
            "slow_interval": float(slow_interval),
            "gpuwatch": __version__,
        }
        try:
            self._write_line(header)
        except BaseException:
            if self._owned:
                self._file.close()
            raise

    # -- records ------------------------------------------------------------------------------
    def write_gpus(self, gpus: Iterable[DiscoveredGpu], *, t: float | None = None) -> None:
        self._record("gpus", {"gpus": [encode_gpu(g) for g in gpus]}, t)

    def write_fast(self, uuid: str, sample: FastSample, *, t: float | None = None) -> None:
        self._record("fast", {"uuid": uuid, **encode_fast(sample)}, t)

    def write_slow(self, uuid: str, sample: SlowSample, *, t: float | None = None) -> None:
        self._record("slow", {"uuid": uuid, **encode_slow(sample)}, t)

    def write_lost(
        self, uuid: str, *, tier: str | None = None, message: str | None = None, t: float | None = None
    ) -> None:
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        fields_: dict[str, Any] = {"uuid": uuid}
        if tier is not None:
            fields_["tier"] = tier
        if message:
            fields_["message"] = message
        self._record("lost", fields_, t)

    def write_xid(self, uuid: str, xid: int, *, timestamp: float | None = None, t: float | None = None) -> None:
        fields_: dict[str, Any] = {"uuid": uuid, "xid": _encode_int(xid)}
        if timestamp is not None:
            fields_["timestamp"] = _encode_float(timestamp)
        self._record("xid", fields_, t)

    def write_backend_down(self, reason: str, message: str, hint: str = "", *, t: float | None = None) -> None:
        self._record("backend_down", {"reason": reason, "message": message, "hint": hint}, t)

    def write_backend_up(self, driver: DriverInfo, *, t: float | None = None) -> None:
        self._record("backend_up", {"driver": encode_driver(driver)}, t)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def records(self) -> int:
        """Records written so far (the header not counted)."""
        return self._records

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owned:
                self._file.close()
            else:
                self._file.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _record(self, kind: str, body: dict[str, Any], t: float | None) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"the trace writer of {self.name} is closed")
            if t is None:
                t = self._clock.monotonic() - self.start
            if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"t must be a finite number of seconds >= 0, got {t!r}")
            t = round(float(t), 6)
            if t < self._last_t:
                raise ValueError(f"records must be written in time order: t={t} after t={self._last_t}")
            self._write_line({"t": t, "type": kind, **body})
            self._last_t = t
            self._records += 1

    def _write_line(self, obj: Mapping[str, Any]) -> None:
        # Encode first: a value JSON cannot hold raises before anything reaches the file.
        line = json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()


# --------------------------------------------------------------------------------------- recorder


class Recorder:
    """A Backend that forwards every call to ``inner`` and records what came back in ``writer``.

    Discoveries, samples, DeviceLost, BackendUnavailable (from any call), successful opens and XID
    events are written with ``t = clock.monotonic() - writer.start`` (``clock`` must be the
    writer's clock). Recording never changes what the caller sees: a sample that cannot be
    recorded (a NaN reading) is skipped and counted in ``skipped``; when the file cannot be written
    (disk full) recording stops, ``error`` says why, and the calls keep being forwarded.
    """

    def __init__(self, inner: Backend, writer: TraceWriter, clock: Clock) -> None:
        self.name = inner.name
        self._inner = inner
        self._writer = writer
        self._clock = clock
        self._lock = threading.Lock()
        self._error: str | None = None
        self._skipped = 0
        self._log = get_logger(component="recorder", backend=inner.name)

    @property
    def inner(self) -> Backend:
        return self._inner

    @property
    def error(self) -> str | None:
        """Why recording stopped (the trace file could not be written), or None."""
        return self._error

    @property
    def skipped(self) -> int:
        """Records that could not be encoded and were left out."""
        return self._skipped

    # -- the Backend protocol ------------------------------------------------------------------
    def open(self) -> DriverInfo:
        try:
            driver = self._inner.open()
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_backend_up, driver)
        return driver

    def close(self) -> None:
        self._inner.close()

    def discover(self) -> list[DiscoveredGpu]:
        try:
            gpus = self._inner.discover()
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_gpus, list(gpus))
        return gpus

    def read_fast(self, uuid: str) -> FastSample:
        try:
            sample = self._inner.read_fast(uuid)
        except DeviceLost as exc:
            self._record(self._writer.write_lost, uuid, tier="fast", message=str(exc))
            raise
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_fast, uuid, sample)
        return sample

    def read_slow(self, uuid: str) -> SlowSample:
        try:
            sample = self._inner.read_slow(uuid)
        except DeviceLost as exc:
            self._record(self._writer.write_lost, uuid, tier="slow", message=str(exc))
            raise
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        self._record(self._writer.write_slow, uuid, sample)
        return sample

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        try:
            events = self._inner.wait_events(timeout_seconds)
        except BackendUnavailable as exc:
            self._down(exc)
            raise
        for event in events:
            self._record(self._writer.write_xid, event.uuid, event.xid, timestamp=event.timestamp)
        return events

    # -- internals -----------------------------------------------------------------------------
    def _down(self, exc: BackendUnavailable) -> None:
        self._record(self._writer.write_backend_down, exc.reason, exc.message, exc.hint)

    def _record(self, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        # One lock around "read the clock, write": records from several threads stay in time order.
        with self._lock:
            if self._error is not None or self._writer.closed:
                return
            t = max(0.0, self._clock.monotonic() - self._writer.start)
            try:
                write(*args, t=t, **kwargs)
            except ValueError as exc:
                if self._writer.closed:  # closed while a poll was still in flight: nothing to record
                    return
                self._skipped += 1
                if self._skipped == 1:
                    self._log.warning("trace_record_skipped", error=str(exc),
                                      hint="the backend returned a value JSON cannot hold; "
                                           "further skips are only counted")
            except OSError as exc:
                self._error = f"cannot write {self._writer.name}: {exc.strerror or exc}"
                self._log.error("trace_write_failed", error=self._error,
                                hint="free disk space or record to another file; the recording stops here")


# ----------------------------------------------------------------------------------------- reader


@dataclass(frozen=True, slots=True)
class TraceHeader:
    version: int
    created: float  # wall-clock seconds when the recording started
    backend: str  # the backend that was recorded
    driver: DriverInfo | None  # when known at the start; backend_up records carry it too
    fast_interval: float
    slow_interval: float


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace read by ``read_trace``: the header and the records, in time order."""

    source: str
    header: TraceHeader
    records: tuple[Record, ...]
    notes: tuple[str, ...] = ()  # things the caller may want to tell the user (a truncated line)

    @property
    def duration(self) -> float:
        """``t`` of the last record (0 for a trace without records)."""
        return self.records[-1].t if self.records else 0.0


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed (readings are finite numbers)")


def _parse_line(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_reject_constant)


def _decode_header(data: Any) -> TraceHeader:
    hint = 'the first line must be the header {"type": "header", "format": "gpuwatch-trace", "version": 1, ...}'
    if not isinstance(data, dict) or data.get("type") != "header":
        raise ReplayFormatError(f"missing header: {hint}")
    if data.get("format") != FORMAT:
        raise ReplayFormatError(f"not a gpuwatch trace: format is {_describe(data.get('format'))}, expected {FORMAT!r}")
    version = data.get("version")
    readable = ", ".join(str(v) for v in READABLE_VERSIONS)
    if not _is_int(version) or version < 1:
        raise ReplayFormatError(f"invalid trace format version {_describe(version)}: expected a whole number >= 1")
    if version not in READABLE_VERSIONS:
        raise ReplayFormatError(
            f"trace format version {version} is newer than this gpuwatch ({__version__}) can read "
            f"(it reads version {readable}): replay it with a newer gpuwatch"
        )
    driver = None if data.get("driver") is None else decode_driver(data["driver"])
    intervals = {}
    for name in ("fast_interval", "slow_interval"):
        value = _need(data, name, FLOAT)
        if value <= 0:
            raise _bad(name, "a positive number of seconds", value)
        intervals[name] = value
    return TraceHeader(
        version=version,
        created=_need(data, "created", FLOAT),
        backend=_need(data, "backend", STR),
        driver=driver,
        **intervals,
    )


def _decode_line(data: Any, last_t: float) -> Record:
    if not isinstance(data, dict):
        raise ReplayFormatError(f"expected a JSON object, got {_describe(data)}")
    kind = data.get("type")
    if kind == "header":
        raise ReplayFormatError("a second header: a trace has one header, on its first line")
    if not isinstance(kind, str):
        raise ReplayFormatError(f"missing or invalid 'type' (one of {', '.join(RECORD_TYPES)})")
    if "t" not in data:
        raise ReplayFormatError("missing field 't' (seconds since the recording started)")
    t = _decode_float(data["t"], "t")
    if t < 0:
        raise _bad("t", "seconds >= 0", data["t"])
    if t < last_t:
        raise ReplayFormatError(f"records are not in time order: t={t:g} after t={last_t:g}")
    return _decode_record(data, t)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a whole trace file.

    Raises ReplayFormatError ("FILE:LINE: what is wrong") for anything that is not a valid trace
    of a version this gpuwatch reads. A last line without its newline that does not parse (the
    recorder was killed while writing it) is dropped and reported in ``Trace.notes``.
    """
    name = os.fspath(path)
    try:
        file = open(path, "rb")
    except OSError as exc:
        raise ReplayFormatError(f"cannot read trace {name}: {exc.strerror or exc}") from None
    header: TraceHeader | None = None
    records: list[Record] = []
    notes: list[str] = []
    last_t = 0.0
    with file:
        try:
            for lineno, raw in enumerate(file, 1):
                if not raw.strip():
                    continue
                complete = raw.endswith(b"\n")
                try:
                    data = _parse_line(raw)
                except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN
                    if not complete:
                        notes.append(
                            f"{name}:{lineno}: the last line is incomplete (the recorder was stopped "
                            "while writing it); it was ignored"
                        )
                        break
                    raise ReplayFormatError(f"{name}:{lineno}: not valid JSON: {_json_problem(exc)}") from None
                try:
                    if header is None:
                        header = _decode_header(data)
                    else:
                        record = _decode_line(data, last_t)
                        records.append(record)
                        last_t = record.t
                except ReplayFormatError as exc:
                    raise ReplayFormatError(f"{name}:{lineno}: {exc}") from None
        except OSError as exc:
            raise ReplayFormatError(f"cannot read trace {name}: {exc.strerror or exc}") from None
    if header is None:
        what = "its only line is incomplete" if notes else "it is empty"
        raise ReplayFormatError(f"{name}: not a gpuwatch trace: {what} (no header line)")
    return Trace(source=name, header=header, records=tuple(records), notes=tuple(notes))


def _json_problem(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return "the line is not UTF-8 text"
    return str(exc)


__all__ = [
    "FORMAT",
    "VERSION",
    "READABLE_VERSIONS",
    "RECORD_TYPES",
    "FAST_FIELDS",
    "SLOW_FIELDS",
    "BackendDownRecord",
    "BackendUpRecord",
    "FastRecord",
    "GpusRecord",
    "LostRecord",
    "Record",
    "Recorder",
    "SlowRecord",
    "Trace",
    "TraceHeader",
    "TraceWriter",
    "XidRecord",
    "decode_driver",
    "decode_fast",
    "decode_gpu",
    "decode_identity",
    "decode_slow",
    "encode_driver",
    "encode_fast",
    "encode_gpu",
    "encode_identity",
    "encode_slow",
    "read_trace",
]

