"""read_trace: a whole trace file read and validated; every problem names the file, the line and what is wrong."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from gpuwatch import __version__
from gpuwatch.errors import ReplayFormatError
from gpuwatch.model import DriverInfo
from gpuwatch.trace.codec import FLOAT, STR, bad, decode_driver, decode_float, describe
from gpuwatch.trace.records import FORMAT, READABLE_VERSIONS, RECORD_TYPES, Record, decode_record, need


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


# a "\\uD800".."\\uDFFF" escape: JSON's way to spell a lone surrogate (a pair is one character, and fine)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_line(raw: bytes) -> Any:
    try:
        # UTF-8 only, strictly: json.loads(bytes) also takes UTF-16 and decodes surrogates encoded as UTF-8
        data = json.loads(raw.decode("utf-8-sig"), parse_constant=_reject_constant)  # a BOM, as json.loads(bytes)
    except RecursionError:  # "[[[[…": json's recursion is not a ValueError; a trace's lines nest a few levels
        raise ValueError("it nests too deeply") from None
    if _SURROGATE.search(raw):  # a lone surrogate in a name or a key was a label no /metrics render could encode
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string in it is not UTF-8 text (a lone surrogate escape such as \"\\udcff\")") from None
        except RecursionError:
            raise ValueError("it nests too deeply") from None
    return data


def _decode_header(data: Any) -> TraceHeader:
    hint = 'the first line must be the header {"type": "header", "format": "gpuwatch-trace", "version": 1, ...}'
    if not isinstance(data, dict) or data.get("type") != "header":
        raise ReplayFormatError(f"missing header: {hint}")
    if data.get("format") != FORMAT:
        raise ReplayFormatError(f"not a gpuwatch trace: format is {describe(data.get('format'))}, expected {FORMAT!r}")
    version = data.get("version")
    readable = ", ".join(str(v) for v in READABLE_VERSIONS)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ReplayFormatError(f"invalid trace format version {describe(version)}: expected a whole number >= 1")
    if version not in READABLE_VERSIONS:
        raise ReplayFormatError(
            f"trace format version {version} is newer than this gpuwatch ({__version__}) can read "
            f"(it reads version {readable}): replay it with a newer gpuwatch"
        )
    driver = None if data.get("driver") is None else decode_driver(data["driver"])
    intervals = {}
    for name in ("fast_interval", "slow_interval"):
        value = need(data, name, FLOAT)
        if value <= 0:
            raise bad(name, "a positive number of seconds", value)
        intervals[name] = value
    return TraceHeader(
        version=version,
        created=need(data, "created", FLOAT),
        backend=need(data, "backend", STR),
        driver=driver,
        **intervals,
    )


def _decode_line(data: Any, last_t: float) -> Record:
    if not isinstance(data, dict):
        raise ReplayFormatError(f"expected a JSON object, got {describe(data)}")
    kind = data.get("type")
    if kind == "header":
        raise ReplayFormatError("a second header: a trace has one header, on its first line")
    if not isinstance(kind, str):
        raise ReplayFormatError(f"missing or invalid 'type' (one of {', '.join(RECORD_TYPES)})")
    if "t" not in data:
        raise ReplayFormatError("missing field 't' (seconds since the recording started)")
    t = decode_float(data["t"], "t")
    if t < 0:
        raise bad("t", "seconds >= 0", data["t"])
    if t < last_t:
        raise ReplayFormatError(f"records are not in time order: t={t:g} after t={last_t:g}")
    return decode_record(data, t)


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
