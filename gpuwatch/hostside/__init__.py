"""The host side: who holds the GPUs and what their jobs do on the CPUs (the host groups).

``HostReader`` is what the poller's host job calls every slow interval, on its own thread: one
cgroup scan (gpuwatch/hostside/cgroups.py) shared by the slurm and jobs groups, the kubelet's
PodResources for the kubernetes group, the Grace hwmon sensors for the grace group. A source that
fails gives its group no reading for this read (its metrics go absent, ``gpuwatch_collector_success
{group}`` 0, the error counted in ``gpuwatch_collector_errors_total`` and logged once per kind); the
other groups go on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.groups import HostSample, Selection
from gpuwatch.groups.kubernetes import PodAllocation
from gpuwatch.hostside import cgroups
from gpuwatch.logs import get_logger
from gpuwatch.model import GpuState

if TYPE_CHECKING:
    from gpuwatch.hostside.kubelet import PodResourcesClient


class KubeletPods:
    """The kubernetes group's reader: the kubelet's allocations mapped to GPUs and MIG instances."""

    def __init__(self, socket_path: str, timeout: float, errors: list[tuple[str, str]]) -> None:
        from gpuwatch.hostside.kubelet import PodResourcesClient

        # grpcio is imported by the first call that finds the kubelet's socket: never on a node without one
        self._client: PodResourcesClient | None = PodResourcesClient(socket_path, timeout)
        self._errors = errors
        self._failing: str | None = None
        self._unknown_logged: set[str] = set()
        self._log = get_logger(component="kubernetes")

    def read(self, gpus: Sequence[GpuState]) -> tuple[tuple[PodAllocation, ...], bool] | None:
        """(allocations, complete): complete unless an nvidia.com device id named no GPU or MIG device
        gpuwatch knows (then a GPU without a pod is unknown, not free); None: no kubelet to ask."""
        if self._client is None:
            return None
        from gpuwatch.hostside.kubelet import KubeletUnavailable

        try:
            devices = self._client.list_devices()
        except KubeletUnavailable as exc:
            if exc.reason == "no_grpcio":  # not installed (or too old): for good, not an error of the kubelet
                self._log.info("kubernetes_off", reason=exc.reason, error_detail=str(exc), hint=exc.hint)
                self._client = None
                return None
            if exc.reason != "no_socket":  # no kubelet on this node is a fact, not an error
                self._errors.append(("kubernetes", f"kubelet_{exc.reason}"))
            if self._failing != exc.reason:
                self._failing = exc.reason
                level = self._log.info if exc.reason == "no_socket" else self._log.warning
                level("kubernetes_off" if exc.reason == "no_socket" else "kubelet_unavailable",
                      reason=exc.reason, error_detail=str(exc), hint=exc.hint)
            return None
        if self._failing is not None:
            self._log.info("kubelet_recovered", failed=self._failing)
            self._failing = None
        owners: dict[str, tuple[str, int | None]] = {}
        for g in gpus:
            owners[g.identity.uuid] = (g.identity.uuid, None)
            owners[str(g.identity.index)] = (g.identity.uuid, None)  # the device plugin's index id strategy
            for m in g.slow.mig if g.slow is not None else ():
                if m.mig_uuid:
                    owners[m.mig_uuid] = (g.identity.uuid, m.gpu_instance)
        found = []
        complete = True
        for d in devices:
            owner = owners.get(d.device_id)
            if owner is not None:
                found.append(PodAllocation(owner[0], d.namespace, d.pod, d.container, owner[1]))
            else:
                complete = False
                shown_id = d.device_id[:200]  # kept as logged: a 10 MB id that changes each read held 640 MB here
                if shown_id not in self._unknown_logged and len(self._unknown_logged) < 64:
                    self._unknown_logged.add(shown_id)
                    self._log.warning("kubelet_device_unknown", device_id=shown_id, resource=d.resource[:200],
                                      hint="a device the kubelet allocated names no GPU gpuwatch knows (a MIG "
                                           "device with --no-collector.mig?): GPUs without a pod read as unknown")
        return tuple(dict.fromkeys(found)), complete

    def close(self) -> None:
        client = self._client  # read() may drop it on the host job's thread meanwhile
        if client is not None:
            client.close()


class HostReader:
    """Reads the selected host groups: ``reader(gpus) -> HostSample``."""

    def __init__(self, selection: Selection, proc_root: str = "/proc",
                 cgroup_root: str = "/sys/fs/cgroup", mapping_dir: str | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._errors: list[tuple[str, str]] = []
        self._root = Path(cgroup_root)
        self._log = get_logger(component="hostside")
        self._slurm = self._kubelet = self._jobs = self._grace = None
        enabled = selection.enabled
        if "slurm" in enabled:
            from gpuwatch.hostside.slurm_allocations import SlurmAllocations

            self._slurm = SlurmAllocations(selection.options_of("slurm"), mapping_dir, monotonic, self._errors)
        if "kubernetes" in enabled:
            kube = selection.options_of("kubernetes")
            self._kubelet = KubeletPods(str(kube["socket"]), float(kube["timeout"]), self._errors)
        if "jobs" in enabled:
            from gpuwatch.hostside.jobs import JobsReader

            self._jobs = JobsReader(proc_root, monotonic, float(os.cpu_count() or 0) or None, self._errors)
        if "grace" in enabled:
            from gpuwatch.hostside.grace import GraceHwmon

            self._grace = GraceHwmon(str(selection.option("grace", "hwmon-root")), monotonic, self._errors)
        self._failed: set[str] = set()

    def __call__(self, gpus: Sequence[GpuState]) -> HostSample:
        self._errors.clear()
        collected: list[tuple[str, float, bool]] = []
        values: dict[str, Any] = {}
        found: cgroups.Scan | None = None
        scan_seconds = 0.0
        if self._slurm is not None or self._jobs is not None:
            started = time.perf_counter()
            found = self._run("cgroups", lambda: cgroups.scan(self._root))
            scan_seconds = time.perf_counter() - started
        sources = (("slurm", self._slurm), ("kubernetes", self._kubelet), ("jobs", self._jobs), ("grace", self._grace))
        for name, source in sources:
            if source is None:
                continue
            started = time.perf_counter()
            errors_before = len(self._errors)
            if name == "kubernetes":
                value = self._run(name, lambda: self._kubelet.read(gpus))  # type: ignore[union-attr]
            elif name == "grace":
                value = self._run(name, lambda: self._grace.read())  # type: ignore[union-attr]
            elif found is None:
                value = None
            elif name == "slurm":
                value = self._run(name, lambda: self._slurm.read(found, gpus))  # type: ignore[union-attr]
            else:
                value = self._run(name, lambda: self._jobs.read(found))  # type: ignore[union-attr]
            scanned = name in ("slurm", "jobs")
            seconds = time.perf_counter() - started + (scan_seconds if scanned else 0.0)
            values[name] = value
            ok = len(self._errors) == errors_before and not (scanned and found is None)
            if value is not None or not ok:  # nothing to read here (no Slurm, no kubelet, no Grace): no series
                collected.append((name, seconds, ok))
        slurm = values.get("slurm")
        pods = values.get("kubernetes")
        return HostSample(slurm=None if slurm is None else slurm[0], kubernetes=None if pods is None else pods[0],
                          jobs=values.get("jobs"), grace=values.get("grace"), errors=tuple(self._errors),
                          collected=tuple(collected),
                          slurm_complete=slurm is None or slurm[1], kubernetes_complete=pods is None or pods[1],
                          gpus=tuple(g.identity.uuid for g in gpus))

    def _run(self, name: str, read: Callable[[], Any]) -> Any:
        """One source's read; a bug in it costs that group this read, logged once until it works again."""
        try:
            value = read()
        except Exception as exc:
            for group in (("slurm", "jobs") if name == "cgroups" else (name,)):
                self._errors.append((group, "internal"))
            if name not in self._failed:
                self._failed.add(name)
                self._log.error("host_source_failed", source=name, error=f"{type(exc).__name__}: {exc}",
                                hint="a gpuwatch bug: please report it with this log line", exc_info=True)
            return None
        self._failed.discard(name)
        return value

    def close(self) -> None:
        if self._kubelet is not None:
            self._kubelet.close()
