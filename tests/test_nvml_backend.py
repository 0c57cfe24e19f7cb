"""The agent over the real pynvml binding and a fake libnvidia-ml.so.1.

Each test writes the fake node's state file, starts the agent in-process on simulated time (the NVML
backend in a child process: inproc.InProc), and rewrites the state while it runs to inject faults. A
wedged call (threads, real time) and the CLI's exit status run the real `gpuwatch` process.
"""

import json
import os
import subprocess
import sys
import textwrap

import fakenvml
import pytest
from daemon import wait_for


def labels(node, i, **extra):
    return dict(gpu=str(i), uuid=node.gpus[i].uuid, **extra)


def test_healthy_h200_node(inproc):
    """8 fanless H200s: readings in base units, fans absent and marked unsupported, T.Limit thresholds."""
    node = fakenvml.FakeNode.h200(8)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    m = d.metrics()
    g0 = node.gpus[0]
    assert m[("gpuwatch_backend_up", (("backend", "nvml"),))] == 1
    assert m[("gpuwatch_gpus", ())] == 8
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == g0.temperature
    assert d.value("gpuwatch_temperature_margin_celsius", **labels(node, 0)) == g0.margin_temperature
    assert d.value("gpuwatch_power_watts", **labels(node, 3)) == node.gpus[3].power_mw / 1000
    assert d.value("gpuwatch_memory_total_bytes", **labels(node, 0)) == g0.memory_total
    assert d.value("gpuwatch_memory_reserved_bytes", **labels(node, 0)) == g0.memory_reserved
    assert d.value("gpuwatch_temperature_margin_threshold_celsius", **labels(node, 0, threshold="slowdown")) == -2
    assert d.value("gpuwatch_temperature_threshold_celsius", **labels(node, 0, threshold="slowdown")) == \
        g0.temperature + g0.margin_temperature + 2
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="fan")) == 0
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="memory_temperature")) == 1
    assert not [k for k in m if k[0].startswith("gpuwatch_fan_")]
    info = [dict(k[1]) for k in m if k[0] == "gpuwatch_gpu_info"]
    assert sorted(i["uuid"] for i in info) == sorted(g.uuid for g in node.gpus)
    assert {i["architecture"] for i in info} == {"hopper"}
    # NOT_SUPPORTED was probed once and never polled again
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetTemperatureV"] >= 8 * 4, what="the probe and 3 polls")
    counts = d.fx.counts()
    assert counts["nvmlDeviceGetNumFans"] == 8
    assert counts.get("nvmlDeviceGetFanSpeed_v2", 0) == 0
    # the power draw comes in the field-values batch (NVML_FI_DEV_POWER_AVERAGE): no call of its own
    assert counts.get("nvmlDeviceGetPowerUsage", 0) == 0


def test_consumer_card_with_two_fans(inproc):
    node = fakenvml.FakeNode.rtx(1)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    g = node.gpus[0]
    for i, (speed, target, rpm) in enumerate(zip(g.fan_speeds, g.fan_targets, g.fan_rpms)):
        assert d.value("gpuwatch_fan_speed_ratio", **labels(node, 0, fan=str(i))) == speed / 100
        assert d.value("gpuwatch_fan_target_speed_ratio", **labels(node, 0, fan=str(i))) == target / 100
        assert d.value("gpuwatch_fan_speed_rpm", **labels(node, 0, fan=str(i))) == rpm
    assert d.value("gpuwatch_temperature_threshold_celsius", **labels(node, 0, threshold="slowdown")) == 96
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="memory")) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="memory_temperature")) == 0
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="ecc")) == 0


def test_one_gpu_lost_and_back(inproc):
    node = fakenvml.FakeNode.h200(4)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    node.gpus[2].lost = True
    d.fx.write(node)
    d.wait_value("gpuwatch_gpu_up", 0, **labels(node, 2))
    assert d.value("gpuwatch_gpu_up", **labels(node, 1)) == 1
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 2, sensor="gpu")) is None
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 3, sensor="gpu")) == node.gpus[3].temperature
    assert d.value("gpuwatch_poll_success", tier="fast") == 0
    d.wait_for(lambda: (d.value("gpuwatch_poll_errors_total", tier="fast", error="gpu_is_lost") or 0) >= 2)
    lost_events = [e for e in d.events() if e["event"] == "gpu_lost"]
    assert len(lost_events) == 1 and lost_events[0]["uuid"] == node.gpus[2].uuid and lost_events[0]["gpu"] == "2"
    # liveness is about collection: a lost GPU must not make a liveness probe restart gpuwatch
    status, body = d.get("/healthz")
    assert status == 200 and body.startswith("ok: 4 GPUs"), body
    status, body = d.get("/api/v1/status")
    assert json.loads(body)["fresh"] is True
    node.gpus[2].lost = False
    d.fx.write(node)
    d.wait_value("gpuwatch_gpu_up", 1, **labels(node, 2))
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")


def test_a_gpu_lost_while_probed_is_reported_down(inproc):
    """A GPU that answers its identity but GPU_IS_LOST to a probe (it fell off the bus during discovery, as
    NVIDIA's mock NVML does it) has no reading to poll: it is down, not up with nothing to show."""
    node = fakenvml.FakeNode.h200(3)
    node.gpus[1].set_error("nvmlDeviceGetPerformanceState", 15)  # GPU_IS_LOST, probed by the power group
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 0, tier="fast")
    d.wait_value("gpuwatch_gpu_up", 0, **labels(node, 1))
    assert d.value("gpuwatch_gpu_up", **labels(node, 0)) == 1
    assert d.value("gpuwatch_gpu_up", **labels(node, 2)) == 1
    info = [dict(k[1]) for k in d.metrics() if k[0] == "gpuwatch_gpu_info"]
    assert sorted(i["gpu"] for i in info) == ["0", "1", "2"]  # identified, listed, down
    lost = [e for e in d.events() if e["event"] == "gpu_lost"]
    assert [e["gpu"] for e in lost] == ["1"], lost


def test_driver_not_loaded_then_mismatch_then_recovery(inproc):
    """The process keeps serving through init failures, logs each cause once, recovers by itself."""
    node = fakenvml.FakeNode.h200(2)
    node.init_error = 9  # DRIVER_NOT_LOADED
    d = inproc(node)
    status, body = d.get("/metrics")
    assert status == 200 and 'gpuwatch_backend_up{backend="nvml"} 0.0' in body
    status, body = d.get("/healthz")
    assert status == 503 and "Driver Not Loaded" in body
    d.wait_for(lambda: [e for e in d.events() if e.get("reason") == "driver_not_loaded"])
    node.init_error = 18  # LIB_RM_VERSION_MISMATCH: driver upgraded without reboot
    d.fx.write(node)
    d.wait_for(lambda: [e for e in d.events() if e.get("reason") == "driver_version_mismatch"])
    assert d.value("gpuwatch_backend_up", backend="nvml") == 0
    assert d.value("gpuwatch_driver_info", driver_version="590.48.01", nvml_version="13.590.48.01",
                   cuda_driver_version="13.1") is None
    node.init_error = 0
    d.fx.write(node)
    d.wait_value("gpuwatch_backend_up", 1, backend="nvml", timeout=30)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    assert d.get("/healthz")[0] == 200
    down = [e for e in d.events() if e["event"] == "backend_down"]
    assert [e["reason"] for e in down] == ["driver_not_loaded", "driver_version_mismatch"]
    assert all(e["hint"] for e in down)
    assert [e["event"] for e in d.events()].count("backend_recovered") == 1
    assert d.h.alive() is None  # the scheduler kept running the rules throughout


@pytest.mark.daemon
def test_blocked_call_makes_data_stale_not_the_endpoint(start):
    """An NVML call that does not return: /metrics keeps answering, poll_success 0, readings dropped."""
    node = fakenvml.FakeNode.h200(2)
    d = start(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    node.block("nvmlDeviceGetTemperatureV", None, gpu=1)  # blocks until the line is removed
    d.fx.write(node)
    d.wait_value("gpuwatch_temperature_celsius", None, **labels(node, 0, sensor="gpu"))
    assert d.value("gpuwatch_poll_success", tier="fast") == 0
    status, body = d.get("/healthz", timeout=2)
    assert status == 503 and "last fast poll completed" in body
    wait_for(lambda: [e for e in d.events() if e["event"] == "poll_overrun" and e["tier"] == "fast"])
    assert len([e for e in d.events() if e["event"] == "poll_overrun" and e["tier"] == "fast"]) == 1
    calls_while_blocked = d.fx.counts()["nvmlDeviceGetTemperatureV"]
    node.unblock("nvmlDeviceGetTemperatureV", gpu=1)
    d.fx.write(node)
    d.wait_value("gpuwatch_temperature_celsius", node.gpus[0].temperature, **labels(node, 0, sensor="gpu"))
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    assert d.fx.counts()["nvmlDeviceGetTemperatureV"] > calls_while_blocked


@pytest.mark.daemon
def test_a_stop_under_the_events_threads_wait_is_clean(start):
    """The events thread is inside nvmlEventSetWait (up to EVENT_WAIT_SECONDS) when the daemon stops: the stop
    neither waits for it nor reports it as a thread stuck in NVML (exit_with_busy_threads is for wedged polls),
    and NVML is not shut down under it."""
    node = fakenvml.FakeNode.l40s(1)
    d = start(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    wait_for(lambda: d.fx.counts().get("nvmlEventSetWait_v2", 0) >= 1, what="the events thread's wait")
    assert d.stop() == 0
    events = [e["event"] for e in d.events()]
    assert "stopped" in events and "exit_with_busy_threads" not in events
    assert d.fx.counts().get("nvmlShutdown", 0) == 0


def test_readings_that_do_not_change_are_asked_once_a_discovery_not_every_slow_poll(inproc):
    """The maximum clocks, the temperature thresholds, the power limit's default and range and the link's maximum
    generation and width are asked until NVML answers them plausibly, then kept until the next discovery; the
    readings that change (the enforced limit, the current link) are asked every slow poll as before."""
    node = fakenvml.FakeNode.l40s(2)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    before = d.fx.counts()
    d.advance(5)  # five slow polls (1 s)
    after = d.fx.counts()
    grew = {name: count - before.get(name, 0) for name, count in after.items()}
    assert grew["nvmlDeviceGetEnforcedPowerLimit"] >= 2 * 4 and grew["nvmlDeviceGetCurrPcieLinkWidth"] >= 2 * 4
    assert before["nvmlDeviceGetMaxClockInfo"] > 0 and before["nvmlDeviceGetMaxPcieLinkWidth"] > 0
    constant = ("nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperatureThreshold",
                "nvmlDeviceGetPowerManagementDefaultLimit", "nvmlDeviceGetPowerManagementLimitConstraints",
                "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth")
    assert {name: grew.get(name, 0) for name in constant} == dict.fromkeys(constant, 0)
    g = node.gpus[0]
    assert d.value("gpuwatch_clock_max_hertz", **labels(node, 0, clock="graphics")) == g.max_clocks[0] * 1e6
    assert d.value("gpuwatch_pcie_link_width", **labels(node, 0, link="max")) is not None
    assert d.value("gpuwatch_power_limit_watts", **labels(node, 0, limit="max")) is not None


def test_old_driver_falls_back_to_older_apis(inproc):
    node = fakenvml.FakeNode.h200(1)
    d = inproc(node, old_driver=True)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    g = node.gpus[0]
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == g.temperature
    assert d.value("gpuwatch_temperature_margin_celsius", **labels(node, 0)) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="temperature_margin")) == 0
    assert d.value("gpuwatch_memory_used_bytes", **labels(node, 0)) is not None
    assert d.value("gpuwatch_memory_reserved_bytes", **labels(node, 0)) is None
    assert d.value("gpuwatch_clocks_event_active", **labels(node, 0, reason="gpu_idle")) is not None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="clocks_event_reasons")) == 1
    counts = d.fx.counts()
    assert counts["nvmlDeviceGetTemperature"] > 1
    assert counts["nvmlDeviceGetCurrentClocksThrottleReasons"] > 1
    assert d.value("gpuwatch_poll_errors_total", tier="fast", error="function_not_found") is None


def test_not_supported_single_readings_are_absent(inproc):
    """GPU 1 has neither the average-power field nor GetPowerUsage, nor the memory temperature: absent,
    feature 0. GPU 2 lacks only the field (a driver before R535): its power comes from GetPowerUsage."""
    node = fakenvml.FakeNode.h200(3)
    node.gpus[1].set_error("nvmlDeviceGetPowerUsage", 3)
    node.gpus[1].set_field_error(185, 3)  # NVML_FI_DEV_POWER_AVERAGE
    node.gpus[1].set_field_error(82, 3)  # memory temperature
    node.gpus[2].set_field_error(185, 3)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    assert d.value("gpuwatch_power_watts", **labels(node, 2)) == node.gpus[2].power_mw / 1000
    assert d.fx.counts()["nvmlDeviceGetPowerUsage"] >= 2  # GPU 1's probe and GPU 2's polls
    assert d.value("gpuwatch_power_watts", **labels(node, 1)) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 1, feature="power")) == 0
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 1, sensor="memory")) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 1, feature="memory_temperature")) == 0
    assert d.value("gpuwatch_power_watts", **labels(node, 0)) == node.gpus[0].power_mw / 1000
    # a reading that fails with another error later is counted, not marked unsupported
    node.gpus[0].set_error("nvmlDeviceGetUtilizationRates", 999)
    d.fx.write(node)
    d.wait_for(lambda: d.value("gpuwatch_poll_errors_total", tier="fast", error="unknown"))
    assert d.value("gpuwatch_utilization_ratio", **labels(node, 0, engine="gpu")) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="utilization")) == 1


def test_xid_event_becomes_a_counter(inproc):
    node = fakenvml.FakeNode.h200(2)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    assert d.value("gpuwatch_xid_events_total", **labels(node, 1)) == 0
    assert d.value("gpuwatch_xid_errors_total", **labels(node, 1, xid="79")) is None
    node.add_xid(gpu=1, xid=79)
    d.fx.write(node)
    d.wait_value("gpuwatch_xid_errors_total", 1, **labels(node, 1, xid="79"))
    assert d.value("gpuwatch_xid_events_total", **labels(node, 1)) == 1
    assert d.value("gpuwatch_xid_last_timestamp_seconds", **labels(node, 1, xid="79")) > 1.7e9
    assert d.value("gpuwatch_xid_events_total", **labels(node, 0)) == 0
    assert d.value("gpuwatch_xid_errors_total", **labels(node, 0, xid="79")) is None
    events = [e for e in d.events() if e["event"] == "xid_event"]
    assert len(events) == 1 and events[0]["xid"] == 79 and events[0]["gpu"] == "1"
    # the one XID table says what it is and what to do (stable keys of the log event)
    assert (events[0]["meaning"], events[0]["xid_severity"], events[0]["action"]) == (
        "GPU has fallen off the bus", "critical", "reboot the node; contact support if it recurs")
    node.add_xid(gpu=0, xid=999)  # a code the table does not know: unknown, never a guess
    d.fx.write(node)
    d.wait_value("gpuwatch_xid_errors_total", 1, **labels(node, 0, xid="999"))
    unknown = d.wait_for(lambda: [e for e in d.events() if e["event"] == "xid_event" and e["xid"] == 999],
                       what="the xid_event of 999")
    assert (unknown[0]["meaning"], unknown[0]["action"]) == ("unknown XID", "see NVIDIA's Xid catalog")


def test_a_gpu_that_refuses_the_xid_registration_says_so(inproc):
    """A GPU that answers the event types but refuses nvmlDeviceRegisterEvents delivers no XID: its
    xid_events feature is 0 and it shows no XID counter at 0 (no false reassurance); the others keep theirs."""
    node = fakenvml.FakeNode.h200(2)
    node.gpus[1].set_error("nvmlDeviceRegisterEvents", 3)  # NVML_ERROR_NOT_SUPPORTED
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 1, feature="xid_events")) == 0
    assert d.value("gpuwatch_xid_events_total", **labels(node, 1)) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="xid_events")) == 1
    assert d.value("gpuwatch_xid_events_total", **labels(node, 0)) == 0


def test_a_disabled_group_makes_no_nvml_call_and_exports_nothing(inproc):
    """--no-collector.<group>: not probed, not read (the fake library counts every call), no feature
    series and no metric; the enabled groups go on as usual and report their own success."""
    node = fakenvml.FakeNode.from_profiles(["rtx", "h200"])  # the RTX has fans
    node.gpus[0].add_process(4242, 2**30)
    d = inproc(node, args=["--no-collector.clocks", "--no-collector.fans", "--no-collector.processes",
                          "--no-collector.xid", "--no-collector.ecc", "--no-collector.c2c"])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetTemperatureV"] >= 2 * 4, what="the probe and 3 polls")
    counts = d.fx.counts()
    silent = ["nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetCurrentClocksEventReasons",
              "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetNumFans", "nvmlDeviceGetFanSpeed_v2",
              "nvmlDeviceGetTargetFanSpeed", "nvmlDeviceGetComputeRunningProcesses_v3",
              "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents", "nvmlEventSetCreate",
              "nvmlEventSetWait_v2", "nvmlDeviceGetC2cModeInfoV"]
    assert {name: counts.get(name, 0) for name in silent} == dict.fromkeys(silent, 0)
    m = d.metrics()
    families = {name for name, _ in m}
    for gone in ("gpuwatch_clock_hertz", "gpuwatch_clocks_event_active", "gpuwatch_fan_speed_ratio",
                 "gpuwatch_gpu_job_info", "gpuwatch_xid_events_total", "gpuwatch_ecc_errors_total"):
        assert gone not in families, gone
    features = {dict(k[1])["feature"] for k in m if k[0] == "gpuwatch_gpu_feature_supported"}
    # the H200's data-center hardware (GPM, NVLink, the fabric) has no feature series: its own series say it
    assert features == {"energy", "memory_temperature", "pcie", "power", "power_limit", "temperature_margin",
                        "utilization", "recovery_action"}
    groups_seen = {dict(k[1])["group"]: v for k, v in m.items() if k[0] == "gpuwatch_collector_success"}
    assert groups_seen == {"thermal": 1, "power": 1, "utilization": 1, "memory": 1, "pcie": 1, "gpm": 1,
                           "nvlink": 1, "fabric": 1, "mig": 1, "recovery": 1, "jobs": 1}  # jobs: no NVML, no job here
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == node.gpus[0].temperature


def test_the_energy_counter_is_read_by_the_slow_tier_and_carried_by_the_fast_samples(inproc):
    """Field 83 costs ~3 ms of CPU per read on a real H200 (docs/hardware.md): it is read at discovery and by
    each slow poll, and the fast polls in between export the latest value, not a fresh read."""
    node = fakenvml.FakeNode.h200(1)
    g = node.gpus[0]
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_energy_joules_total", **labels(node, 0)) == g.energy_mj / 1000
    before = g.energy_mj
    g.energy_mj, g.power_mw = before + 4_000_000, g.power_mw + 50_000
    d.fx.write(node)
    d.wait_value("gpuwatch_power_watts", g.power_mw / 1000, **labels(node, 0))  # a fast poll saw the new state
    assert d.value("gpuwatch_energy_joules_total", **labels(node, 0)) == before / 1000
    d.advance(d.config.poll_slow_interval)
    d.wait_value("gpuwatch_energy_joules_total", g.energy_mj / 1000, **labels(node, 0))
    assert d.value("gpuwatch_poll_errors_total", tier="slow", error="not_supported") is None


def test_a_field_that_answers_only_in_the_discoverys_big_batch_is_not_read(inproc):
    """Seen on a real H200 (R580.159): the power-smoothing lifetime (field 258) answered a double 0.0 in the
    discovery's one batch of every field, NOT_SUPPORTED alone and in the slow tier's batch, so every slow poll
    counted an error and gpuwatch_collector_success{group="power"} stayed 0. A moved field is confirmed alone."""
    node = fakenvml.FakeNode.h200(1, driver_version="580.159.04", nvml_version="13.580.159.04")
    g = node.gpus[0]
    g.nvlink_states, g.fabric = [], None  # as that machine: one H200 passed through to a VM, no NVLink
    g.set_field(258, 0.0, type="d")
    g.field_min_batch[258] = 20  # the discovery asks 35 ids at once, the slow tier 15
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.advance(d.config.poll_slow_interval)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_collector_success", group="power") == 1
    assert d.value("gpuwatch_poll_errors_total", tier="slow", error="not_supported") is None
    assert d.value("gpuwatch_power_smoothing_lifetime_remaining_ratio", **labels(node, 0)) is None
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="power_smoothing")) is None


def test_a_failing_reading_marks_its_group_not_the_others(inproc):
    """An error in one group's call on one GPU: that group's collector_success is 0, the others 1."""
    node = fakenvml.FakeNode.h200(2)
    node.gpus[1].set_error("nvmlDeviceGetUtilizationRates", 999)  # UNKNOWN
    d = inproc(node)
    d.wait_value("gpuwatch_collector_success", 0, group="utilization")
    assert d.value("gpuwatch_collector_success", group="thermal") == 1
    assert d.value("gpuwatch_collector_success", group="clocks") == 1
    assert d.value("gpuwatch_collector_duration_seconds", group="thermal") > 0
    assert d.value("gpuwatch_utilization_ratio", **labels(node, 0, engine="gpu")) is not None


def test_field_values_read_in_one_unpack_follow_every_change_of_value_type_and_error(inproc):
    """After an answer in which every entry succeeded, a tier's field-values answer is read with one struct
    unpack in those value types (calls.Batch.values); an answer of another shape is read entry by entry: a
    value type that changes is read in its new type, a failing entry is counted and left out while the other
    entries are read, and each poll's values are that poll's."""
    node = fakenvml.FakeNode.h200(1)
    g = node.gpus[0]
    d = inproc(node)
    memory = labels(node, 0, sensor="memory")
    d.wait_value("gpuwatch_temperature_celsius", g.memory_temperature, **memory)
    for celsius in (40, 41):  # the learnt layout (field 82 an unsigned int) reads every new value
        g.memory_temperature = celsius
        d.fx.write(node)
        d.wait_value("gpuwatch_temperature_celsius", celsius, **memory)
    g.set_field(82, 41.5, type="d")  # the driver answers a double now: read in its new type, then learnt
    d.fx.write(node)
    d.wait_value("gpuwatch_temperature_celsius", 41.5, **memory)
    g.set_field(82, 43.25, type="d")
    d.fx.write(node)
    d.wait_value("gpuwatch_temperature_celsius", 43.25, **memory)
    g.set_field_error(82, 999)  # UNKNOWN in that entry only
    g.power_mw += 25_000  # another entry of the same batch (field 185) moves meanwhile
    d.fx.write(node)
    d.wait_value("gpuwatch_power_watts", g.power_mw / 1000, **labels(node, 0))
    d.wait_value("gpuwatch_temperature_celsius", None, **memory)
    assert d.value("gpuwatch_collector_success", group="thermal") == 0
    assert d.value("gpuwatch_poll_errors_total", tier="fast", error="unknown") >= 1
    g.field_errors.clear()
    g.set_field(82, 44.0, type="d")
    d.fx.write(node)
    d.wait_value("gpuwatch_temperature_celsius", 44.0, **memory)
    d.wait_value("gpuwatch_collector_success", 1, group="thermal")


@pytest.mark.daemon
def test_a_library_copied_as_a_text_file_says_how_to_link_it(tmp_path):
    """A copy that turned the libnvidia-ml.so.1 symlink into a text file naming the real library (as NVIDIA's
    mock arrives in shared/): NVML cannot be loaded, and the hint names the file and the link that mends it."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libnvidia-ml.so.550.163.01").write_bytes(b"\x7fELF not really")
    (lib / "libnvidia-ml.so.1").write_text("libnvidia-ml.so.550.163.01")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "FAKE_NVML"))}
    env["LD_LIBRARY_PATH"] = str(lib)
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "once", "--log.format", "json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    (down,) = [json.loads(line) for line in result.stderr.splitlines()
               if line.startswith("{") and json.loads(line)["event"] == "backend_down"]
    assert down["reason"] == "library_not_found"
    assert f"{lib / 'libnvidia-ml.so.1'} is not a library but a text file naming libnvidia-ml.so.550.163.01" \
        in down["hint"]
    assert f"ln -sf {lib / 'libnvidia-ml.so.550.163.01'} /tmp/nvml/libnvidia-ml.so.1" in down["hint"]


@pytest.mark.daemon
def test_a_library_copied_as_a_text_file_is_followed_as_the_link_it_was(tmp_path):
    """The same copy where the file it names is a real library (NVIDIA's mock in shared/): gpuwatch loads that
    library as the link would have, says once how to mend the copy, and monitors the GPUs."""
    fx = fakenvml.prepare(tmp_path / "fx", fakenvml.FakeNode.l40s(2))
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libnvidia-ml.so.570.1").write_bytes((fx.lib_dir / "libnvidia-ml.so.1").read_bytes())
    (lib / "libnvidia-ml.so.1").write_text("libnvidia-ml.so.570.1")
    env = {k: v for k, v in fx.env.items() if not k.startswith("GPUWATCH_")}
    env["LD_LIBRARY_PATH"] = str(lib)
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "once", "--log.format", "json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    (copied,) = [e for e in events if e["event"] == "nvml_library_copied_symlink"]
    assert copied["library"] == str(lib / "libnvidia-ml.so.570.1")
    assert f"ln -sf {lib / 'libnvidia-ml.so.570.1'} /tmp/nvml/libnvidia-ml.so.1" in copied["hint"]
    assert not [e for e in events if e["event"] == "backend_down"]
    assert result.stdout.count("gpuwatch_gpu_up{") == 2


def test_ctypes_layouts_are_made_once_not_per_reader():
    """A ctypes class is a graph that only a full collection frees: readers made again at every MIG
    reconfiguration and discovery (GPM samplers, fabric readers) share one class per layout."""
    import pynvml as N

    from gpuwatch.backends.nvml.gpm import _metrics_get_type
    from gpuwatch.backends.nvml.structs import plain

    assert plain(N.c_nvmlGpuFabricInfo_t) is plain(N.c_nvmlGpuFabricInfo_t)
    assert _metrics_get_type() is _metrics_get_type()


def test_a_gpm_metric_the_driver_leaves_unanswered_is_absent_not_the_previous_gpus():
    """The metrics request is shared by a thread's GPUs (gpm._request_for): each call starts from a pristine
    copy, so a slot the driver does not write for this GPU reads as unanswered, whatever the GPU before it
    got there. The driver here is a stand-in that answers only the slots it is told to."""
    import ctypes

    import pynvml as N

    from gpuwatch.backends.nvml.gpm import GpmPair, _metrics_get_type

    answers: dict[int, float] = {}
    sample = dict(_metrics_get_type()._fields_)["sample1"]  # the driver's sample handle type

    def metrics_get(pointer):
        request = pointer._obj
        for slot in request.metrics[: request.numMetrics]:
            if slot.metricId in answers:
                slot.nvmlReturn, slot.value = N.NVML_SUCCESS, answers[slot.metricId]
        return N.NVML_SUCCESS

    def sampler(handle):
        pair = GpmPair(handle, (1, 2, 3))
        pair._samples = [sample(), sample()]  # as allocated: no driver here
        pair._sample_get = lambda *_: N.NVML_SUCCESS
        pair._metrics_get = metrics_get
        assert pair() is None  # the first sample: no interval yet
        return pair

    a, b = sampler(ctypes.c_void_p(10)), sampler(ctypes.c_void_p(11))
    answers.update({1: 50.0, 2: 25.0, 3: 12.5})
    assert a()[0] == {1: 50.0, 2: 25.0, 3: 12.5}
    answers.clear()
    answers[1] = 7.0  # this GPU's driver answers metric 1 only
    assert b()[0] == {1: 7.0}


@pytest.mark.daemon
def test_a_close_during_an_event_wait_leaves_nvml_to_the_waiter(tmp_path):
    """A stop does not wait for the events thread's wait (up to EVENT_WAIT_SECONDS): close() returns while a
    thread is inside nvmlEventSetWait, without shutting NVML down or freeing the set under it (nvml.md §12).
    When the wait returns it frees the set and shuts NVML down itself, as often as it was closed: a
    re-initialisation under a wait (the driver went away and came back) leaked the set, and the descriptors it
    holds, for good. An open() in between keeps its own initialisation, and its new set reports the events: the
    old one's are not delivered (they would count twice). A close with no wait in progress frees the set and
    shuts NVML down."""
    node = fakenvml.FakeNode.l40s(1)
    fx = fakenvml.prepare(tmp_path, node)
    script = textwrap.dedent("""
        import json, os, sys, threading, time
        from gpuwatch.backends.nvml.backend import NvmlBackend
        def watches():  # the fake's event sets hold an inotify descriptor from their first wait to their free
            links = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            return links.count("anon_inode:inotify")
        b = NvmlBackend()
        b.open(); b.discover()
        got = []
        waiter = threading.Thread(target=lambda: got.append(b.wait_events(60)), daemon=True)
        waiter.start()
        sys.stdin.readline()  # the parent saw the wait begin
        deadline = time.monotonic() + 10
        while not watches() and time.monotonic() < deadline:  # and make its set's watch
            time.sleep(0.01)
        for _ in range(2):  # two re-initialisations while the wait goes on
            b.close()
            b.open(); b.discover()
        print(json.dumps({"waiting": waiter.is_alive(), "sets": watches()}), flush=True)
        sys.stdin.readline()  # the parent queued an XID: the wait returns
        waiter.join(30)
        print(json.dumps({"ended": not waiter.is_alive(), "got": [e.xid for e in got[0]], "sets": watches()}),
              flush=True)
        sys.stdin.readline()
        again = [e.xid for e in b.wait_events(5)]  # the new set's first wait
        b.close()  # no wait in progress
        print(json.dumps({"got": again, "sets": watches()}), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**fx.env, "FAKE_NVML_RECHECK_MS": "0"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def step() -> dict:
        proc.stdin.write("\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        return json.loads(line)

    try:
        wait_for(lambda: fx.counts().get("nvmlEventSetWait_v2", 0) >= 1, what="the wait to begin")
        assert step() == {"waiting": True, "sets": 1}  # close() returned under the wait; the new sets not waited on
        counts = fx.counts()
        assert (counts.get("nvmlShutdown", 0), counts.get("nvmlEventSetFree", 0)) == (0, 0)
        assert (counts["nvmlInitWithFlags"], counts["nvmlEventSetCreate"]) == (3, 3)
        node.add_xid(gpu=0, xid=48)
        node.write(fx.state_path)
        assert step() == {"ended": True, "got": [], "sets": 0}  # the first set's XID is not delivered: freed
        counts = fx.counts()
        assert (counts["nvmlShutdown"], counts["nvmlEventSetFree"]) == (2, 2)  # the two left, and their inits
        assert step() == {"got": [48], "sets": 0}  # the XID, once, from the set of the last discovery
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        counts = fx.counts()
        assert (counts["nvmlShutdown"], counts["nvmlEventSetFree"], counts["nvmlInitWithFlags"]) == (3, 3, 3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.daemon
@pytest.mark.parametrize("kind, idle", [("l40s", ["fans", "gpm", "mig"]), ("rtx", ["gpm", "mig"]),
                                        ("h200", ["fans", "mig"]),
                                        ("h100_mig", ["fans", "gpm"])])  # MIG on: GPM per instance (the mig group)
def test_a_group_with_nothing_to_read_on_a_gpu_is_left_out_of_its_fast_polls(tmp_path, kind, idle):
    """A reader that says ``idle_fast`` (no fans, no GPM, MIG off) is not called at the fast polls: its reading
    stays FastSample's default, which is what its read would have returned, and it has no timing entry (the
    poll's gpuwatch_collector_* for the group: 0 s, succeeded). The groups that have something are read."""
    node = getattr(fakenvml.FakeNode, kind)(1)
    fx = fakenvml.prepare(tmp_path, node)
    script = textwrap.dedent("""
        import json
        from gpuwatch.backends.nvml.backend import NvmlBackend
        from gpuwatch.backends.nvml.funnel import Probe, Query
        from gpuwatch.groups import FastSample
        b = NvmlBackend()
        b.open(); b.discover()
        uuid, gpu = next(iter(b._devices.items()))
        default = FastSample()
        idle, same = [], []
        for group in b._groups:
            if group.fast is None:
                continue
            dev = Probe(gpu.handle, b._probe_fields(gpu.handle), b._options, b._numbering, gpu.identity)
            dev.group = group.name  # as NvmlBackend._probe does
            reader = group.nvml(dev)
            if getattr(reader, "idle_fast", False):
                idle.append(group.name)
                read = reader.read_fast(Query(uuid, gpu.implausible, gpu.index))
                same.append(read == getattr(default, group.fast))
        sample = b.read_fast(uuid)
        print(json.dumps({"idle": idle, "same": same, "polled": [name for name, *_ in gpu.reads["fast"]],
                          "timed": [name for name, _, _ in sample.collected],
                          "defaults": [getattr(sample, g.fast) == getattr(default, g.fast)
                                       for g in b._groups if g.name in idle],
                          "fans": len(sample.fans), "gpm": sample.gpm.sm_active_ratio is not None}))
        b.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=fx.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(r["idle"]) == sorted(idle)
    assert r["same"] == [True] * len(idle)  # the default left in the sample is what the read returns
    assert r["defaults"] == [True] * len(idle)
    assert not set(idle) & set(r["polled"]) and not set(idle) & set(r["timed"])
    assert {"thermal", "power", "clocks", "memory", "utilization"} <= set(r["polled"]) == set(r["timed"])
    assert ("fans" in r["polled"]) == (r["fans"] > 0) == ("fans" not in idle)
    assert ("gpm" in r["polled"]) == r["gpm"] == ("gpm" not in idle)
