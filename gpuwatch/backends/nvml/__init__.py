"""The NVML backend: the only package that imports pynvml (nvidia-ml-py), and the one funnel for every NVML call.

The reading groups (gpuwatch/groups/) say what to probe and read, by the NVML functions' C names;
this package resolves them, runs them and maps NVML errors to outcomes:

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
here (``calls.Texts``): bytes that are not UTF-8 become U+FFFD and are counted, never an exception.

The modules:

- ``backend``: NvmlBackend (the Backend protocol): lifecycle, discovery, the polls, the events;
- ``funnel``: what the groups see of it: ``Probe`` (groups.base.Device, at discovery) and ``Query``
  (groups.base.Query, during a poll), and the choice of a stateful call;
- ``calls``, ``structs``, ``codes``: how NVML is called, the ctypes layouts, the return codes;
- one module per stateful call a group makes (state kept between polls): ``gpm`` (a GPU's GPM
  sample pair), ``mig`` (a MIG-enabled GPU's MIG devices), ``fabric`` (the fabric structure's version).
"""

from gpuwatch.backends.nvml.backend import NvmlBackend
from gpuwatch.backends.nvml.codes import ERROR_NAMES

__all__ = ["ERROR_NAMES", "NvmlBackend"]
