"""The gpm group's stateful call: a GPU's (or a GPU instance's) two GPM samples and one metrics request."""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.structs import plain


@functools.cache
def _metrics_get_type() -> Any:
    """nvmlGpmMetricsGet_t with plain metrics (structs.plain), made once: a sampler is made per GPU and per
    MIG GPU instance, again at each reconfiguration."""
    metric = plain(N.c_nvmlGpmMetric_t)
    fields = [(name, kind) for name, kind in N.c_nvmlGpmMetricsGet_t._fields_ if name != "metrics"]
    request = type("_GpmMetricsGet", (ctypes.Structure,),
                   {"_fields_": [*fields, ("metrics", metric * N.NVML_GPM_METRIC_MAX)]})
    assert ctypes.sizeof(request) == ctypes.sizeof(N.c_nvmlGpmMetricsGet_t)
    return request


_threads = threading.local()


def _request_for(ids: tuple[int, ...]) -> tuple[Any, Any, int]:
    """This thread's metrics request for ``ids``: (the request, its state before a call, the bytes of it
    that a call uses). NVML's request holds room for every GPM metric (9.4 kB); one per thread and metric
    set instead of one per GPU and GPU instance (1.2 MB at 64 GPUs): a sampler fills it, calls, and reads
    it back before its thread makes another call."""
    kept: dict[tuple[int, ...], tuple[Any, Any, int]] | None = getattr(_threads, "requests", None)
    if kept is None:
        kept = _threads.requests = {}
    entry = kept.get(ids)
    if entry is None:
        kind = _metrics_get_type()
        pristine = kind()
        pristine.version = N.NVML_GPM_METRICS_GET_VERSION
        pristine.numMetrics = len(ids)
        for slot, mid in zip(pristine.metrics, ids):
            slot.metricId = mid
            slot.nvmlReturn = N.NVML_ERROR_UNKNOWN  # until the call answers for it
        used = kind.metrics.offset + len(ids) * ctypes.sizeof(pristine.metrics._type_)
        entry = kept[ids] = (kind(), pristine, used)
    return entry

class GpmPair:
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
        request, pristine, used = _request_for(self._ids)
        ctypes.memmove(ctypes.addressof(request), ctypes.addressof(pristine), used)
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
