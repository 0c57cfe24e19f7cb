"""ctypes layouts the funnel reads with ctypes' own attribute access (faster than pynvml's printable
structures), with pynvml's own field lists: the same ABI as its wrappers."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import pynvml as N

VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


@functools.cache
def plain(printable: Any) -> Any:
    """A plain ctypes type with the layout (``_fields_``) of one of pynvml's printable structures or
    unions, whose Python __getattribute__ runs on every attribute read. One per printable type, made once:
    a ctypes class is a graph of a dozen objects that only a full garbage collection frees, and readers
    are made again at each MIG reconfiguration and discovery (the soak saw the class count climb)."""
    base = ctypes.Union if issubclass(printable, ctypes.Union) else ctypes.Structure
    return type(f"_Plain{printable.__name__}", (base,), {"_fields_": printable._fields_})


class FieldValue(ctypes.Structure):
    """nvmlFieldValue_t, laid out as pynvml's c_nvmlFieldValue_t, read with ctypes' own attributes."""

    _fields_ = [("fieldId", ctypes.c_uint32), ("scopeId", ctypes.c_uint32), ("timestamp", ctypes.c_int64),
                ("latencyUsec", ctypes.c_int64), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", plain(N.c_nvmlValue_t))]
