"""The collector: unsupported is absent, thresholds on both scales, stable order, contract names."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch import logs
from gpuwatch.clock import FakeClock
from gpuwatch.exporter.catalogue import CATALOGUE
from gpuwatch.model import FEATURES, DiscoveredGpu
from gpuwatch.store import Store
from gpuwatch.testing import exposition, fan, fast_sample, identity, slow_sample


def node(features, fast, slow):
    clock = FakeClock()
    store = Store(clock, "scripted")
    gpu = DiscoveredGpu(identity(0), features)
    store.set_gpus([gpu])
    store.set_backend(True)
    store.put_fast(gpu.identity.uuid, fast)
    store.put_slow(gpu.identity.uuid, slow)
    return exposition(store, clock)


def series(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def names(text):
    return {name for name, _ in series(text)}


def test_fanless_gpu_exports_no_fan_series_and_says_so():
    features = {f: f not in ("fan", "fan_rpm", "fan_target") for f in FEATURES}
    text = node(features, fast_sample(), slow_sample())
    assert not any(n.startswith("gpuwatch_fan_") for n in names(text))
    uuid = identity(0).uuid
    s = series(text)
    assert s[("gpuwatch_gpu_feature_supported", (("feature", "fan"), ("gpu", "0"), ("uuid", uuid)))] == 0
    assert s[("gpuwatch_gpu_feature_supported", (("feature", "power"), ("gpu", "0"), ("uuid", uuid)))] == 1


def test_zero_fan_speed_is_exported_as_zero():
    """A 0 % fan reading means a stopped fan: it must not vanish like an unsupported reading."""
    features = {f: True for f in FEATURES}
    text = node(features, fast_sample(fans=(fan(0, speed=0.0, target=0.6, rpm=0.0), fan(1))), slow_sample())
    uuid = identity(0).uuid
    s = series(text)
    assert s[("gpuwatch_fan_speed_ratio", (("fan", "0"), ("gpu", "0"), ("uuid", uuid)))] == 0.0
    assert s[("gpuwatch_fan_target_speed_ratio", (("fan", "0"), ("gpu", "0"), ("uuid", uuid)))] == 0.6
    assert s[("gpuwatch_fan_speed_rpm", (("fan", "1"), ("gpu", "0"), ("uuid", uuid)))] == 1500.0


def test_tlimit_thresholds_are_exported_on_both_scales():
    """H200 capture: 28 C, T.Limit 59, slowdown -2 => absolute slowdown 89 C; memory_max not derived."""
    features = {f: True for f in FEATURES}
    text = node(features, fast_sample(), slow_sample())
    uuid = identity(0).uuid
    s = series(text)
    absolute = {dict(k[1])["threshold"]: v for k, v in s.items() if k[0] == "gpuwatch_temperature_threshold_celsius"}
    margin = {dict(k[1])["threshold"]: v for k, v in s.items() if k[0] == "gpuwatch_temperature_margin_threshold_celsius"}
    assert absolute == {"shutdown": 95.0, "slowdown": 89.0, "gpu_max": 87.0}
    assert margin == {"shutdown": -8.0, "slowdown": -2.0, "gpu_max": 0.0, "memory_max": 0.0}
    assert s[("gpuwatch_temperature_margin_celsius", (("gpu", "0"), ("uuid", uuid)))] == 59.0


def test_absolute_thresholds_from_the_driver_win():
    features = {f: True for f in FEATURES}
    slow = slow_sample(temperature_threshold_celsius={"shutdown": 101.0, "slowdown": 96.0, "gpu_max": 90.0},
                       temperature_margin_threshold_celsius={})
    text = node(features, fast_sample(temperature_margin_celsius=None), slow)
    absolute = {dict(k[1])["threshold"]: v for k, v in series(text).items()
                if k[0] == "gpuwatch_temperature_threshold_celsius"}
    assert absolute == {"shutdown": 101.0, "slowdown": 96.0, "gpu_max": 90.0}


def test_on_a_gpu_with_both_scales_the_exported_slowdown_is_the_one_the_rules_use():
    """One definition of the thresholds: with NVML's absolute slowdown (95) and the T.Limit margin both
    reported, the exported threshold, the rules' headroom and the live view's limit agree (the margin's)."""
    from gpuwatch.live import gpu_line
    from gpuwatch.model import GpuState, slowdown_headroom

    features = {f: True for f in FEATURES}
    fast = fast_sample()
    slow = slow_sample(temperature_threshold_celsius={"shutdown": 100.0, "slowdown": 95.0, "memory_max": 95.0})
    exported = {dict(k[1])["threshold"]: v for k, v in series(node(features, fast, slow)).items()
                if k[0] == "gpuwatch_temperature_threshold_celsius"}
    headroom, slowdown = slowdown_headroom(fast, slow)
    assert exported == {"shutdown": 95.0, "slowdown": 89.0, "gpu_max": 87.0, "memory_max": 95.0}
    assert slowdown == exported["slowdown"] and headroom == slowdown - fast.thermal.temperature_celsius
    line = gpu_line(GpuState(identity(0), features, True, fast, 1000.0, slow, 1000.0), 1000.0, 6.0)
    assert f"{slowdown:.0f}" in line.split()[2]


def test_every_family_is_in_the_catalogue_with_its_labels_and_order_is_stable():
    features = {f: True for f in FEATURES}
    text = node(features, fast_sample(fans=(fan(0),)), slow_sample())
    families = list(text_string_to_metric_families(text))
    exposed = [f.name + "_total" if f.type == "counter" else f.name for f in families]
    assert exposed == sorted(exposed)
    for family, name in zip(families, exposed):
        spec = CATALOGUE[name]
        for sample in family.samples:
            assert tuple(sorted(sample.labels)) == tuple(sorted(spec.labels)), sample
    # base units only, and the contract's conventions
    for name in CATALOGUE:
        assert re.fullmatch(r"gpuwatch_[a-z0-9_]+", name)
        assert name.endswith("_total") == (CATALOGUE[name].type == "counter")


def test_fast_encoder_matches_prometheus_client_byte_for_byte():
    """gpuwatch writes the exposition itself, re-encoding only what changed; prometheus_client's
    encoders are the oracle: the same samples (from the groups' render functions, not the cache),
    in the documented order, give the same bytes, text and OpenMetrics, also after a second render
    that reuses the kept lines of what did not change."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from gpuwatch import groups
    from gpuwatch.exporter import Exposition
    from gpuwatch.exporter.render import Renderer, _gpu_core, _sort_key, build_labels
    from gpuwatch.groups import HostSample
    from gpuwatch.groups.jobs import JobUsage
    from gpuwatch.groups.joint import JOINT
    from gpuwatch.groups.kubernetes import PodAllocation
    from gpuwatch.groups.slurm import JobAllocation
    from gpuwatch.model import Anomaly, XidEvent

    clock = FakeClock()
    store = Store(clock, "scripted")
    odd = identity(1, name='NVIDIA "Quoted" \\ GPU\nnext line', serial=None)
    gpus = [DiscoveredGpu(identity(0), {f: True for f in FEATURES}), DiscoveredGpu(odd, {f: True for f in FEATURES})]
    store.set_gpus(gpus)
    store.set_backend(True)
    for gpu in gpus:
        store.put_fast(gpu.identity.uuid, fast_sample(fans=(fan(0), fan(1, speed=0.0))))
        store.put_slow(gpu.identity.uuid, slow_sample())
    store.record_xid(XidEvent(gpus[0].identity.uuid, 79, 1_700_000_100.5))
    store.put_host(HostSample(
        slurm=(JobAllocation(gpus[0].identity.uuid, "42", "alice", "devices"),),
        kubernetes=(PodAllocation(gpus[1].identity.uuid, "ml", "train-0", "main", 3),),
        jobs=(JobUsage("slurm", "42", (10.5, 2.0, 0.25), 4096, None, 8.0, 3),),
        errors=(("slurm", "scontrol_timeout"),), collected=(("slurm", 0.002, False), ("jobs", 0.001, True))))
    store.set_anomalies((Anomaly("overheating", "critical", gpus[1].identity.uuid, "1", True, 1_700_000_000.25, 2),
                         Anomaly("backend_down", "critical")), {"overheating": 2, "backend_down": 0}, {"overheating": 1})
    store.poll_finished("fast", True, 0.0123, groups={"thermal": (0.001, True), "fans": (0.002, False)})
    staleness = lambda tier: 6.0 if tier == "fast" else 90.0  # noqa: E731
    exposition = Exposition(store.snapshot, clock, staleness, process_metrics=False)

    def oracle():
        snap, now = store.snapshot(), clock.monotonic()
        rows = {}

        def collecting(prefix):
            def emit(family, labels, value):
                if value is not None:
                    rows.setdefault(family, []).append((prefix + labels, float(value)))
            return emit

        for state in snap.gpus:
            prefix = (str(state.identity.index), state.identity.uuid)
            _gpu_core(collecting(prefix), state, groups.Selection.of().features)
            fast, slow = state.fresh_fast(now, 6.0), state.fresh_slow(now, 90.0)
            host = state.fresh_host(now, 90.0)
            for group in groups.GROUPS:
                if group.render is not None:
                    group.render(collecting(prefix), *(group.select(state, fast, slow, host) if group.select else (
                        getattr(fast, group.fast) if group.fast else None,
                        getattr(slow, group.slow) if group.slow else None)))
            for unit in JOINT:
                unit.render(collecting(prefix), *unit.select(state, fast, slow, host))
        Renderer(staleness, build_labels())._node(collecting(()), snap, now, 90.0, logs.dropped_lines())
        assert {"gpuwatch_gpu_allocated", "gpuwatch_gpu_pod_info", "gpuwatch_job_cpu_seconds_total",
                "gpuwatch_collector_errors_total"} <= rows.keys()
        registry = CollectorRegistry(auto_describe=False)
        families = []
        for name in sorted(rows):
            spec = CATALOGUE[name]
            family = (CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily)(name, spec.help,
                                                                                           labels=spec.labels)
            for labels, value in sorted(rows[name], key=lambda item: _sort_key(item[0])):
                family.add_metric(labels, value)
            families.append(family)

        class Families:
            def collect(self):
                return iter(families)

        registry.register(Families())
        return generate_latest(registry).decode(), om_latest(registry).decode()

    for _ in range(2):
        text, om = oracle()
        assert exposition.render()[0].decode() == text
        assert exposition.render(openmetrics=True)[0].decode() == om
        clock.advance(2)
        store.put_fast(gpus[0].identity.uuid, fast_sample(temperature_celsius=61.0))  # the second render: one GPU changed


def test_process_metrics_match_prometheus_clients_own_encoders():
    """The process_* families are formatted by gpuwatch after their headers came from
    prometheus_client: the same text as prometheus_client's encoders, values aside."""
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    from gpuwatch.exporter.process import ProcessMetrics

    def shape(text):
        return [line if line.startswith("#") else line.split(" ")[0] for line in text.splitlines()]

    ours = ProcessMetrics()
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    theirs_text = generate_latest(registry).decode()
    theirs_om = openmetrics_latest(registry).decode().removesuffix("# EOF\n")
    for _ in range(2):  # the headers are kept from the first call on
        text, om = ours.lines(False), ours.lines(True)
        assert shape(text) == shape(theirs_text) and "process_cpu_seconds_total" in text
        assert shape(om) == shape(theirs_om) and "# TYPE process_cpu_seconds counter" in om
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["process_resident_memory_bytes"].samples[0].value > 0


def _process_values(text):
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_process_metrics_read_what_prometheus_clients_collector_reads():
    """The values read from the kept /proc/self/stat descriptor, /proc/self/fd and getrlimit are
    ProcessCollector's: the same start time, limit, descriptors and address space, the CPU time between
    two of its reads."""
    import os
    import time

    from prometheus_client import ProcessCollector

    from gpuwatch.exporter.process import ProcessMetrics

    ours = ProcessMetrics()
    assert ours._stat is not None  # Linux: the kept descriptor, not the collector

    def unused():
        raise AssertionError("the collector asked after the start")

    ours._collector.collect = unused  # type: ignore[method-assign]
    collector = ProcessCollector(registry=None)

    def theirs():
        return {s.name: s.value for f in collector.collect() for s in f.samples}

    def spend(seconds):  # CPU time to see (10 ms ticks)
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass

    spend(0.03)
    before = theirs()
    mine = _process_values(ours.lines(False))
    spend(0.03)
    after = theirs()
    again = _process_values(ours.lines(False))  # the same descriptor read again: the file made anew
    assert mine.keys() == before.keys() and len(mine) == 6
    assert mine["process_start_time_seconds"] == before["process_start_time_seconds"]
    assert mine["process_max_fds"] == before["process_max_fds"] == after["process_max_fds"]
    assert mine["process_open_fds"] == before["process_open_fds"] == len(os.listdir("/proc/self/fd"))  # each listing counts its own
    assert before["process_cpu_seconds_total"] <= mine["process_cpu_seconds_total"] <= after["process_cpu_seconds_total"]
    assert mine["process_cpu_seconds_total"] < again["process_cpu_seconds_total"]
    assert mine["process_virtual_memory_bytes"] > 0 and mine["process_resident_memory_bytes"] > 0
    assert abs(mine["process_resident_memory_bytes"] - before["process_resident_memory_bytes"]) < 64 << 20


def test_process_metrics_fall_back_to_the_collector_when_proc_cannot_be_read(monkeypatch):
    """A read of the kept descriptor that fails (or a field that is not a number) is answered by the
    collector itself, as before: the same families, nothing lost."""
    from gpuwatch.exporter import process

    ours = process.ProcessMetrics()
    assert ours._stat is not None
    asked = []
    collect = ours._collector.collect
    ours._collector.collect = lambda: asked.append(1) or collect()  # type: ignore[method-assign]
    shape = [line.split(" ")[0] for line in ours.lines(False).splitlines()]
    assert not asked and len(shape) == 18  # six families: HELP, TYPE, the sample

    def broken(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(process._Stat, "fields", broken)
    assert [line.split(" ")[0] for line in ours.lines(False).splitlines()] == shape and len(asked) == 1
    monkeypatch.setattr(process._Stat, "fields", lambda self: [b"x"] * 52)
    assert [line.split(" ")[0] for line in ours.lines(True).splitlines()] == \
        [line.split(" ")[0] for line in process.ProcessMetrics().lines(True).splitlines()] and len(asked) == 2


def test_process_metrics_ask_the_collector_for_families_they_do_not_know(monkeypatch):
    """A newer prometheus_client's collector with a family of another shape (labels) or name: the collector is
    asked every time and each family encoded as it says."""
    from prometheus_client import ProcessCollector
    from prometheus_client.core import GaugeMetricFamily

    from gpuwatch.exporter import process

    plain = ProcessCollector.collect

    def more(self):
        extra = GaugeMetricFamily("process_network_receive_bytes", "Bytes received.", labels=["device"])
        extra.add_metric(["eth0"], 42.0)
        return [*plain(self), extra]

    monkeypatch.setattr(ProcessCollector, "collect", more)
    ours = process.ProcessMetrics()
    assert ours._stat is None  # not the kept descriptor: the collector each time
    for openmetrics in (False, True):
        text = ours.lines(openmetrics)
        assert 'process_network_receive_bytes{device="eth0"} 42.0' in text and "process_cpu_seconds" in text


def test_process_metrics_close_their_descriptor_with_them():
    import gc
    import os

    from gpuwatch.exporter.process import ProcessMetrics

    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    ours = ProcessMetrics()
    assert len(os.listdir("/proc/self/fd")) == before + 1
    del ours  # no cycle through it: gone at once
    assert len(os.listdir("/proc/self/fd")) == before


def test_value_spelling_is_prometheus_clients():
    """The encoder's own float spelling (cached for whole numbers) is floatToGoString's."""
    import random

    from prometheus_client.utils import floatToGoString

    from gpuwatch.exporter.render import _value

    rng = random.Random(7)
    values = [0.0, -0.0, 1.0, -1.0, 1e6, -1e6, 999999.5, 1e-7, 123456789.0, 1.5e16, float("inf"),
              float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308, 143771 * 2.0**20]
    values += [rng.uniform(-2e6, 2e6) for _ in range(2000)] + [float(rng.randrange(10**12)) for _ in range(2000)]
    for value in values + values:  # the second time from the cache
        assert _value(value) == floatToGoString(value), value


_VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: v != 0.0 or str(v) == "0.0"),
                   st.integers(-10**7, 10**7).map(float), st.sampled_from([0.0, 1.0, 999999.0, 1e6, 123.5]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_VALUE, min_size=5, max_size=5), min_size=1, max_size=6))
def test_a_layout_spells_each_encoding_as_prometheus_client_does(encodings):
    """A layout encodes one series set again and again: whatever the values of each encoding (finite, NaN,
    infinities, 1e6 and more, equal to the last encoding's or not), every family's text is each line's
    prefix and floatToGoString of its value, in label order."""
    from prometheus_client.utils import floatToGoString

    from gpuwatch.exporter.render import _Layout

    keys = ("gpuwatch_temperature_celsius", ("memory",), "gpuwatch_temperature_celsius", ("gpu",),
            "gpuwatch_power_watts", (), "gpuwatch_clock_hertz", ("sm",), "gpuwatch_clock_hertz", ("graphics",))
    layout = _Layout(keys, ("3", "GPU-x%y"))  # a % in a label value stays one %
    for values in encodings:
        chunks = layout.encode(values)
        t = 'gpuwatch_temperature_celsius{gpu="3",sensor="%s",uuid="GPU-x%%y"} %s\n'
        c = 'gpuwatch_clock_hertz{clock="%s",gpu="3",uuid="GPU-x%%y"} %s\n'
        go = [floatToGoString(v) for v in values]
        assert chunks == {
            "gpuwatch_temperature_celsius": (t % ("gpu", go[1]) + t % ("memory", go[0])).encode(),
            "gpuwatch_power_watts": f'gpuwatch_power_watts{{gpu="3",uuid="GPU-x%y"}} {go[2]}\n'.encode(),
            "gpuwatch_clock_hertz": (c % ("graphics", go[4]) + c % ("sm", go[3])).encode()}


@pytest.mark.parametrize("module", ["isal.isal_zlib", "zlib"])
def test_gzip_body_is_one_member_and_follows_the_process_metrics_from_second_to_second(module, monkeypatch):
    """The gzip body is a single RFC 1952 member (curl and Go read it alike) whose content is
    exactly the uncompressed body, also when a later second re-compresses only the process_* tail,
    and when the uncompressed body is asked for after the gzip one let its bytes go: with ISA-L's
    deflate (x86-64, ARM64) and with the standard library's zlib (the machines isal has no wheel for)."""
    import gzip
    import zlib

    import gpuwatch.exporter
    from gpuwatch.exporter import Exposition

    monkeypatch.setattr(gpuwatch.exporter, "deflate", pytest.importorskip(module))  # isal: not on ppc64le

    clock = FakeClock()
    store = Store(clock, "scripted")
    gpus = [DiscoveredGpu(identity(i), {f: True for f in FEATURES}) for i in range(8)]
    store.set_gpus(gpus)
    store.set_backend(True)
    for gpu in gpus:
        store.put_fast(gpu.identity.uuid, fast_sample())
        store.put_slow(gpu.identity.uuid, slow_sample())
    exposition = Exposition(store.snapshot, clock, lambda tier: 6.0 if tier == "fast" else 90.0)
    for step in range(4):
        for openmetrics in (False, True):
            if step % 2:  # gzip first: the uncompressed bytes are let go, then spelled again for the plain request
                body, compressed = exposition.render(openmetrics=openmetrics, compress=True)
                assert exposition._parts[openmetrics].raw is None
                plain, was = exposition.render(openmetrics=openmetrics)
            else:
                plain, was = exposition.render(openmetrics=openmetrics)
                body, compressed = exposition.render(openmetrics=openmetrics, compress=True)
            assert compressed and not was
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            assert inflate.decompress(body) == plain and inflate.eof and inflate.unused_data == b""
            assert gzip.decompress(body) == plain and b"process_cpu_seconds" in plain
        clock.advance(1.0)  # the same snapshot, a new second: a new process_* tail
        if step == 2:
            store.put_fast(gpus[3].identity.uuid, fast_sample(temperature_celsius=70.0))


_ACCEPT_PART = st.one_of(
    st.sampled_from(["application/openmetrics-text", "text/plain", "*/*", "application/json", " text/plain "]),
    st.sampled_from(["version=1.0.0", "version=0.0.1", "version=0.0.4", "version=2.0.0", "version=1.0.0.1",
                     "version=", "escaping=allow-utf-8", "escaping=underscores", "escaping=dots", "escaping=values",
                     "escaping=bogus", "charset=utf-8", "q=0.5", " version=1.0.0", "version=10"]),
    st.text(alphabet="abcdeftxp/-=.;, 01", max_size=12))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_ACCEPT_PART, min_size=1, max_size=4).map(";".join), max_size=4).map(",".join))
def test_content_type_negotiation_is_prometheus_clients(accept):
    """gpuwatch negotiates the format without loading prometheus_client.exposition (and OpenSSL with it):
    the same answer as its choose_encoder for every Accept header it answers; where choose_encoder raises
    (a version that is not numbers) gpuwatch passes the entry over."""
    from prometheus_client.exposition import choose_encoder

    from gpuwatch.exporter import content_type

    try:
        theirs = choose_encoder(accept)[1]
    except TypeError:
        assert content_type(accept).startswith(("text/plain", "application/openmetrics-text"))
        return
    assert content_type(accept) == theirs


def test_an_accept_version_that_is_not_numbers_is_passed_over():
    from gpuwatch.exporter import content_type

    assert content_type("application/openmetrics-text; version=abc") == "text/plain; version=0.0.4; charset=utf-8"
    assert content_type("text/plain; version=1.x, application/openmetrics-text; version=1.0.0").startswith(
        "application/openmetrics-text; version=1.0.0")


def test_a_gpu_numbered_anew_is_rendered_with_its_new_index():
    """A layout is reused while a group emits the same series; the GPU's own labels are part of it: the same
    UUID under another index (a re-discovery that numbers the GPUs anew) gets every line with the new one."""
    from gpuwatch.exporter import Exposition

    clock = FakeClock()
    store = Store(clock, "scripted")
    first = identity(0, uuid="GPU-11111111-2222-3333-4444-555555555555")
    store.set_gpus([DiscoveredGpu(first, {f: True for f in FEATURES})])
    store.set_backend(True)
    store.put_fast(first.uuid, fast_sample())
    store.put_slow(first.uuid, slow_sample())
    exposition = Exposition(store.snapshot, clock, lambda tier: 6.0 if tier == "fast" else 90.0,
                            process_metrics=False)
    before = exposition.render()[0].decode()
    assert 'gpuwatch_temperature_celsius{gpu="0",sensor="gpu",uuid="GPU-11111111' in before
    renumbered = identity(3, uuid=first.uuid)
    store.set_gpus([DiscoveredGpu(renumbered, {f: True for f in FEATURES})])
    clock.advance(1.0)
    store.put_fast(first.uuid, fast_sample())
    store.put_slow(first.uuid, slow_sample())
    after = exposition.render()[0].decode()
    assert 'gpuwatch_temperature_celsius{gpu="3",sensor="gpu",uuid="GPU-11111111' in after
    assert 'gpu="0"' not in after


def test_label_values_sort_as_numbers_only_when_they_are_short_ascii_digits():
    """A label value str.isdigit() takes and int() refuses ("²", 5000 digits: a pod or job name) made every
    scrape a 500: such values sort as text, after the numbers; numbers still sort numerically."""
    from gpuwatch.exporter.render import _sort_key

    values = ["10", "9", "²", "9" * 5000, "a", "0"]
    assert sorted(values, key=lambda v: _sort_key((v,))) == ["0", "9", "10", "9" * 5000, "a", "²"]
