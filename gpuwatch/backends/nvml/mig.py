"""The mig group's stateful call: a MIG-enabled GPU's MIG devices, enumerated and read."""

from __future__ import annotations

import threading
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.calls import Texts
from gpuwatch.backends.nvml.codes import UNSUPPORTED
from gpuwatch.backends.nvml.gpm import GpmPair
from gpuwatch.logs import get_logger


class MigDevices:
    """The MIG devices of one MIG-enabled GPU, for the mig group (``dev.call("gpuwatch.mig", metric
    ids)``). ``instances`` enumerates them (slow tier: MIG handles go invalid when an instance is
    destroyed, so they are looked up again each time) and ``readings`` reads each one (fast tier):
    its frame buffer (nvmlDeviceGetMemoryInfo on the MIG handle) and its GPM metrics over the last
    interval (nvmlGpmMigSampleGet on the parent with the GPU instance id, a sample pair per instance).
    An instance that went away since the enumeration is left out of the readings. One lock: the slow
    poll and the events thread enumerate, the fast poll reads, close() frees; a sample pair is never
    freed under a call that uses it."""

    def __init__(self, handle: Any, metric_ids: tuple[int, ...]) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self._ids = metric_ids
        self._devices: list[tuple[int, int, Any]] = []  # (gpu instance, compute instance, MIG handle)
        self._gpm: dict[int, GpmPair] = {}  # gpu instance -> its sample pair
        self.gpm = bool(metric_ids) and hasattr(N, "c_nvmlGpmMetricsGet_t")
        self.instances = self._instances
        self.readings = self._readings

    def _instances(self) -> tuple[dict[str, Any], ...]:
        with self._lock:
            return self._enumerate()

    def _enumerate(self) -> tuple[dict[str, Any], ...]:
        count = N.nvmlDeviceGetMaxMigDeviceCount(self._handle)
        found, devices = [], []
        for index in range(count):
            try:
                mig = N.nvmlDeviceGetMigDeviceHandleByIndex(self._handle, index)
            except N.NVMLError as exc:
                if exc.value == N.NVML_ERROR_NOT_FOUND:  # an empty slot
                    continue
                raise
            gi, ci = N.nvmlDeviceGetGpuInstanceId(mig), N.nvmlDeviceGetComputeInstanceId(mig)
            name = Texts().call("mig_name", N.nvmlDeviceGetName, mig)
            found.append({"gpu_instance": int(gi), "compute_instance": int(ci),
                          "mig_uuid": Texts().call("mig_uuid", N.nvmlDeviceGetUUID, mig),
                          "profile": name.rsplit("MIG ", 1)[-1] if "MIG " in name else name})
            devices.append((int(gi), int(ci), mig))
        self._devices = devices
        for gi in set(self._gpm) - {gi for gi, _, _ in devices}:  # destroyed instances
            pair = self._gpm.pop(gi, None)
            if pair is not None:
                pair.free()
        return tuple(found)

    def _readings(self) -> tuple[dict[str, Any], ...]:
        with self._lock:
            return self._read()

    def _read(self) -> tuple[dict[str, Any], ...]:
        out, seen = [], set()
        for gi, _ci, mig in self._devices:
            if gi in seen:  # a GPU instance split into several compute instances: its memory and GPM once
                continue
            seen.add(gi)
            try:
                memory = N.nvmlDeviceGetMemoryInfo(mig)
            except N.NVMLError as exc:
                if exc.value in (N.NVML_ERROR_INVALID_ARGUMENT, N.NVML_ERROR_NOT_FOUND):
                    continue  # destroyed since the enumeration: the next one drops it
                raise
            reading: dict[str, Any] = {"gpu_instance": gi, "memory_total": int(memory.total),
                                       "memory_used": int(memory.used), "metrics": None}
            if self.gpm:
                pair = self._gpm.get(gi)
                if pair is None:
                    pair = self._gpm[gi] = GpmPair(self._handle, self._ids, gi)
                try:
                    got = pair()
                except N.NVMLError as exc:
                    if exc.value not in UNSUPPORTED and exc.value != N.NVML_ERROR_NOT_FOUND:
                        raise
                    got = None
                    if exc.value in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_FUNCTION_NOT_FOUND):
                        self.gpm = False  # this driver has no per-instance GPM: stop asking
                    # INVALID_ARGUMENT, NOT_FOUND: the instance went away; the next enumeration drops it
                reading["metrics"] = None if got is None else got[0]
            out.append(reading)
        return tuple(out)

    def on_event(self, uuid: str) -> None:
        """A MIG instance was created or destroyed: enumerate the GPU's MIG devices again now, so the fast
        tier reads the new set at once (the slow tier's instance list follows at its next poll)."""
        try:
            instances = self.instances()
        except N.NVMLError as exc:
            get_logger(component="nvml").warning("mig_enumeration_failed", uuid=uuid, error=f"NVML: {exc}",
                                                 hint="the next slow poll enumerates the MIG instances again")
            return
        get_logger(component="nvml").info("mig_config_changed", uuid=uuid, instances=len(instances))

    def free(self) -> None:
        with self._lock:
            for pair in self._gpm.values():
                pair.free()
            self._gpm = {}
            self._devices = []
