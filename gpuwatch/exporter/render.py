"""The exposition: a view over the latest store snapshot that re-encodes only what changed.

A scrape never calls NVML. Each reading group renders its own families (gpuwatch/groups/) from
its readings of one GPU; readings are immutable objects, so a group's encoded lines for a GPU are
kept with the readings they came from and reused while the GPU still holds those very objects:
between slow polls the slow-tier lines, the identity, the features and every group whose reading
did not change cost a dictionary lookup, not an encoding. Node-level families (poll outcomes,
anomalies, the collectors' own figures) are small and encoded each time.

Readings older than the staleness bound are dropped (``gpuwatch_last_poll_timestamp_seconds``
still says when data was last fresh); unsupported readings are absent, never 0 or NaN. Output is
sorted by family, then by the label values in the family's label order (numbers numerically), and
is byte for byte what prometheus_client's encoders make of the same samples (tests/test_render.py).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Collection, Iterable
from operator import itemgetter
from typing import Any

from prometheus_client.utils import floatToGoString

from gpuwatch import __version__, groups, logs
from gpuwatch.deferred import dist_version
from gpuwatch.exporter.catalogue import CATALOGUE
from gpuwatch.groups.base import LabelValues
from gpuwatch.groups.selection import Selection
from gpuwatch.model import GpuState, NodeSnapshot, fresh


def _sort_key(values: LabelValues) -> tuple[tuple[int, int, str], ...]:
    # numbers numerically: ASCII digits only, and short (int() refuses "²", which isdigit() takes, and 4300 digits)
    return tuple((0, int(v), "") if v.isascii() and v.isdigit() and len(v) < 20 else (1, 0, v) for v in values)


def _escape(text: str) -> str:
    if "\\" in text or '"' in text or "\n" in text:
        return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return text


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def text_header(name: str, help_text: str, kind: str) -> str:
    """A family's ``# HELP`` and ``# TYPE`` lines in the text format (0.0.4): backslash and newline escaped."""
    return f"# HELP {name} {_escape_help(help_text)}\n# TYPE {name} {kind}\n"


_told_not_utf8 = False


def _utf8(text: str) -> bytes:
    """Exposition text as UTF-8. Text from the host that is not UTF-8 reaches Python as lone surrogates
    (a name from pwd, a path, an environment value); the sources that make labels refuse or replace it, and
    should one slip through, its characters are sent as "?" (logged once) rather than every scrape failing
    with UnicodeEncodeError."""
    global _told_not_utf8
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        if not _told_not_utf8:
            _told_not_utf8 = True
            logs.get_logger(component="exporter").warning(
                "label_text_not_utf8", text=ascii(exc.object[max(0, exc.start - 60):exc.end + 20]),
                hint="a label value holds bytes that are not UTF-8; they are shown as '?'. Please report which "
                     "source it came from (a gpuwatch bug: that source should have refused or replaced it)")
        return text.encode("utf-8", "replace")


class _Family:
    """How one family's lines are spelled: its header in both formats and its label order."""

    __slots__ = ("name", "order", "keys", "text_header", "openmetrics_header")

    def __init__(self, name: str) -> None:
        spec = CATALOGUE[name]
        self.name = name
        self.order = sorted(range(len(spec.labels)), key=spec.labels.__getitem__)
        self.keys = [f'{spec.labels[i]}="' for i in self.order]
        self.text_header = _utf8(text_header(name, spec.help, spec.type))
        family = name[:-6] if spec.type == "counter" else name
        help_text = _escape_help(spec.help).replace(chr(34), chr(92) + chr(34))
        self.openmetrics_header = _utf8(f"# HELP {family} {help_text}\n# TYPE {family} {spec.type}\n")

    def prefix(self, labels: LabelValues) -> str:
        """The line up to its value: ``name{a="1",b="x"} `` (label names sorted, values escaped)."""
        if not self.keys:
            return f"{self.name} "
        parts = ",".join(key + _escape(labels[i]) + '"' for key, i in zip(self.keys, self.order))
        return f"{self.name}{{{parts}}} "


_FAMILIES: dict[str, _Family] = {name: _Family(name) for name in CATALOGUE}
GO_EXPONENT_FROM = 1e6  # floatToGoString writes an exponent from here on; below it, it is repr() (== str())
_VALUES: dict[float, str] = {}  # value -> its text: readings repeat (0, 1, a memory size, a clock)


def _value(value: float) -> str:
    """floatToGoString(value): Go's spelling (exponents from 1e6 on, +Inf, NaN), which is repr()
    below 1e6. Whole numbers (0, 1, sizes, clocks, temperatures) repeat and are kept; fractions
    (durations, timestamps, ratios) rarely do and are spelled each time."""
    text = _VALUES.get(value)
    if text is not None:
        return text
    if value != value or not -GO_EXPONENT_FROM < value < GO_EXPONENT_FROM:  # NaN, infinities, Go's exponent form
        text = floatToGoString(value)
    else:
        text = repr(value)
    if value.is_integer() and value != 0.0:  # -0.0 == 0.0 would share one entry
        if len(_VALUES) >= 4096:
            _VALUES.clear()
        _VALUES[value] = text
    return text


class _Layout:
    """The lines one render produced: the families and labels it emitted, in emit order (flat:
    family, labels, family, labels...; the GPU's own labels, ``prefix``, kept once), and how they
    encode: per family, sorted by label values, which values its lines show and the lines as one
    format (``name{labels} %s\n`` per line). While a group keeps emitting the same series (the usual
    case: only the values change), the layout is reused and encoding is formatting the values; a
    family whose values are those of the last encoding keeps its text (the limits and thresholds a
    group renders beside its changing readings, the clock-event reasons that stay 0). Flat, the GPU's
    labels once: per series no (family, labels) pair and no prefix + labels tuple (56 + 72 bytes at two
    labels); the format takes the place of the lines' prefixes (VmRSS at 64 GPUs, HGX, 300 polls: 40.1 ->
    40.2 MB with the last values kept, bench/rss.py)."""

    __slots__ = ("keys", "prefix", "plan", "last")

    def __init__(self, keys: tuple[Any, ...], prefix: LabelValues) -> None:
        self.keys = keys
        self.prefix = prefix
        by_family: dict[str, list[tuple[int, LabelValues]]] = {}
        for i in range(0, len(keys), 2):
            labels = keys[i + 1]
            by_family.setdefault(keys[i], []).append((i // 2, prefix + labels if prefix else labels))
        plan = []
        for name, series in by_family.items():
            fam = _FAMILIES[name]  # KeyError: a family that is not in the catalogue
            series.sort(key=lambda entry: _sort_key(entry[1]))
            form = "".join([fam.prefix(labels).replace("%", "%%") + "%s\n" for _, labels in series])
            plan.append((name, itemgetter(*(i for i, _ in series)), len(series) == 1, form))
        self.plan = tuple(plan)
        self.last: list[tuple[tuple[float, ...], bytes] | None] = [None] * len(plan)  # per family (values, text)

    def encode(self, values: list[float]) -> dict[str, bytes]:
        """Per family its lines, in UTF-8. Values below 1e6 and finite (most: ratios, temperatures, watts, states,
        counts) are spelled by ``%`` formatting itself, since str() is Go's spelling there; a family with
        a clock in Hz, a size in bytes, a timestamp, NaN or an infinity has each value spelled by _value."""
        chunks = {}
        last = self.last
        for k, (name, pick, single, form) in enumerate(self.plan):
            picked = (pick(values),) if single else pick(values)
            kept = last[k]
            if kept is not None and kept[0] == picked:  # (0.0 and -0.0 are equal: the one kept is shown)
                chunks[name] = kept[1]
                continue
            if max(picked) < GO_EXPONENT_FROM and (total := sum(picked)) - total == 0.0:  # no NaN, no infinity
                text = _utf8(form % picked)
            else:
                text = _utf8(form % tuple([_value(value) for value in picked]))
            last[k] = (picked, text)
            chunks[name] = text
        return chunks


def _collect(render: Callable[..., None], prefix: LabelValues, layout: _Layout | None,
             *readings: Any) -> tuple[dict[str, bytes], _Layout]:
    """Run one group's ``render`` for one GPU: its lines per family, sorted, and their layout (the
    previous one again when the same series came out)."""
    keys: list[Any] = []
    values: list[float] = []
    add_key, add_value = keys.append, values.append

    def emit(family: str, labels: LabelValues, value: float | int | bool | None) -> None:
        if value is not None:
            add_key(family)
            add_key(labels)
            add_value(float(value))

    render(emit, *readings)
    emitted = tuple(keys)
    if layout is None or layout.keys != emitted or layout.prefix != prefix:
        layout = _Layout(emitted, prefix)
    return layout.encode(values), layout


def binding_version() -> str:
    try:
        return dist_version("nvidia-ml-py")
    except ImportError:  # importlib.metadata's PackageNotFoundError
        return "unknown"


def build_labels() -> LabelValues:
    """Label values of gpuwatch_build_info."""
    return (__version__, platform.python_version(), binding_version())


def _gpu_core(emit: Callable[..., None], state: GpuState, features: Collection[str]) -> None:
    ident = state.identity
    emit("gpuwatch_gpu_info", (ident.name, ident.pci_bus_id, ident.serial or "",
                               "" if ident.minor_number is None else str(ident.minor_number),
                               ident.vbios_version or "", ident.architecture or ""), 1)
    emit("gpuwatch_gpu_up", (), state.up)
    hardware = groups.HARDWARE_FEATURES
    for feature in groups.FEATURES:
        if feature in state.features and feature in features and not (feature in hardware and state.features[feature]):
            emit("gpuwatch_gpu_feature_supported", (feature,), state.features[feature])


class _Entry:
    """One (GPU, group)'s lines: the readings they came from, per family its text and its place in
    the body (``Renderer._slots``)."""

    __slots__ = ("ident", "a", "b", "families", "texts", "layout", "places")

    def __init__(self, ident: Any, a: Any, b: Any, chunks: dict[str, bytes], layout: _Layout) -> None:
        self.ident, self.a, self.b, self.layout = ident, a, b, layout
        self.families = tuple(chunks)
        self.texts = list(chunks.values())
        self.places: list[int] = []


class Renderer:
    """Renders snapshots into one body kept as a list of pieces in output order (``_slots``): per
    family its header, then each (GPU, group)'s lines of it. A group whose readings did not change
    costs a comparison; one whose values changed writes its new texts into its places; only when
    the set of series changes (a GPU, a group's families) is the order of the pieces built again."""

    def __init__(self, staleness: Callable[[str], float], build: LabelValues,
                 selection: Selection | None = None) -> None:
        self._staleness = staleness
        self._build = build
        selection = selection or Selection.of()
        self._selection = selection
        self._features = selection.features
        self._groups: list[tuple[str, Any, Any, str | None, str | None]] = [
            (g.name, g.render, g.select, g.fast, g.slow) for g in selection.groups if g.render is not None]
        self._groups += [(j.name, j.render, j.select, None, None) for j in selection.joint]  # several groups' together
        self._node_groups = [(g.render_node, g.host or g.name) for g in selection.groups if g.render_node is not None]
        self._per_pid_max = selection.per_pid_max
        # uuid -> its entries: [0] the GPU's own families (identity, up, features), then one per group
        self._entries: dict[str, list[_Entry | None]] = {}
        self._node_entry: _Entry | None = None
        self._uuids: tuple[str, ...] = ()
        self._slots: list[bytes] = []
        self._headers: list[tuple[int, _Family]] = []  # (place, family) of each header in _slots

    def render(self, snap: NodeSnapshot, now: float, log_dropped: int = 0) -> None:
        """Bring the body up to ``snap`` (``encode`` spells it out)."""
        fast_bound, slow_bound = self._staleness("fast"), self._staleness("slow")
        slots = self._slots
        uuids = tuple(state.identity.uuid for state in snap.gpus)
        rebuild = uuids != self._uuids
        width = len(self._groups) + 1
        for state in snap.gpus:
            ident = state.identity
            entries = self._entries.get(ident.uuid)
            if entries is None:
                entries = self._entries[ident.uuid] = [None] * width
                rebuild = True
            prefix = (str(ident.index), ident.uuid)
            kept = entries[0]
            if kept is None or kept.ident is not ident or kept.a is not state.features or kept.b is not state.up:
                rebuild |= self._update(entries, 0, self._gpu_core, prefix, ident, state.features, state.up,
                                        (state,), rebuild)
            fast = state.fresh_fast(now, fast_bound)
            slow = state.fresh_slow(now, slow_bound)
            host = state.fresh_host(now, slow_bound)  # the host groups' reading (slow tier's bound)
            for i, (_, render, select, fast_attr, slow_attr) in enumerate(self._groups, 1):
                if select is None:
                    a = getattr(fast, fast_attr) if fast_attr and fast is not None else None
                    b = getattr(slow, slow_attr) if slow_attr and slow is not None else None
                else:
                    a, b = select(state, fast, slow, host)
                kept = entries[i]
                if (kept is None or kept.ident is not ident or (kept.a is not a and kept.a != a)
                        or (kept.b is not b and kept.b != b)):  # the same readings: the same lines
                    rebuild |= self._update(entries, i, render, prefix, ident, a, b, (a, b), rebuild)
        node = self._node_entry
        chunks, layout = _collect(self._node, (), None if node is None else node.layout, snap, now, slow_bound,
                                  log_dropped)
        if node is not None and not rebuild and node.families == tuple(chunks):
            for place, text in zip(node.places, chunks.values()):
                slots[place] = text
            node.layout = layout
        else:
            self._node_entry = _Entry(None, None, None, chunks, layout)
            rebuild = True
        if rebuild:
            self._order(snap)

    def _update(self, entries: list[_Entry | None], i: int, render: Callable[..., None], prefix: LabelValues,
                ident: Any, a: Any, b: Any, readings: tuple[Any, ...], rebuild: bool) -> bool:
        """Render one (GPU, group) again; True when its families changed (the order must be rebuilt)."""
        kept = entries[i]
        chunks, layout = _collect(render, prefix, None if kept is None else kept.layout, *readings)
        if kept is not None and not rebuild and kept.families == tuple(chunks):
            slots = self._slots
            for place, text in zip(kept.places, chunks.values()):
                slots[place] = text
            kept.ident, kept.a, kept.b, kept.layout = ident, a, b, layout
            kept.texts = list(chunks.values())
            return False
        entries[i] = _Entry(ident, a, b, chunks, layout)
        return True

    def _order(self, snap: NodeSnapshot) -> None:
        """Lay the pieces out again: families sorted by name, in each the GPUs in snapshot order
        (each GPU's lines sorted by label values), then the node's."""
        current = {state.identity.uuid for state in snap.gpus}
        for uuid in [u for u in self._entries if u not in current]:  # GPUs that are gone for good
            del self._entries[uuid]
        by_family: dict[str, list[tuple[_Entry, int]]] = {}
        pieces: list[_Entry] = [e for state in snap.gpus for e in self._entries[state.identity.uuid] if e is not None]
        if self._node_entry is not None:
            pieces.append(self._node_entry)
        for entry in pieces:
            entry.places = [0] * len(entry.families)
            for k, family in enumerate(entry.families):
                by_family.setdefault(family, []).append((entry, k))
        slots: list[bytes] = []
        headers = []
        for name in sorted(by_family):
            headers.append((len(slots), _FAMILIES[name]))
            slots.append(b"")
            for entry, k in by_family[name]:
                entry.places[k] = len(slots)
                slots.append(entry.texts[k])
        self._slots, self._headers = slots, headers
        self._uuids = tuple(state.identity.uuid for state in snap.gpus)

    def encode(self, openmetrics: bool = False) -> bytes:
        """The text exposition (0.0.4, or OpenMetrics without the final ``# EOF``) of the last render, in
        UTF-8: the pieces are kept encoded, so that a body is one join (not a join and a copy to bytes)."""
        slots = self._slots
        for place, family in self._headers:
            slots[place] = family.openmetrics_header if openmetrics else family.text_header
        return b"".join(slots)

    def _gpu_core(self, emit: Callable[..., None], state: GpuState) -> None:
        _gpu_core(emit, state, self._features)

    def _node(self, add: Callable[..., None], snap: NodeSnapshot, now: float, slow_bound: float,
              log_dropped: int) -> None:
        """The node-level families (and the per-process series, which share one budget per node)."""
        add("gpuwatch_build_info", self._build, 1)
        add("gpuwatch_log_dropped_total", (), log_dropped)
        add("gpuwatch_backend_up", (snap.backend,), snap.backend_up)
        add("gpuwatch_gpus", (), snap.visible_gpus)
        node = snap.node
        add("gpuwatch_node_info", (node.rack, node.row, node.room, node.pdu), 1)
        add("gpuwatch_node_power_budget_watts", (), node.power_budget_watts)
        if snap.driver is not None:
            d = snap.driver
            add("gpuwatch_driver_info", (d.driver_version, d.nvml_version, d.cuda_driver_version), 1)
        for tier_name, tier in snap.tiers.items():
            t = (tier_name,)
            add("gpuwatch_poll_success", t, tier.succeeded_within(now, self._staleness(tier_name)))
            add("gpuwatch_poll_duration_seconds", t, tier.duration_seconds)
            add("gpuwatch_last_poll_timestamp_seconds", t, tier.last_completed_wall)
            for error, count in tier.errors_total.items():
                add("gpuwatch_poll_errors_total", (tier_name, error), count)
        for name, seconds, ok in self._collectors(snap):
            add("gpuwatch_collector_success", (name,), ok)
            add("gpuwatch_collector_duration_seconds", (name,), seconds)
        for (group, error), count in snap.host_errors.items():
            add("gpuwatch_collector_errors_total", (group, error), count)
        if self._node_groups:
            host = snap.fresh_host(now, slow_bound)
            for render_node, attr in self._node_groups:
                render_node(add, None if host is None else getattr(host, attr))
        for anomaly in snap.anomalies:
            if not anomaly.firing:  # sparse, like ALERTS: quiet rules have no series (contract v2)
                continue
            if anomaly.uuid is None:
                add("gpuwatch_node_anomaly", (anomaly.rule, anomaly.severity), 1)
                continue
            g = (anomaly.gpu or "", anomaly.uuid)
            add("gpuwatch_anomaly", g + (anomaly.rule, anomaly.severity), 1)
            add("gpuwatch_anomaly_since_timestamp_seconds", g + (anomaly.rule,), anomaly.since_wall)
        for rule, count in snap.rule_onsets.items():
            add("gpuwatch_anomaly_onsets_total", (rule,), count)
        for rule, count in snap.rule_errors.items():
            add("gpuwatch_rule_evaluation_errors_total", (rule,), count)
        budget = self._per_pid_max
        for state in snap.gpus if budget else ():
            if state.fresh_slow(now, slow_bound) is None:
                continue
            g = (str(state.identity.index), state.identity.uuid)
            for p in state.workloads:
                if budget and p.pid:
                    add("gpuwatch_process_memory_used_bytes", g + (str(p.pid), p.scheduler, p.job_id, p.user),
                        p.used_memory_bytes)
                    budget -= 1

    def _collectors(self, snap: NodeSnapshot) -> Iterable[tuple[str, float | None, bool | None]]:
        """(group, seconds, succeeded) of each enabled group: its last fast and last slow read together."""
        fast, slow = snap.tiers.get("fast"), snap.tiers.get("slow")
        host = {name: (seconds, ok) for name, seconds, ok in snap.host.collected} if snap.host is not None else {}
        for group in self._selection.groups:
            if group.host is not None:
                if group.name in host:
                    yield group.name, *host[group.name]
                continue
            if group.events and not (group.fast or group.slow):  # read from events only: the events thread's state
                if snap.events_ok is not None:
                    yield group.name, 0.0, snap.events_ok
                continue
            parts = [t.groups[group.name] for t in (fast, slow) if t is not None and group.name in t.groups]
            if parts:
                yield group.name, sum(p[0] for p in parts), all(p[1] for p in parts)


def freshness_key(snap: NodeSnapshot, now: float, staleness: Callable[[str], float]) -> tuple[Any, ...]:
    """What, besides the snapshot itself, decides the exposition: which readings are still fresh."""
    fast_bound, slow_bound = staleness("fast"), staleness("slow")
    tiers = tuple(tier.succeeded_within(now, staleness(name)) for name, tier in snap.tiers.items())
    gpus = tuple((fresh(g.fast_monotonic, now, fast_bound), fresh(g.slow_monotonic, now, slow_bound),
                  fresh(g.host_monotonic, now, slow_bound)) for g in snap.gpus)
    return tiers, gpus, fresh(snap.host_monotonic, now, slow_bound)
