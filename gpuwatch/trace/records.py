"""The records of a trace: one dataclass per ``type``, and how a JSON line becomes one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.errors import ReplayFormatError
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample
from gpuwatch.trace.codec import (
    FLOAT,
    INT,
    STR,
    Codec,
    bad,
    decode_driver,
    decode_fast,
    decode_gpu,
    decode_slow,
)

FORMAT = "gpuwatch-trace"
#: The format version this package writes.
VERSION = 1
#: Format versions this package reads.
READABLE_VERSIONS: tuple[int, ...] = (1,)
TIERS = ("fast", "slow")


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


Record = GpusRecord | FastRecord | SlowRecord | LostRecord | XidRecord | BackendDownRecord | BackendUpRecord

RECORD_TYPES: tuple[str, ...] = ("gpus", "fast", "slow", "lost", "xid", "backend_down", "backend_up")


def need(data: Mapping[str, Any], name: str, codec: Codec) -> Any:
    if data.get(name) is None:
        raise ReplayFormatError(f"missing field {name!r}")
    return codec.decode(data[name], name)


def _optional(data: Mapping[str, Any], name: str, codec: Codec) -> Any:
    return None if data.get(name) is None else codec.decode(data[name], name)


def decode_record(data: Mapping[str, Any], t: float) -> Record:
    kind = data["type"]
    if kind == "gpus":
        gpus = data.get("gpus")
        if not isinstance(gpus, list):
            raise bad("gpus", "a list of GPU objects", gpus)
        decoded = []
        for i, gpu in enumerate(gpus):
            try:
                decoded.append(decode_gpu(gpu))
            except ReplayFormatError as exc:
                raise ReplayFormatError(f"gpus[{i}]: {exc}") from None
        return GpusRecord(t, tuple(decoded))
    if kind == "fast":
        return FastRecord(t, need(data, "uuid", STR), decode_fast(data))
    if kind == "slow":
        return SlowRecord(t, need(data, "uuid", STR), decode_slow(data))
    if kind == "lost":
        tier = _optional(data, "tier", STR)
        return LostRecord(t, need(data, "uuid", STR), tier, _optional(data, "message", STR))
    if kind == "xid":
        return XidRecord(t, need(data, "uuid", STR), need(data, "xid", INT), _optional(data, "timestamp", FLOAT))
    if kind == "backend_down":
        return BackendDownRecord(
            t, need(data, "reason", STR), _optional(data, "message", STR) or "", _optional(data, "hint", STR) or ""
        )
    if kind == "backend_up":
        if data.get("driver") is None:
            raise ReplayFormatError("missing field 'driver'")
        return BackendUpRecord(t, decode_driver(data["driver"]))
    raise ReplayFormatError(
        f"unknown record type {kind!r}; version {VERSION} has: {', '.join(RECORD_TYPES)}"
    )
