"""The funnel's two faces that the groups see: ``Probe`` (groups.base.Device, at discovery) and ``Query``
(groups.base.Query, during a poll)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import pynvml as N

from gpuwatch.backends.nvml.calls import Batch, FieldKey, direct, resolve
from gpuwatch.backends.nvml.codes import ERROR_NAMES, LOST, UNSUPPORTED, failure, is_gone
from gpuwatch.backends.nvml.fabric import FABRIC_VERSIONS, FabricInfoV
from gpuwatch.backends.nvml.gpm import GpmPair
from gpuwatch.backends.nvml.mig import MigDevices
from gpuwatch.backends.nvml.structs import VALUE_MEMBERS
from gpuwatch.errors import DeviceLost
from gpuwatch.groups import fieldids
from gpuwatch.groups.base import Unsupported
from gpuwatch.logs import get_logger
from gpuwatch.model import GpuIdentity

IMPLAUSIBLE = "implausible_value"  # gpuwatch_poll_errors_total{error}: a reading NVML answered that no GPU can have


def stateful(function: str, handle: Any, args: tuple[Any, ...]) -> Any:
    """The funnel's calls that keep state between polls (GPM's sample pair, MIG devices, the fabric
    structure version the driver takes); None for the others."""
    if function == "nvmlGpmMetricsGet":
        return GpmPair(handle, tuple(args[0])) if hasattr(N, "c_nvmlGpmMetricsGet_t") else None
    if function == "gpuwatch.mig":
        return MigDevices(handle, tuple(args[0]) if args else ())
    if function == "nvmlDeviceGetGpuFabricInfoV":  # a binding without the v2/v3 structures: unsupported
        return FabricInfoV(handle) if FABRIC_VERSIONS else None
    return None



class Probe:
    """groups.base.Device for one GPU at discovery."""

    def __init__(self, handle: Any, fields: Mapping[int, int | None], options: Mapping[str, Any],
                 numbering: fieldids.Numbering = fieldids.DEFAULT, identity: GpuIdentity | None = None) -> None:
        self.handle = handle
        self.fields: set[FieldKey] = set(fields)  # the keys the GPU answered at discovery
        self._types: dict[FieldKey, int | None] = dict(fields)  # key -> NVML value type it answered in
        self.options = options  # "<group>.<option>" -> value
        self.numbering = numbering
        self.numbering_known = numbering.known
        self.architecture = None if identity is None else identity.architecture
        self._identity = identity
        self._rejected: set[str] = set()
        self._refused: set[FieldKey] = set()  # keys a values() call got "no such reading" for
        self.features: dict[str, bool] = {}
        self.used: dict[str, dict[FieldKey, str]] = {"fast": {}, "slow": {}}  # tier -> field key -> group
        self.cleanups: list[Callable[[], None]] = []  # what to free before NVML shuts down (GPM samples)
        # the NVML events the groups asked for: (event type mask, the feature a refused registration turns off,
        # the handler of a stateful call, or None: the events are delivered, as XidEvents, by wait_events)
        self.event_requests: list[tuple[int, str | None, Callable[[str], None] | None]] = []
        self.group = ""

    def call(self, function: str, *args: Any) -> Any:
        """A call of no arguments (None: this binding has no such function)."""
        kept = stateful(function, self.handle, args)
        if kept is not None:
            self.cleanups.append(kept.free)
            return kept
        fast = direct(function, self.handle, args)
        if fast is not None:
            return fast
        fn = resolve(function)
        return None if fn is None else functools.partial(fn, self.handle, *args)

    def constant(self, call: Any, valid: Callable[[Any], bool]) -> Any:
        if call is None:
            return None
        kept: list[Any] = []

        def once() -> Any:
            if kept:
                return kept[0]
            value = call()  # NVMLError: nothing kept, asked again at the next poll
            if valid(value):
                kept.append(value)
            return value

        return once

    def probe(self, call: Any) -> Any:
        if call is None:
            raise Unsupported
        try:
            return call()
        except N.NVMLError as exc:
            if exc.value in UNSUPPORTED:
                raise Unsupported from None
            if is_gone(exc.value):
                raise
            return None  # transient: polled anyway, its errors counted then

    def supported(self, call: Any) -> bool:
        try:
            self.probe(call)
            return True
        except Unsupported:
            return False

    def first(self, *calls: Any) -> Any:
        return next((call for call in calls if self.supported(call)), None)

    def has_field(self, field_id: int) -> bool:
        return field_id in self.fields

    def field_id(self, name: str) -> int | None:
        return self.numbering.id(name)

    def value_type(self, key: FieldKey) -> int | None:
        return self._types.get(key)

    def reject(self, what: str, why: str) -> None:
        if what in self._rejected:
            return
        self._rejected.add(what)
        identity = self._identity
        get_logger(component="nvml").warning(
            "nvml_reading_implausible", reading=what, error_detail=why, group=self.group,
            gpu=None if identity is None else str(identity.index), uuid=None if identity is None else identity.uuid,
            driver_version=self.numbering.driver_version, branch=self.numbering.branch,
            hint="the reading is left out and shown as an unsupported feature; please report the driver version "
                 "and `nvidia-smi -q` output so gpuwatch can learn this branch")

    def values(self, keys: Any) -> dict[FieldKey, float | int]:
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        try:
            entries = Batch({key: self.group for key in keys}).run(self.handle)
        except N.NVMLError as exc:
            if is_gone(exc.value):
                raise
            if exc.value in UNSUPPORTED:  # no entry answered, the call says why
                self._refused.update(keys)
            return {}
        answered: dict[FieldKey, float | int] = {}
        for key, entry in zip(keys, entries):
            if entry.nvmlReturn == LOST:
                raise N.NVMLError(LOST)
            if entry.nvmlReturn in UNSUPPORTED:
                self._refused.add(key)
            else:
                self._refused.discard(key)
            if entry.nvmlReturn == N.NVML_SUCCESS and entry.valueType < len(VALUE_MEMBERS):
                answered[key] = getattr(entry.value, VALUE_MEMBERS[entry.valueType])
                self._types[key] = int(entry.valueType)
        self.fields.update(answered)
        return answered

    def refused(self, key: FieldKey) -> bool:
        return key in self._refused

    def field(self, field_id: FieldKey, tier: str) -> bool:
        if field_id not in self.fields:
            return False
        self.used[tier][field_id] = self.group
        return True

    def feature(self, name: str, supported: bool | None) -> None:
        if supported is not None:  # None: no such hardware, nothing to say
            self.features[name] = bool(supported)

    def events(self, mask: int, refused: str | None = None, handler: Any = None) -> None:
        self.event_requests.append((mask, refused, handler))

    def option(self, name: str) -> Any:
        return self.options[f"{self.group}.{name}"]



class Query:
    """groups.base.Query for one poll of one GPU: a lost GPU and lifecycle errors raise, any other error
    leaves the reading out and is remembered (by lowercase name) for gpuwatch_poll_errors_total."""

    __slots__ = ("_uuid", "errors", "_values", "field_errors", "_implausible", "_gpu")

    def __init__(self, uuid: str, implausible: set[str] | None = None, gpu: str | None = None) -> None:
        self._uuid = uuid
        self._gpu = gpu  # the GPU's index, for the log line
        self.errors: list[str] = []
        self._values: dict[FieldKey, float | int] = {}
        self.field_errors: dict[str, int] = {}  # group -> failed entries of this poll's batch
        # the GPU's readings already logged as implausible (kept by the backend across polls): logged once each
        self._implausible = implausible if implausible is not None else set()

    def plausible(self, value: float | int | None, low: float, high: float, what: str,
                  whole: bool = False) -> float | int | None:
        """``value`` when it is a finite number from ``low`` to ``high`` (``whole``: and a whole number, as a
        count or a flag is: a fraction is not truncated); else None, the poll's error
        ``implausible_value`` counted (gpuwatch_poll_errors_total; the group's gpuwatch_collector_success 0) and
        one ``nvml_reading_implausible`` line per GPU and reading: a sentinel (0xFFFFFFFF), NaN or a value beyond
        physics is never exported."""
        if value is None:
            return None
        kind = type(value)
        if (kind is int or kind is float) and low <= value <= high and (
                not whole or kind is int or value.is_integer()):  # type: ignore[union-attr]
            return value  # NaN fails both comparisons; a bool is not an int here (type(), not isinstance)
        self.errors.append(IMPLAUSIBLE)
        if what not in self._implausible:
            self._implausible.add(what)
            get_logger(component="nvml").warning(
                "nvml_reading_implausible", reading=what, value=repr(value), gpu=self._gpu, uuid=self._uuid,
                error_detail=f"not a {'whole ' if whole else ''}number from {low:g} to {high:g}",
                hint="the reading is left out while the GPU answers this (counted as implausible_value in "
                     "gpuwatch_poll_errors_total); check `nvidia-smi -q`, and report the driver version if it "
                     "shows a sane value")
        return None

    def __call__(self, call: Any) -> Any:
        try:
            return call()
        except N.NVMLError as exc:
            lost = failure(exc, self._uuid)
            if lost is not None:
                raise lost from None
            self.errors.append(ERROR_NAMES.get(exc.value, "unknown"))
            return None

    def field(self, field_id: FieldKey) -> float | int | None:
        return self._values.get(field_id)

    def load(self, batch: Batch, handle: Any) -> None:
        """Run the tier's one field-values call and keep the entries that succeeded."""
        try:
            entries = batch.run(handle)
        except N.NVMLError as exc:
            lost = failure(exc, self._uuid)
            if lost is not None:
                raise lost from None
            self.errors.append(ERROR_NAMES.get(exc.value, "unknown"))
            for group in set(batch.owners.values()):
                self.field_errors[group] = self.field_errors.get(group, 0) + 1
            return
        values = self._values
        answered = batch.values()  # every entry in the types of the last complete answer: one unpack
        if answered is not None:
            values.update(zip(batch.ids, answered))
            return
        members, known = VALUE_MEMBERS, len(VALUE_MEMBERS)
        kinds = []
        for key, entry in zip(batch.ids, entries):
            code = entry.nvmlReturn
            if code == 0:  # NVML_SUCCESS
                kind = entry.valueType
                if kind < known:
                    values[key] = getattr(entry.value, members[kind])
                    kinds.append(kind)
                    continue
            if code == LOST:
                raise DeviceLost(self._uuid, "NVML: GPU is lost")
            self.errors.append(ERROR_NAMES.get(code, "unknown") if code != N.NVML_SUCCESS else "bad_value_type")
            group = batch.owners.get(key, "")
            self.field_errors[group] = self.field_errors.get(group, 0) + 1
        if len(kinds) == len(batch.ids):
            batch.learn(tuple(kinds))
