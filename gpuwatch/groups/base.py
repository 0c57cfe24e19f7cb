"""What a reading group is: the declaration every module in gpuwatch/groups/ makes.

A reading group (node_exporter's collector-per-file) is one domain of readings — temperatures,
fans, power, clocks, ... — and its module says everything about it:

- its reading types: frozen dataclasses (or tuples) with base units in the field names, one per
  tier it reads in (fast: every poll, slow: every slow poll). ``None`` or an empty mapping means
  "not supported"; the field names are unique within a tier and are the names the trace format and
  the test helpers use;
- its features (``gpuwatch_gpu_feature_supported{feature}``) and catalogue entries (``Spec``: the
  metric families it exports, with type, labels and help: unit, NVML source, nvidia-smi name);
- how it probes and reads NVML (``nvml``): a class built once per GPU at discovery from a
  ``Device`` (the funnel's probing side), whose ``read_fast``/``read_slow`` take a ``Query`` (the
  funnel's polling side). Only gpuwatch/backends/nvml/ implements them and imports pynvml; a group
  names NVML functions by their C name and gets opaque prepared calls back;
- how its readings render (``render``): a pure function of its fast and slow reading (each None
  when stale or absent) that emits samples. It never sees a GpuState or a clock.

The registry in gpuwatch/groups/__init__.py lists the groups and gives ``--collector.<group>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

G = ("gpu", "uuid")  # the labels every per-GPU family starts with

LabelValues = tuple[str, ...]
FieldKey = int | tuple[int, int]  # a field id (scope 0), or (field id, scopeId)


MAX_COUNT = 2**64 - 1  # NVML's widest counter (unsigned long long)
# The largest value a counter is believed at (Query.plausible): 0xFFFFFFFFFFFFFFFF (and -1 read unsigned) is NVML's
# "not available"; a real 64-bit count of errors, nanoseconds or bytes does not reach 2**63 in a GPU's life.
MAX_COUNTER = 2**63 - 1
MAX_COUNTER32 = 2**32 - 2  # a 32-bit counter: 0xFFFFFFFF is the sentinel


def whole(value: float | int | None, maximum: int = MAX_COUNT) -> int | None:
    """A field value as a count or an enum: a finite whole number 0..maximum, else None (NaN, a negative, a
    fraction or a huge number from a driver that answered something else: left out, never an exception)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():  # NaN and the infinities too
            return None
        value = int(value)
    return value if 0 <= value <= maximum else None


def within(low: float, high: float) -> Callable[[Any], bool]:
    """For ``Device.constant``: a number from ``low`` to ``high`` (what ``Query.plausible`` keeps), or a list or
    tuple of such numbers (a range NVML answers in one call)."""

    def valid(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return bool(value) and all(valid(v) for v in value)
        return type(value) in (int, float) and low <= value <= high

    return valid


def counted(q: Query, value: float | int | None, high: int, what: str) -> int | None:
    """``value`` as a count or a flag 0..``high`` (``Query.plausible`` with ``whole``): an int, or None (a sentinel,
    a negative, NaN, a fraction: left out, counted and logged by the query)."""
    value = q.plausible(value, 0, high, what, whole=True)
    return None if value is None else int(value)


@dataclass(frozen=True)
class Spec:
    """One metric family: the public contract (shared/metrics.md, docs/metrics.md)."""

    name: str
    type: str  # gauge | counter
    labels: tuple[str, ...]
    help: str


class Emit(Protocol):
    """Adds one sample of ``family`` for the GPU being rendered; ``labels`` are the values of the
    family's labels after ``gpu`` and ``uuid``; a None value is left out (unsupported is absent)."""

    def __call__(self, family: str, labels: LabelValues, value: float | int | bool | None) -> None: ...


class Unsupported(Exception):
    """A probe found that the GPU has no such reading (NOT_SUPPORTED and its kin): a fact, not an error."""


class Call(Protocol):
    """A prepared NVML call: the function, the GPU's handle and the arguments, resolved once at
    discovery. Opaque to groups: only a Query runs it."""


class Device(Protocol):
    """The funnel at discovery: what a group's ``nvml`` class probes one GPU with."""

    #: False on a driver branch newer than gpuwatch's table of moved field ids (groups/fieldids.py): the
    #: ids ``field_id`` gives are then the newest numbering's, and a group checks what they answer
    numbering_known: bool
    #: the GPU's architecture ("hopper", "blackwell", ...; None when NVML does not say)
    architecture: str | None

    def field_id(self, name: str) -> int | None:
        """The id of a field whose id moved between driver branches (a name in groups/fieldids.py)
        under this driver's numbering; None where the branch has no such field."""
        ...

    def value_type(self, key: FieldKey) -> int | None:
        """The NVML value type (NVML_VALUE_TYPE_*) the field answered in at discovery; None if unknown."""
        ...

    def reject(self, what: str, why: str) -> None:
        """Say (once per GPU and ``what``) that a reading answered something implausible and is left out."""
        ...

    def call(self, function: str, *args: Any) -> Call:
        """The NVML function ``function`` (its C name, e.g. "nvmlDeviceGetTemperatureV") with the
        handle first and ``args`` after, prepared; a few names are the funnel's own versioned
        wrappers (see backends/nvml/calls.py), and three keep state between polls, each in its module of
        backends/nvml/: "nvmlGpmMetricsGet" (metric ids: the GPU's GPM sample pair), "gpuwatch.mig" (metric
        ids: the MIG devices, whose ``instances`` and ``readings`` are prepared calls and ``on_event`` the
        handler of a reconfiguration) and "nvmlDeviceGetGpuFabricInfoV" (the structure version the driver
        takes)."""
        ...

    def constant(self, call: Call, valid: Callable[[Any], bool]) -> Call:
        """``call`` for a reading that does not change while the GPU stays as discovered (a maximum clock, a
        temperature threshold, the range and default of the power limit, the link's maximum generation and
        width): asked until NVML answers a value ``valid`` accepts (``within``), that answer kept until the next
        discovery; an error or a sentinel (0xFFFFFFFF) is asked again at the next poll. The slow tier asked
        them every 30 s: 8 of a PCIe GPU's 13 slow calls, each a trip into the driver."""
        ...

    def probe(self, call: Call) -> Any:
        """Run ``call`` once: its value; raises Unsupported if the GPU has no such reading. A
        transient failure answers None (the reading is polled; its errors are counted then)."""
        ...

    def supported(self, call: Call) -> bool:
        """Whether ``call`` is worth polling: it answered, or failed for a transient reason."""
        ...

    def first(self, *calls: Call) -> Call | None:
        """The first of ``calls`` (newest API first) the GPU supports; None if none."""
        ...

    def has_field(self, field_id: int) -> bool:
        """Whether the GPU answered this nvmlDeviceGetFieldValues id at discovery (all the groups'
        declared ids are probed in one batch before the groups' own probes)."""
        ...

    def values(self, keys: Iterable[FieldKey]) -> Mapping[FieldKey, float | int]:
        """One nvmlDeviceGetFieldValues call now, at discovery, for ``keys`` (a field id, or
        (id, scopeId) for a scoped one: a link, 0xFFFFFFFF for all links): the values of the
        entries that answered, by the key given. Those keys may then be passed to ``field``. For
        ids whose set depends on another reading (the NVLink links of the GPU's link count)."""
        ...

    def refused(self, key: FieldKey) -> bool:
        """Whether the last ``values`` call that asked for ``key`` got "no such reading" for it
        (NOT_SUPPORTED and the like), not a transient failure."""
        ...

    def field(self, field_id: FieldKey, tier: str) -> bool:
        """``has_field`` (or answered by ``values``), and if so the key is read in ``tier``'s
        ("fast" or "slow") one batched field-values call of every poll from now on
        (``Query.field`` hands it out, by the same key)."""
        ...

    def events(self, mask: int, refused: str | None = None, handler: Any = None) -> None:
        """Register this GPU for the NVML events of ``mask`` (nvmlDeviceRegisterEvents, one event set for the node).
        Without a ``handler`` the events come out of the backend's ``wait_events`` (XidEvent: the event's data);
        with one (a stateful call's ``on_event``) it is called with the GPU's uuid on the events thread. A
        registration the GPU refuses is dropped, and turns the feature ``refused`` (if named) off."""
        ...

    def option(self, name: str) -> Any:
        """The value of the group's option ``name`` (``--collector.<group>.<name>``)."""
        ...

    def feature(self, name: str, supported: bool | None) -> None:
        """Record a feature (gpuwatch_gpu_feature_supported) of this GPU. For a class of hardware
        (``Group.hardware``): True readable, False the GPU has it but it answers nothing readable (exported
        as 0), None the GPU has no such hardware (not recorded: no series)."""
        ...


class Query(Protocol):
    """The funnel during one poll of one GPU: runs prepared calls and hands out field values."""

    def __call__(self, call: Call) -> Any:
        """The value, or None when the call failed (the error is counted for this group and
        gpuwatch_poll_errors_total). A lost GPU or a backend that went away raises."""
        ...

    def field(self, field_id: FieldKey) -> float | int | None:
        """This tier's value of a field key (from the one batched nvmlDeviceGetFieldValues call),
        decoded by its value type; None if the entry failed or was not asked for."""
        ...

    def plausible(self, value: float | int | None, low: float, high: float, what: str,
                  whole: bool = False) -> float | int | None:
        """``value`` if it is a finite number from ``low`` to ``high`` (None stays None; ``whole``: and a whole
        number, for a count or a flag, never truncated); else None, counted as
        the poll's error ``implausible_value`` and logged once per GPU and ``what``: a sentinel (0xFFFFFFFF,
        -1 in a signed field), NaN or a value beyond physics is left out, never exported."""
        ...


F = TypeVar("F")  # a group's fast reading (its FastSample attribute)
S = TypeVar("S")  # its slow reading (its SlowSample attribute)
F_co = TypeVar("F_co", covariant=True)
S_co = TypeVar("S_co", covariant=True)


class NvmlReader(Protocol[F_co, S_co]):
    """A group's NVML side for one GPU, built at discovery (``Group.nvml(device)``).

    A reader may say ``idle_fast = True`` where the GPU has nothing for its fast read until the next discovery
    (no fans, no GPM, MIG off): the backend then leaves the read out of the GPU's fast polls, and the sample
    keeps FastSample's default for the group, which must be what ``read_fast`` would return
    (tests/test_nvml_backend.py holds each such reader to it). Every GPU of a PCIe node or an HGX board has one
    to three of them; a read left out is a call, a clock read and a timing entry fewer at every poll."""

    def read_fast(self, q: Query) -> F_co: ...

    def read_slow(self, q: Query) -> S_co: ...


Render = Callable[[Emit, Any, Any], None]


@dataclass(frozen=True)
class Group(Generic[F, S]):
    """A reading group's declaration (see the module docstring)."""

    name: str
    help: str  # one line: what it reads and where (for --help and docs/groups.md)
    specs: tuple[Spec, ...]
    features: tuple[str, ...] = ()
    # the features that are a class of hardware (NVLink, GPM, the fabric, MIG, power smoothing, C2C): where the GPU
    # has it and it reads, the group's own series say so (gpuwatch_nvlink_links, ...: no feature series, a 1 beside
    # readings that say the same); where it has none, nothing (no 0 on every PCIe card); where it has it and
    # nothing can be read, gpuwatch_gpu_feature_supported{feature} 0 (Device.feature(name, False)). /api/v1/status
    # lists them with the others; the rules' applicability reads them as any feature
    hardware: tuple[str, ...] = ()
    default: bool = True  # on unless --no-collector.<name>
    # option -> (default, help): --collector.<name>.<option>; the default's type (bool, int) is the option's
    options: Mapping[str, tuple[Any, str]] = None  # type: ignore[assignment]
    fast: str | None = None  # the attribute of its reading in FastSample (None: no fast reading)
    slow: str | None = None  # ... in SlowSample
    nvml: Callable[[Device], NvmlReader[F, S]] | None = None
    # field id -> what it is: every nvmlDeviceGetFieldValues id the group may read (probed at discovery); an id
    # that moved between driver branches is given by its name in groups/fieldids.py and resolved per driver
    fields: Mapping[int | str, str] = None  # type: ignore[assignment]
    render: Callable[[Emit, F | None, S | None], None] | None = None
    # (GpuState, fresh fast sample, fresh slow sample, fresh GpuHost) -> the two readings render() takes; default:
    # the group's attribute of each sample. For groups whose readings the store keeps (xid counts,
    # attributed processes) and host groups (their part of the GPU's GpuHost).
    select: Callable[[Any, Any, Any, Any], tuple[Any, Any]] | None = None
    # A host group reads no NVML: gpuwatch/hostside/ reads it on the host job's thread every slow
    # interval; ``host`` is the attribute of its reading in HostSample (and GpuHost, for per-GPU ones).
    host: str | None = None
    # A node-level render: (emit, the group's fresh HostSample reading or None); its families have no
    # gpu/uuid labels.
    render_node: Callable[[Emit, Any], None] | None = None
    # The fast reading as the rules' look-back keeps it (gpuwatch/rules/engine.py keeps rules.window seconds of
    # samples per GPU): what no rule looks back at dropped; rules read the latest sample whole. None: kept whole.
    # A rule that needs a dropped reading from the past adds it back here.
    history: Callable[[F], F] | None = None
    # The group reads NVML events (``Device.events``): the poller runs its events thread while one such group is
    # on. A group with events and no tier reading (xid) reports the events thread's state as its
    # gpuwatch_collector_success.
    events: bool = False
    # Its slow reading (the GPU's processes) is attributed to jobs, pods and units through /proc: the poller
    # attributes it and counts the time as the group's.
    attributed: bool = False

    def __post_init__(self) -> None:
        if self.host is not None and self.render is not None and self.select is None:
            raise ValueError(f"group {self.name}: a host group that renders per GPU needs a select (its part of the "
                             "GPU's GpuHost): it has no fast or slow reading")
        object.__setattr__(self, "fields", dict(self.fields or {}))
        object.__setattr__(self, "options", dict(self.options or {}))

    def families(self) -> Iterable[str]:
        return (spec.name for spec in self.specs)
