"""NvmlBackend: discovery, the polls, the events, the lifecycle (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.calls import Batch, Texts, handle_key
from gpuwatch.backends.nvml.codes import BACKEND_GONE, LOST, UNSUPPORTED, follow_copied_symlink, is_gone, unavailable
from gpuwatch.backends.nvml.funnel import Probe, Query
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.groups import Selection, fieldids
from gpuwatch.logs import get_logger
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, GpuIdentity, SlowSample, XidEvent

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}
_NO_SHARES: Mapping[str, float] = {}


def _layout(kind: type[Any]) -> tuple[dict[str, int], tuple[Any, ...]]:
    """A sample type's field -> position, and its fields' defaults in order; its last two fields must be
    ``errors`` and ``collected`` (what _read sets last), every field a plain default (shared: immutable)."""
    fields = dataclasses.fields(kind)
    names = [f.name for f in fields]
    if names[-2:] != ["errors", "collected"] or any(f.default is dataclasses.MISSING for f in fields):
        raise TypeError(f"{kind.__name__}: the NVML backend builds it positionally from plain defaults, "
                        "errors and collected last")
    return {name: i for i, name in enumerate(names)}, tuple(f.default for f in fields)


_FIELD_INDEX: dict[type[Any], dict[str, int]] = {}
_DEFAULTS: dict[type[Any], tuple[Any, ...]] = {}
for _kind in (FastSample, SlowSample):
    _FIELD_INDEX[_kind], _DEFAULTS[_kind] = _layout(_kind)


@dataclass
class _Gpu:
    """A GPU's handle and what its enabled groups probed at discovery."""

    handle: Any
    identity: GpuIdentity
    features: dict[str, bool] = field(default_factory=dict)
    batches: dict[str, Batch] = field(default_factory=dict)  # tier -> its field-values call
    # tier -> (group, its attribute's position in the tier's sample, the reader's bound read_fast/read_slow, the
    # group's share of the batch's time)
    reads: dict[str, tuple[tuple[str, int, Callable[[Any], Any], float], ...]] = field(default_factory=dict)
    # the NVML events its groups asked for: (event type mask, the feature a refused registration turns off, the
    # handler of a stateful call or None: delivered by wait_events); what could not be registered is dropped
    events: tuple[tuple[int, str | None, Callable[[str], None] | None], ...] = ()
    cleanups: list[Callable[[], None]] = field(default_factory=list)  # run before NVML shuts down
    lost_while_probing: bool = False  # GPU_IS_LOST at discovery: down until the next discovery
    implausible: set[str] = field(default_factory=set)  # readings logged as implausible (Query.plausible)
    index: str = ""  # the GPU's NVML index as a label value, for Query's log lines


class NvmlBackend:
    name = "nvml"

    def __init__(self, selection: Selection | None = None) -> None:
        selection = selection or Selection.of()
        self._groups = tuple(g for g in selection.groups if g.nvml is not None)  # a group not selected: no call
        self._options = selection.options
        self._numbering = fieldids.DEFAULT
        self._field_ids = self._resolve_fields()
        self._devices: dict[str, _Gpu] = {}
        self._by_handle: dict[int | None, str] = {}
        self._event_set: Any = None
        # guards the event set and the count of threads inside nvmlEventSetWait (a wait is not under it: it may
        # last EVENT_WAIT_SECONDS, and neither a stop nor a discovery waits for it)
        self._events_lock = threading.Lock()
        self._waiting = 0
        # what a close() under a wait left to it: the event sets to free and the nvmlShutdown calls it owes
        self._left_to_waiter: list[Any] = []
        self._shutdowns_owed = 0
        self._registered = threading.Event()  # an event set exists: a wait without one waits for it
        self._open = False
        self._failed_groups: set[tuple[str, str]] = set()  # (uuid, group) whose read raised, logged once

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self) -> DriverInfo:
        try:
            try:
                N.nvmlInit()
            except N.NVMLError as exc:
                if exc.value != N.NVML_ERROR_LIBRARY_NOT_FOUND or not follow_copied_symlink():
                    raise
                N.nvmlInit()
        except N.NVMLError as exc:
            raise unavailable(exc) from None
        self._open = True
        texts = Texts()
        try:
            driver = texts.call("driver_version", N.nvmlSystemGetDriverVersion)
            nvml = texts.call("nvml_version", N.nvmlSystemGetNVMLVersion)
            try:
                cuda_int = N.nvmlSystemGetCudaDriverVersion()
                cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
            except N.NVMLError:
                cuda = ""
        except N.NVMLError as exc:
            self.close()
            raise unavailable(exc) from None
        if texts.invalid:
            get_logger(component="nvml").warning("nvml_invalid_text", texts=texts.invalid,
                                                 hint="the driver reported text that is not UTF-8; shown with U+FFFD")
        self._numbering = fieldids.numbering(driver)
        self._field_ids = self._resolve_fields()
        if not self._numbering.known:
            get_logger(component="nvml").warning(
                "nvml_field_numbering_unknown", driver_version=driver, branch=self._numbering.branch,
                hint=f"this driver is newer than gpuwatch's table of NVML field ids (up to R{fieldids.NEWEST_KNOWN}): "
                     "the newest numbering is assumed and every moved field is checked before it is read; "
                     "a field that does not fit is left out and logged (upgrade gpuwatch for this branch)")
        return DriverInfo(driver_version=driver, nvml_version=nvml, cuda_driver_version=cuda,
                          errors=("invalid_utf8",) * len(texts.invalid))

    def _resolve_fields(self) -> dict[int, str]:
        """The enabled groups' field ids under this driver's numbering (groups name the ids that moved)."""
        ids: dict[int, str] = {}
        for g in self._groups:
            for key in g.fields:
                fid = self._numbering.id(key) if isinstance(key, str) else key
                if fid is not None:
                    ids[fid] = g.name
        return ids

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        with self._events_lock:
            event_set, self._event_set = self._event_set, None
            self._registered.clear()
            self._free_devices()
            self._by_handle = {}
            if self._waiting:
                # NVML is never shut down under a thread inside nvmlEventSetWait (nvml.md §12), nor the set it
                # waits on freed: both are left to the wait, which frees the set and shuts NVML down once it
                # returns (within EVENT_WAIT_SECONDS, or never in a wedged driver; a stop does not wait for it).
                # NVML counts its initialisations, so an open() in between keeps its own. Without this a
                # re-initialisation under a wait leaked the set and what it holds (descriptors) for good.
                if event_set is not None:
                    self._left_to_waiter.append(event_set)
                self._shutdowns_owed += 1
                return
            _release([event_set] if event_set is not None else [], 1)

    def _free_devices(self) -> None:
        """Free what the groups' calls hold in NVML (GPM samples); errors do not matter here."""
        devices, self._devices = self._devices, {}
        for gpu in devices.values():
            for cleanup in gpu.cleanups:
                try:
                    cleanup()
                except N.NVMLError:
                    pass

    # -- discovery ------------------------------------------------------------------------------
    def discover(self) -> list[DiscoveredGpu]:
        try:
            count = N.nvmlDeviceGetCount()
        except N.NVMLError as exc:
            raise unavailable(exc) from None
        found: list[DiscoveredGpu] = []
        devices: dict[str, _Gpu] = {}
        self._free_devices()
        for index in range(count):
            texts = Texts()
            try:
                handle = N.nvmlDeviceGetHandleByIndex(index)
                identity = self._identity(handle, index, texts)
            except N.NVMLError as exc:
                if is_gone(exc.value) and exc.value != LOST:
                    raise unavailable(exc) from None
                # The GPU cannot even be identified (lost, no permission): gpuwatch_gpus says how many are seen.
                get_logger(component="nvml").error(
                    "gpu_unidentifiable", gpu=str(index), error=f"NVML: {exc}",
                    hint="the driver counts this GPU but cannot open it: check `nvidia-smi` and `dmesg`")
                continue
            gpu = _Gpu(handle=handle, identity=identity, index=str(identity.index))
            try:
                self._probe(gpu)
            except N.NVMLError as exc:
                if is_gone(exc.value) and exc.value != LOST:
                    raise unavailable(exc) from None
                # lost while probing: no reading is prepared, so no poll would ever call NVML for it and
                # it would show up with no readings; every read reports it lost instead
                gpu.features, gpu.batches, gpu.reads = {}, {}, {}
                gpu.lost_while_probing = True
            devices[identity.uuid] = gpu
            errors: tuple[str, ...] = ()
            if texts.invalid:
                errors = ("invalid_utf8",) * len(texts.invalid)
                get_logger(component="nvml").warning(
                    "nvml_invalid_text", gpu=str(index), uuid=identity.uuid, texts=texts.invalid,
                    hint="the GPU reported text that is not UTF-8 (a corrupted InfoROM?); it is shown with U+FFFD "
                         "and the GPU is monitored as usual; check `nvidia-smi -q -i " + str(index) + "`")
            found.append(DiscoveredGpu(identity=identity, features={}, errors=errors))
        self._devices = devices
        self._by_handle = {handle_key(d.handle): uuid for uuid, d in devices.items()}
        self._register_events()  # a registration the GPU refuses turns its feature off: features after it
        return [dataclasses.replace(d, features=dict(devices[d.identity.uuid].features)) for d in found]

    @staticmethod
    def _identity(handle: Any, index: int, texts: Texts) -> GpuIdentity:
        def optional(fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except N.NVMLError as exc:
                if exc.value == LOST or exc.value in BACKEND_GONE:
                    raise
                return None

        arch = optional(lambda: N.nvmlDeviceGetArchitecture(handle))
        minor = optional(lambda: N.nvmlDeviceGetMinorNumber(handle))
        return GpuIdentity(
            index=index,
            uuid=texts.call("uuid", N.nvmlDeviceGetUUID, handle),
            name=texts.call("name", N.nvmlDeviceGetName, handle),
            pci_bus_id=texts.field("pci_bus_id", N.nvmlDeviceGetPciInfo(handle), "busId"),
            serial=optional(lambda: texts.call("serial", N.nvmlDeviceGetSerial, handle)),
            minor_number=minor,
            vbios_version=optional(lambda: texts.call("vbios_version", N.nvmlDeviceGetVbiosVersion, handle)),
            architecture=None if arch is None else _ARCHITECTURES.get(arch, "unknown"),
        )

    def _probe(self, gpu: _Gpu) -> None:
        """Probe the enabled groups once: the fields of all of them in one call, then each group."""
        dev = Probe(gpu.handle, self._probe_fields(gpu.handle), self._options, self._numbering,
                     gpu.identity)
        gpu.cleanups = dev.cleanups  # freed with the GPU even when it is lost while probing
        fast, slow = [], []
        for group in self._groups:
            dev.group = group.name
            reader = group.nvml(dev)  # type: ignore[misc]
            if group.fast is not None and not getattr(reader, "idle_fast", False):  # NvmlReader's docstring
                fast.append((group.name, group.fast, reader))
            if group.slow is not None:
                slow.append((group.name, group.slow, reader))
        gpu.features = dev.features
        gpu.events = tuple(dev.event_requests)
        gpu.batches = {tier: Batch(owners) for tier, owners in dev.used.items() if owners}
        shares = {tier: batch.shares for tier, batch in gpu.batches.items()}
        gpu.reads = {
            "fast": tuple((name, _FIELD_INDEX[FastSample][attr], reader.read_fast,
                           shares.get("fast", _NO_SHARES).get(name, 0.0)) for name, attr, reader in fast),
            "slow": tuple((name, _FIELD_INDEX[SlowSample][attr], reader.read_slow,
                           shares.get("slow", _NO_SHARES).get(name, 0.0)) for name, attr, reader in slow)}

    def _probe_fields(self, handle: Any) -> dict[int, int | None]:
        """The enabled groups' field ids this GPU answers (one call), with the value type each answered in."""
        ids = list(self._field_ids)
        if not ids:
            return {}
        try:
            values = Batch(self._field_ids).run(handle)
        except N.NVMLError as exc:
            if exc.value in UNSUPPORTED:
                return {}
            if is_gone(exc.value):
                raise
            return dict.fromkeys(ids)  # transient: keep them all, errors are counted when polled
        return {int(v.fieldId): int(v.valueType) for v in values if v.nvmlReturn == N.NVML_SUCCESS}

    def _register_events(self) -> None:
        """Register the events the groups asked for in one event set; a registration the GPU refuses is
        dropped (and turns the feature the group named off): the others, on that GPU too, stay."""
        if not any(d.events for d in self._devices.values()):
            return
        with self._events_lock:
            try:
                if self._event_set is None:
                    self._event_set = N.nvmlEventSetCreate()
                    self._registered.set()
                for d in self._devices.values():
                    kept = []
                    for mask, refused, handler in d.events:
                        try:
                            N.nvmlDeviceRegisterEvents(d.handle, mask, self._event_set)
                            kept.append((mask, refused, handler))
                        except N.NVMLError:
                            if refused is not None:
                                d.features[refused] = False
                    d.events = tuple(kept)
            except N.NVMLError:
                self._event_set = None
                self._registered.clear()

    # -- polls ----------------------------------------------------------------------------------
    def _device(self, uuid: str) -> _Gpu:
        try:
            return self._devices[uuid]
        except KeyError:
            raise BackendUnavailable("uninitialized", "NVML backend is not initialised",
                                     "gpuwatch re-initialises it by itself") from None

    def _read(self, uuid: str, tier: str, kind: type[Any]) -> Any:
        """The tier's sample of the GPU (``kind``: FastSample or SlowSample), built positionally from its
        defaults (the groups that are not read keep theirs): it is built for every GPU at every poll."""
        gpu = self._device(uuid)
        if gpu.lost_while_probing:
            raise DeviceLost(uuid, "NVML: GPU is lost (it was lost while gpuwatch probed it at discovery)")
        q = Query(uuid, gpu.implausible, gpu.index)
        clock = time.perf_counter
        batch_seconds = 0.0
        batch = gpu.batches.get(tier)
        started = clock()
        if batch is not None:
            q.load(batch, gpu.handle)
            now = clock()
            batch_seconds, started = now - started, now
        values = list(_DEFAULTS[kind])
        collected = []
        errors, field_errors = q.errors, q.field_errors
        # each group's time runs from the previous group's end (one clock read per group), plus its share of the batch
        for name, index, read, share in gpu.reads.get(tier, ()):
            before = len(errors)
            try:
                values[index] = read(q)
            except (DeviceLost, BackendUnavailable):
                raise
            except Exception as exc:  # a bug, or an answer the group did not expect: that group, that GPU only
                errors.append("internal")
                self._group_failed(uuid, name, exc)
            now = clock()
            collected.append((name, now - started + batch_seconds * share,
                              len(errors) == before and not field_errors.get(name)))
            started = now
        values[-2], values[-1] = tuple(errors), tuple(collected)  # the samples' last fields: errors, collected
        return kind(*values)

    def _group_failed(self, uuid: str, group: str, exc: Exception) -> None:
        """Log a group's read that raised, once per GPU and group (a value it cannot take repeats every poll)."""
        if (uuid, group) in self._failed_groups:
            return
        self._failed_groups.add((uuid, group))
        get_logger(component="nvml").error(
            "group_read_failed", uuid=uuid, group=group, error=f"{type(exc).__name__}: {exc}",
            hint="a gpuwatch bug or an NVML answer it cannot read: please report it with `nvidia-smi -q`; the "
                 "group's reading on this GPU is left out (gpuwatch_collector_success 0), everything else goes on")

    def read_fast(self, uuid: str) -> FastSample:
        return self._read(uuid, "fast", FastSample)

    def read_slow(self, uuid: str) -> SlowSample:
        return self._read(uuid, "slow", SlowSample)

    # -- events ---------------------------------------------------------------------------------
    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        if not self._open:
            raise BackendUnavailable("uninitialized", "NVML backend is not initialised", "")
        with self._events_lock:
            event_set = self._event_set
            if event_set is not None:
                self._waiting += 1
        if event_set is None:  # no GPU delivers events (yet): until a discovery registers some
            self._registered.wait(timeout_seconds)
            return []
        try:
            events: list[XidEvent] = []
            wait_ms = max(0, int(timeout_seconds * 1000))
            while True:
                try:
                    data = N.nvmlEventSetWait_v2(event_set, wait_ms)
                except N.NVMLError as exc:
                    if exc.value == N.NVML_ERROR_TIMEOUT:
                        return events
                    if exc.value in BACKEND_GONE:
                        raise unavailable(exc) from None
                    return events  # e.g. GPU_IS_LOST on the event's device: the polls report it
                wait_ms = 0  # drain what is queued, then return
                if event_set is not self._event_set:
                    # closed under the wait: what the set still holds is not delivered; a re-opened backend's
                    # new set has the same events from its registration on (delivered twice, otherwise)
                    return events
                uuid = self._by_handle.get(handle_key(data.device))
                gpu = self._devices.get(uuid) if uuid is not None else None
                if gpu is None:
                    continue
                delivered = False
                for mask, _, handler in gpu.events:
                    if not data.eventType & mask:
                        continue
                    if handler is not None:  # a stateful call's own (a MIG reconfiguration: enumerate now)
                        try:
                            handler(gpu.identity.uuid)
                        except Exception as exc:  # the events drained so far are kept; the polls go on
                            self._group_failed(gpu.identity.uuid, "events", exc)
                    elif not delivered:
                        delivered = True
                        events.append(XidEvent(uuid=gpu.identity.uuid, xid=int(data.eventData), timestamp=time.time()))
        finally:
            self._wait_ended()

    def _wait_ended(self) -> None:
        """Once no wait is in progress, free the event sets that close() left to the waits and shut NVML down
        as often as it owed (outside the lock: nothing else can reach those sets)."""
        with self._events_lock:
            self._waiting -= 1
            if self._waiting:
                return
            left, self._left_to_waiter = self._left_to_waiter, []
            owed, self._shutdowns_owed = self._shutdowns_owed, 0
        _release(left, owed)


def _release(event_sets: list[Any], shutdowns: int) -> None:
    """Free the event sets, then shut NVML down ``shutdowns`` times; errors do not matter here."""
    for event_set in event_sets:
        try:
            N.nvmlEventSetFree(event_set)
        except N.NVMLError:
            pass
    for _ in range(shutdowns):
        try:
            N.nvmlShutdown()
        except N.NVMLError:
            pass
