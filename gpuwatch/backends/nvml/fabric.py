"""The fabric group's stateful call: nvmlDeviceGetGpuFabricInfoV with the newest structure the driver
takes (v3, the health summary, then v2), and the unversioned call of older drivers."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.codes import ERROR_NAMES
from gpuwatch.backends.nvml.structs import plain

_VERSION_MISMATCH = getattr(N, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25)
# nvmlDeviceGetGpuFabricInfoV's structures, newest first: v3 (R570+) adds the health summary; a driver
# that does not know a version answers ARGUMENT_VERSION_MISMATCH and is asked the next one
FABRIC_VERSIONS: tuple[tuple[str, str], ...] = tuple(
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


class FabricInfoV:
    """nvmlDeviceGetGpuFabricInfoV with the newest structure the driver takes: v3 (the health summary)
    first; ARGUMENT_VERSION_MISMATCH (a driver before R570) -> v2 from then on. pynvml's wrapper passes
    the caller's structure as is, so it is built here (once) and passed by reference."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._fn: Any = None
        self._versions = [(plain(getattr(N, struct))(), getattr(N, version)) for struct, version in FABRIC_VERSIONS]

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


def fabric_info(handle: Any) -> dict[str, Any]:
    """The unversioned nvmlDeviceGetGpuFabricInfo (drivers without the versioned call: no health)."""
    info = plain(N.c_nvmlGpuFabricInfo_t)()
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetGpuFabricInfo")
    N._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
    return _fabric_answer(info, versioned=False)
