"""Implausible readings of the data-center groups (NVLink, C2C, GPM, MIG, the fabric) through the real pynvml binding
over the fake libnvidia-ml, and /api/v1/status never emitting NaN: a sentinel, NaN, an infinity or a value beyond
physics is left out (never exported, never latched in a counter), counted as implausible_value
(gpuwatch_poll_errors_total; the group's gpuwatch_collector_success 0) and logged once per GPU and reading; the other
readings stay, and a plausible value at a later poll is exported again."""

from __future__ import annotations

import json
import math

import fakenvml
import pytest

from gpuwatch.clock import FakeClock
from gpuwatch.poller import Poller
from gpuwatch.status import status_document
from gpuwatch.store import Store
from gpuwatch.testing import ScriptedBackend, fast_sample, registry_for
from gpuwatch.web import App

U32 = 0xFFFFFFFF
NAN = float("nan")
ALL = 0xFFFFFFFF  # scopeId: all links
BUSY_GPM = {1: 99.0, 2: 87.5, 3: 41.25, 4: 9.0, 5: 63.0, 10: 55.5, 11: 0.0, 12: 22.0, 13: 4.0, 20: 1024.0,
            21: 2048.0}


def lab(node, i, **extra):
    return dict(gpu=str(i), uuid=node.gpus[i].uuid, **extra)


def implausible(d, tier):
    return d.value("gpuwatch_poll_errors_total", error="implausible_value", tier=tier) or 0


def logged(d, what):
    """The uuids of the nvml_reading_implausible lines for ``what``, one per line."""
    return sorted(e["uuid"] for e in d.events() if e["event"] == "nvml_reading_implausible" and e["reading"] == what)


def start(inproc, node, args=()):
    d = inproc(node, args=list(args))
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.advance(1.0)
    return d


def write(d, node, seconds=3.0):
    """The node's new state, then ``seconds`` of polls (3 slow polls, 12 fast ones)."""
    d.write(node)
    d.advance(seconds)


def bad_then_good(d, node, group, tier, whats, uuids):
    """After a bad state was written: counted, the group's collection failed, each reading logged once per GPU
    (though polled again and again)."""
    assert implausible(d, tier) >= 2
    assert d.value("gpuwatch_collector_success", group=group) == 0
    for what in whats:
        assert logged(d, what) == sorted(uuids), what
    samples = [line for line in d.scrape().splitlines() if not line.startswith("#")]
    assert not [line for line in samples if line.endswith(("Inf", "NaN"))]


def test_nvlink_traffic_at_the_sentinel_or_nan_is_left_out_and_exported_again(inproc):
    node = fakenvml.FakeNode.h200(2)
    d = start(inproc, node)
    rx = d.value("gpuwatch_nvlink_traffic_bytes_total", **lab(node, 0, direction="rx"))
    assert rx == node.gpus[0].nvlink_traffic_kib[1] * 1024
    node.gpus[0].set_field((138, ALL), -1, "ull")  # 0xFFFFFFFFFFFFFFFF KiB: was 1.89e22 bytes
    node.gpus[1].set_field((138, ALL), NAN, "d")  # was NaN
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_nvlink_traffic_bytes_total", **lab(node, i, direction="tx")) is None
        assert d.value("gpuwatch_nvlink_traffic_bytes_total", **lab(node, i, direction="rx")) == \
            node.gpus[i].nvlink_traffic_kib[1] * 1024
        assert d.value("gpuwatch_nvlink_links", **lab(node, i, state="active")) == 18
        assert d.value("gpuwatch_nvlink_errors_total", **lab(node, i, error="replay")) == 0
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_traffic_tx"], [g.uuid for g in node.gpus])
    for i in (0, 1):
        node.gpus[i].set_field((138, ALL), 3_000_000 + i, "ull")
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_nvlink_traffic_bytes_total", **lab(node, i, direction="tx")) == (3_000_000 + i) * 1024
    assert d.value("gpuwatch_collector_success", group="nvlink") == 1


def test_nvlink_error_totals_beyond_a_counter_are_left_out_not_latched(inproc):
    node = fakenvml.FakeNode.h200(2)
    node.gpus[0].nvlink_errors["replay"][3] = 5
    d = start(inproc, node)
    node.gpus[0].set_field(38, -1, "ull")  # crc_flit at 0xFFFFFFFFFFFFFFFF: was exported as 1.8e19
    node.gpus[1].set_field(38, NAN, "d")  # was dropped silently
    node.gpus[1].set_field(45, -3, "sll")  # crc_data negative: was dropped silently
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_nvlink_errors_total", **lab(node, i, error="crc_flit")) is None
        assert d.value("gpuwatch_nvlink_errors_total", **lab(node, i, error="recovery")) == 0
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 1, error="crc_data")) is None
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 0, error="replay")) == 5
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_crc_flit_errors"], [g.uuid for g in node.gpus])
    assert logged(d, "nvlink_crc_data_errors") == [node.gpus[1].uuid]
    for i in (0, 1):
        node.gpus[i].set_field(38, 7, "ull")
    node.gpus[1].set_field(45, 2, "ull")
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_nvlink_errors_total", **lab(node, i, error="crc_flit")) == 7
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 1, error="crc_data")) == 2


def test_a_per_link_sum_rejects_a_one_poll_sentinel_instead_of_taking_it_for_a_reset(inproc):
    """A B200 without the NVLink5 device totals: the kind is the sum of its links' increases. One link at
    0xFFFFFFFFFFFFFFFF for a poll, then back: the kind is left out that poll, then its true count (it kept 1.8e19)."""
    node = fakenvml.FakeNode.b200(1)
    g = node.gpus[0]
    g.nvlink5_aggregate = False
    g.nvlink5_errors["recovery_successful"][4] = 3
    d = start(inproc, node)
    effective = lab(node, 0, error="effective")
    assert d.value("gpuwatch_nvlink_errors_total", **effective) == 0
    g.nvlink5_errors["effective"][0] = -1  # written as an ull: 0xFFFFFFFFFFFFFFFF
    write(d, node)
    assert d.value("gpuwatch_nvlink_errors_total", **effective) is None
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 0, error="recovery_successful")) == 3
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_effective_errors"], [g.uuid])
    g.nvlink5_errors["effective"][0] = 0
    write(d, node)
    assert d.value("gpuwatch_nvlink_errors_total", **effective) == 0
    g.nvlink5_errors["effective"][0] = 1
    g.nvlink5_errors["effective"][9] = 2
    write(d, node)
    assert d.value("gpuwatch_nvlink_errors_total", **effective) == 3
    assert logged(d, "nvlink_effective_errors") == [g.uuid]


def test_an_unknown_link_state_is_counted_and_the_link_in_neither_count(inproc):
    node = fakenvml.FakeNode.h200(1)
    d = start(inproc, node, ["--collector.nvlink.per-link"])
    assert d.value("gpuwatch_nvlink_links", **lab(node, 0, state="active")) == 18
    node.gpus[0].set_field((165, 3), 7, "ui")  # no NVML_NVLINK_STATE_*: the link vanished silently
    write(d, node)
    assert d.value("gpuwatch_nvlink_links", **lab(node, 0, state="active")) == 17
    assert d.value("gpuwatch_nvlink_links", **lab(node, 0, state="inactive")) == 0
    assert d.value("gpuwatch_nvlink_link_up", **lab(node, 0, link="3")) is None
    assert d.value("gpuwatch_nvlink_link_up", **lab(node, 0, link="4")) == 1
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 0, error="replay")) == 0
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_link_state"], [node.gpus[0].uuid])
    node.gpus[0].set_field((165, 3), 0, "ui")
    write(d, node)
    assert d.value("gpuwatch_nvlink_links", **lab(node, 0, state="inactive")) == 1
    assert d.value("gpuwatch_nvlink_link_up", **lab(node, 0, link="3")) == 0


def test_per_link_error_counters_at_the_sentinel_are_left_out(inproc):
    node = fakenvml.FakeNode.h200(1)
    node.gpus[0].nvlink_errors["replay"][2] = 4
    d = start(inproc, node, ["--collector.nvlink.per-link"])
    node.gpus[0].set_field((163, 2), -1, "ull")  # link 2's crc_flit DL counter
    write(d, node)
    assert d.value("gpuwatch_nvlink_link_errors_total", **lab(node, 0, link="2", error="crc_flit")) is None
    assert d.value("gpuwatch_nvlink_link_errors_total", **lab(node, 0, link="2", error="replay")) == 4
    assert d.value("gpuwatch_nvlink_link_errors_total", **lab(node, 0, link="3", error="crc_flit")) == 0
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_link_crc_flit_errors"], [node.gpus[0].uuid])
    node.gpus[0].set_field((163, 2), 9, "ull")
    write(d, node)
    assert d.value("gpuwatch_nvlink_link_errors_total", **lab(node, 0, link="2", error="crc_flit")) == 9


def test_an_nvlink5_bit_error_rate_at_the_sentinel_is_counted_not_dropped_silently(inproc):
    node = fakenvml.FakeNode.b200(1)
    g = node.gpus[0]
    d = start(inproc, node)
    ber = lab(node, 0, kind="effective")
    assert d.value("gpuwatch_nvlink_bit_error_ratio", **ber) == 0
    g.nvlink5_ber["effective"] = -1  # written as an ull: 0xFFFFFFFFFFFFFFFF
    write(d, node)
    assert d.value("gpuwatch_nvlink_bit_error_ratio", **ber) is None
    assert d.value("gpuwatch_nvlink_errors_total", **lab(node, 0, error="effective")) == 0
    bad_then_good(d, node, "nvlink", "slow", ["nvlink_effective_ber"], [g.uuid])
    g.nvlink5_ber["effective"] = fakenvml.pack_ber(2, 13)
    write(d, node)
    assert d.value("gpuwatch_nvlink_bit_error_ratio", **ber) == pytest.approx(2e-13)


def test_c2c_bandwidth_and_errors_beyond_bounds_are_left_out(inproc):
    node = fakenvml.FakeNode.gh200(2)
    for g in node.gpus:
        g.c2c_errors = {"crc": 5, "replay": 2, "replay_b2b": 0}
    d = start(inproc, node)
    full = 10 * 44_712e6
    assert d.value("gpuwatch_c2c_bandwidth_bytes_per_second", **lab(node, 0)) == full
    node.gpus[0].set_field((172, 0), NAN, "d")
    node.gpus[1].set_field((172, 4), U32, "ui")  # 0xFFFFFFFF MB/s: was 4.3e15 bytes/s
    node.gpus[0].set_field(231, -1, "ull")  # crc at 0xFFFFFFFFFFFFFFFF: was exported
    node.gpus[1].set_field(231, NAN, "d")  # was dropped silently
    write(d, node)
    for i in (0, 1):
        # the sum over the active links, without one, would read as a link down: the gauge is left out
        assert d.value("gpuwatch_c2c_bandwidth_bytes_per_second", **lab(node, i)) is None
        assert d.value("gpuwatch_c2c_errors_total", **lab(node, i, error="crc")) is None
        assert d.value("gpuwatch_c2c_errors_total", **lab(node, i, error="replay")) == 2
        assert d.value("gpuwatch_c2c_links", **lab(node, i, state="active")) == 10
    bad_then_good(d, node, "c2c", "slow", ["c2c_max_bandwidth", "c2c_crc_errors"], [g.uuid for g in node.gpus])
    node.gpus[0].set_field((172, 0), 44_712, "ui")
    node.gpus[1].set_field((172, 4), 44_712, "ui")
    for g in node.gpus:
        g.set_field(231, 6, "ull")
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_c2c_bandwidth_bytes_per_second", **lab(node, i)) == full
        assert d.value("gpuwatch_c2c_errors_total", **lab(node, i, error="crc")) == 6


def test_gpm_ratios_beyond_105_percent_nan_or_negative_are_left_out(inproc):
    node = fakenvml.FakeNode.h200(2)
    for g in node.gpus:
        g.gpm = dict(BUSY_GPM)
    d = start(inproc, node)
    node.gpus[0].gpm.update({2: 1e6, 5: NAN, 10: -50.0})  # were 10000, NaN, -0.5
    node.gpus[1].gpm.update({2: 104.0, 5: NAN, 10: 1e9})  # 104 %: GPM's overshoot, exported as is
    write(d, node)
    assert d.value("gpuwatch_sm_active_ratio", **lab(node, 0)) is None
    assert d.value("gpuwatch_sm_active_ratio", **lab(node, 1)) == pytest.approx(1.04)
    for i in (0, 1):
        assert d.value("gpuwatch_pipe_active_ratio", **lab(node, i, pipe="tensor")) is None
        assert d.value("gpuwatch_dram_bandwidth_ratio", **lab(node, i)) is None
        assert d.value("gpuwatch_pcie_traffic_bytes_total", **lab(node, i, direction="rx")) > 0
    bad_then_good(d, node, "gpm", "fast", ["gpm_tensor_pipe_active", "gpm_dram_bandwidth"],
                  [g.uuid for g in node.gpus])
    assert logged(d, "gpm_sm_active") == [node.gpus[0].uuid]
    for g in node.gpus:
        g.gpm = dict(BUSY_GPM)
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_sm_active_ratio", **lab(node, i)) == pytest.approx(0.875)
        assert d.value("gpuwatch_pipe_active_ratio", **lab(node, i, pipe="tensor")) == pytest.approx(0.63)
        assert d.value("gpuwatch_dram_bandwidth_ratio", **lab(node, i)) == pytest.approx(0.555)


@pytest.mark.parametrize("rates", [(math.inf, 1e300), (NAN, -5.0)])
def test_an_implausible_pcie_rate_is_never_integrated(inproc, rates):
    """An infinite PCIe rate made gpuwatch_pcie_traffic_bytes_total +Inf for ever, 1e300 MiB/s 1e304 bytes."""
    node = fakenvml.FakeNode.h200(2)
    for g in node.gpus:
        g.gpm = dict(BUSY_GPM)
    d = start(inproc, node)
    tx = [lab(node, i, direction="tx") for i in (0, 1)]
    before = [d.value("gpuwatch_pcie_traffic_bytes_total", **labels) for labels in tx]
    assert all(b > 0 for b in before)
    for g, rate in zip(node.gpus, rates):
        g.gpm[20] = rate
    write(d, node)
    for i in (0, 1):
        assert d.value("gpuwatch_pcie_traffic_bytes_total", **tx[i]) is None
        assert d.value("gpuwatch_pcie_traffic_bytes_total", **lab(node, i, direction="rx")) > 0
        assert d.value("gpuwatch_sm_active_ratio", **lab(node, i)) == pytest.approx(0.875)
    bad_then_good(d, node, "gpm", "fast", ["gpm_pcie_tx_rate"], [g.uuid for g in node.gpus])
    for g in node.gpus:
        g.gpm[20] = 1024.0
    write(d, node)
    for i in (0, 1):
        after = d.value("gpuwatch_pcie_traffic_bytes_total", **tx[i])
        # 1 GiB/s over the real seconds between GPM samples: far less than 1 TB in this test
        assert after is not None and math.isfinite(after) and before[i] < after < before[i] + 1e12


def test_mig_readings_beyond_bounds_are_left_out_the_instance_stays(inproc):
    node = fakenvml.FakeNode.h100_mig(1)
    g = node.gpus[0]
    for mig in g.mig_devices.values():
        mig.gpm = {2: 40.0, 5: 20.0, 10: 10.0}
    d = start(inproc, node)
    gi = {slot: lab(node, 0, gpu_instance=str(m.gpu_instance)) for slot, m in g.mig_devices.items()}
    assert d.value("gpuwatch_mig_sm_active_ratio", **gi[0]) == pytest.approx(0.4)
    g.mig_devices[0].gpm = {2: NAN, 5: -3.0, 10: 1e9}
    g.mig_devices[1].used = 10**15  # beyond the instance's total
    g.mig_devices[2].total = -1  # read back as an unsigned long long: 0xFFFFFFFFFFFFFFFF
    write(d, node)
    assert d.value("gpuwatch_mig_sm_active_ratio", **gi[0]) is None
    assert d.value("gpuwatch_mig_dram_bandwidth_ratio", **gi[0]) is None
    assert d.value("gpuwatch_mig_pipe_active_ratio", **gi[0], pipe="tensor") is None
    assert d.value("gpuwatch_mig_memory_used_bytes", **gi[0]) == g.mig_devices[0].used
    assert d.value("gpuwatch_mig_memory_used_bytes", **gi[1]) is None
    assert d.value("gpuwatch_mig_memory_total_bytes", **gi[1]) == g.mig_devices[1].total
    assert d.value("gpuwatch_mig_sm_active_ratio", **gi[1]) == pytest.approx(0.4)
    assert d.value("gpuwatch_mig_memory_total_bytes", **gi[2]) is None
    assert d.value("gpuwatch_mig_memory_used_bytes", **gi[2]) == g.mig_devices[2].used
    assert d.value("gpuwatch_mig_dram_bandwidth_ratio", **gi[3]) == pytest.approx(0.1)
    bad_then_good(d, node, "mig", "fast", ["mig_sm_active", "mig_dram_bandwidth", "mig_tensor_pipe_active",
                                           "mig_memory_used", "mig_memory_total"], [g.uuid])
    g.mig_devices[0].gpm = {2: 50.0, 5: 20.0, 10: 10.0}
    g.mig_devices[1].used = 1024 * 1024
    g.mig_devices[2].total = 9984 * 1024 * 1024
    write(d, node)
    assert d.value("gpuwatch_mig_sm_active_ratio", **gi[0]) == pytest.approx(0.5)
    assert d.value("gpuwatch_mig_memory_used_bytes", **gi[1]) == 1024 * 1024
    assert d.value("gpuwatch_mig_memory_total_bytes", **gi[2]) == 9984 * 1024 * 1024


def test_an_unknown_fabric_state_or_health_summary_is_counted(inproc):
    node = fakenvml.FakeNode.h200(2)
    node.gpus[1].fabric_health_summary = 1
    d = start(inproc, node)
    assert d.value("gpuwatch_fabric_health_summary", **lab(node, 1)) == 1
    node.gpus[0].fabric = (7, 0, 0, 0)
    node.gpus[1].fabric_health_summary = 9
    write(d, node)
    states = {dict(k[1])["uuid"]: dict(k[1])["state"] for k in d.metrics() if k[0] == "gpuwatch_fabric_state"}
    assert states == {node.gpus[1].uuid: "completed"}
    assert d.value("gpuwatch_fabric_health_summary", **lab(node, 1)) is None
    bad_then_good(d, node, "fabric", "slow", [], [])
    assert logged(d, "fabric_state") == [node.gpus[0].uuid]
    assert logged(d, "fabric_health") == [node.gpus[1].uuid]
    node.gpus[0].fabric = (2, 0, 0, 0)
    node.gpus[1].fabric_health_summary = 2
    write(d, node)
    states = {dict(k[1])["uuid"]: dict(k[1])["state"] for k in d.metrics() if k[0] == "gpuwatch_fabric_state"}
    assert states == {node.gpus[0].uuid: "in_progress", node.gpus[1].uuid: "completed"}
    assert d.value("gpuwatch_fabric_health_summary", **lab(node, 1)) == 2


def _strict(constant):
    raise ValueError(f"not JSON: {constant}")


def _status(app):
    answer = {}

    def start_response(status, headers):
        answer["status"], answer["headers"] = status, dict(headers)

    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/api/v1/status"}, start_response))
    assert answer["status"] == "200 OK" and answer["headers"]["Content-Type"] == "application/json"
    assert int(answer["headers"]["Content-Length"]) == len(body)
    return body


def test_the_status_document_is_json_even_with_a_non_finite_reading():
    clock = FakeClock()
    backend = ScriptedBackend(2)
    store = Store(clock, backend.name)
    poller = Poller(backend, store, clock)
    staleness = lambda tier: 6.0 if tier == "fast" else 90.0  # noqa: E731
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics", staleness)
    poller.poll_slow()
    poller.poll_fast()
    # the common path: as before, byte for byte
    plain = _status(app)
    assert plain == json.dumps(status_document(store.snapshot(), clock.monotonic(), staleness),
                               separators=(",", ":")).encode()
    uuids = [g.identity.uuid for g in backend.gpus]
    backend.fast[uuids[0]] = fast_sample(power_watts=NAN, temperature_celsius=math.inf)
    backend.fast[uuids[1]] = fast_sample(temperature_celsius=-math.inf)
    poller.poll_fast()
    document = json.loads(_status(app), parse_constant=_strict)
    gpus = {g["uuid"]: g for g in document["gpus"]}
    assert gpus[uuids[0]]["power_watts"] is None and gpus[uuids[0]]["temperature_celsius"] is None
    assert gpus[uuids[1]]["temperature_celsius"] is None and gpus[uuids[1]]["power_watts"] == 77.67
    assert document["status"] in ("ok", "warning", "critical")
