"""Traces: what a backend reported, recorded as versioned JSON lines, read back for replay.

The format (docs/trace-format.md) is one JSON object per line: a header, then records in time order,
each with ``t`` (seconds since the recording started) and a ``type``. Samples are stored flat, field
by field, in the units of model.py; ``None`` readings and empty mappings are left out, so "absent" in
the file means exactly "not supported" in the sample.

- ``encode_*``/``decode_*`` turn model objects into JSON-ready dicts and back; the round trip is exact.
- ``TraceWriter`` writes a trace, one flushed line per record, so a killed recorder leaves a readable
  prefix.
- ``Recorder`` (gpuwatch/backends/recorder.py) wraps any Backend and writes what came back here.
- ``read_trace`` reads and validates a whole file; every problem is a ReplayFormatError naming the
  file, the line and what is wrong. A last line cut short (recorder killed mid-write) is dropped,
  with a note in ``Trace.notes``.
"""

from __future__ import annotations

from gpuwatch.trace.codec import (
    FAST_FIELDS,
    KEY_SEPARATOR,
    SLOW_FIELDS,
    decode_driver,
    decode_fast,
    decode_gpu,
    decode_identity,
    decode_slow,
    encode_driver,
    encode_fast,
    encode_gpu,
    encode_identity,
    encode_slow,
)
from gpuwatch.trace.reader import Trace, TraceHeader, read_trace
from gpuwatch.trace.records import (
    FORMAT,
    READABLE_VERSIONS,
    RECORD_TYPES,
    VERSION,
    BackendDownRecord,
    BackendUpRecord,
    FastRecord,
    GpusRecord,
    LostRecord,
    Record,
    SlowRecord,
    XidRecord,
)
from gpuwatch.trace.writer import TraceWriter

__all__ = [
    "FORMAT", "VERSION", "READABLE_VERSIONS", "RECORD_TYPES", "FAST_FIELDS", "SLOW_FIELDS", "KEY_SEPARATOR",
    "BackendDownRecord", "BackendUpRecord", "FastRecord", "GpusRecord", "LostRecord", "Record", "SlowRecord",
    "Trace", "TraceHeader", "TraceWriter", "XidRecord", "decode_driver", "decode_fast", "decode_gpu",
    "decode_identity", "decode_slow", "encode_driver", "encode_fast", "encode_gpu", "encode_identity",
    "encode_slow", "read_trace",
]
