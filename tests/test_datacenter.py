"""Data-center depth through the agent (in-process, simulated time), the real pynvml binding and the fake library: GPM
profiling metrics, NVLink, the NVSwitch fabric; and that GPUs without them make no such calls."""

import fakenvml
import pytest

MIB = 1024 * 1024
# a GPU under load: NVML_GPM_METRIC_* id -> value (%, PCIe MiB/s)
BUSY_GPM = {1: 99.0, 2: 87.5, 3: 41.25, 4: 9.0, 5: 63.0, 10: 55.5, 11: 0.0, 12: 22.0, 13: 4.0, 20: 1024.0,
            21: 2048.0}


def labels(node, i, **extra):
    return dict(gpu=str(i), uuid=node.gpus[i].uuid, **extra)


def fabric(d, node, i):
    """The labels of GPU i's one gpuwatch_fabric_state series (its value is always 1), or None."""
    found = [dict(k[1]) for k, v in d.metrics().items() if k[0] == "gpuwatch_fabric_state"
             and dict(k[1])["uuid"] == node.gpus[i].uuid and v == 1]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_hgx_node_shows_gpm_nvlink_and_fabric(inproc):
    node = fakenvml.FakeNode.h200(2)
    busy = node.gpus[0]
    busy.gpm = dict(BUSY_GPM)
    busy.nvlink_errors["replay"][3] = 5
    busy.nvlink_errors["replay"][7] = 2
    busy.nvlink_errors["crc_flit"][0] = 11
    busy.nvlink_errors["recovery"][17] = 1
    d = inproc(node, args=["--collector.gpm.detail"])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    g0 = labels(node, 0)
    # GPM ratios: the fake's values over every pair of samples, as fractions
    assert d.value("gpuwatch_sm_active_ratio", **g0) == pytest.approx(0.875)
    assert d.value("gpuwatch_sm_occupancy_ratio", **g0) == pytest.approx(0.4125)
    assert d.value("gpuwatch_graphics_engine_active_ratio", **g0) == pytest.approx(0.99)
    assert d.value("gpuwatch_dram_bandwidth_ratio", **g0) == pytest.approx(0.555)
    pipes = {"tensor": 0.63, "fp64": 0.0, "fp32": 0.22, "fp16": 0.04, "integer": 0.09}
    for pipe, ratio in pipes.items():
        assert d.value("gpuwatch_pipe_active_ratio", **labels(node, 0, pipe=pipe)) == pytest.approx(ratio), pipe
    assert d.value("gpuwatch_sm_active_ratio", **labels(node, 1)) == 0  # idle, not absent
    # PCIe bytes integrated from the rates: rx at twice tx's rate over the same intervals (one scrape: a poll
    # between two would add to one of them only), growing
    scraped = d.metrics()
    tx, rx = (scraped[("gpuwatch_pcie_traffic_bytes_total", tuple(sorted(labels(node, 0, direction=way).items())))]
              for way in ("tx", "rx"))
    assert tx > 0 and rx == pytest.approx(2 * tx, rel=1e-9)
    d.wait_for(lambda: d.value("gpuwatch_pcie_traffic_bytes_total", **labels(node, 0, direction="tx")) > tx,
             what="the PCIe counter to grow")
    # NVLink: 18 links active, the driver's totals, traffic in bytes
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="active")) == 18
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="inactive")) == 0
    errors = {"replay": 7, "crc_flit": 11, "recovery": 1, "crc_data": 0, "ecc_data": 0}
    for error, count in errors.items():
        assert d.value("gpuwatch_nvlink_errors_total", **labels(node, 0, error=error)) == count, error
    assert d.value("gpuwatch_nvlink_traffic_bytes_total", **labels(node, 0, direction="tx")) == \
        busy.nvlink_traffic_kib[0] * 1024
    assert d.value("gpuwatch_nvlink_link_up", **labels(node, 0, link="0")) is None  # per-link is opt-in
    # fabric: registration completed, successfully; the capture's health N/A is absent
    assert fabric(d, node, 1) == labels(node, 1, state="completed", clique_id="0",
                                        cluster_uuid="00000000-0000-0000-0000-000000000000")
    m = d.metrics()
    assert not [k for k in m if k[0] == "gpuwatch_fabric_health_issue"]
    # a class of hardware has no feature series: the series above say the GPU has GPM, NVLink and a fabric
    assert not [k for k in m if k[0] == "gpuwatch_gpu_feature_supported"
                and dict(k[1])["feature"] in ("gpm", "nvlink", "fabric", "mig")]
    # GPM costs 2 calls per GPU and fast poll (one sample, one metrics get), the probe took the first sample
    d.stop()
    counts = d.fx.counts()
    polls = counts["nvmlDeviceGetTemperatureV"]  # once per GPU at discovery and per fast poll
    assert abs(counts["nvmlGpmSampleGet"] - polls) <= 2
    assert abs(counts["nvmlGpmMetricsGet"] - (polls - 2)) <= 2
    assert counts["nvmlGpmSampleAlloc"] == 4  # two per GPU, once
    assert counts["nvmlGpmSampleFree"] == 4  # freed before NVML shut down


def test_pcie_cards_have_no_gpm_nvlink_or_fabric_and_are_not_asked_again(inproc):
    node = fakenvml.FakeNode.l40s(2)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    m = d.metrics()
    gone = ("gpuwatch_sm_active_ratio", "gpuwatch_pcie_traffic_bytes_total", "gpuwatch_nvlink_links",
            "gpuwatch_nvlink_errors_total", "gpuwatch_fabric_state")
    assert not [k for k in m if k[0] in gone]
    at_discovery = d.fx.counts()
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetTemperatureV"] >= at_discovery["nvmlDeviceGetTemperatureV"] + 6,
             what="three more polls")
    d.stop()
    counts = d.fx.counts()
    assert counts.get("nvmlGpmSampleGet", 0) == 0 and counts.get("nvmlGpmMetricsGet", 0) == 0
    assert counts["nvmlGpmQueryDeviceSupport"] == 2  # probed once per GPU
    assert counts["nvmlDeviceGetGpuFabricInfoV"] == 2 and counts["nvmlDeviceGetGpuFabricInfo"] == 2


def test_gpm_defaults_stay_within_the_series_budget(inproc):
    """At defaults GPM exports SM activity, the tensor pipe, DRAM and PCIe (what dcgm-exporter has on by
    default, plus SM activity); occupancy, the graphics engine and the FP/integer pipes need
    --collector.gpm.detail."""
    node = fakenvml.FakeNode.h200(1)
    node.gpus[0].gpm = dict(BUSY_GPM)
    d = inproc(node)
    d.wait_value("gpuwatch_sm_active_ratio", 0.875, **labels(node, 0))
    assert d.value("gpuwatch_pipe_active_ratio", **labels(node, 0, pipe="tensor")) == pytest.approx(0.63)
    assert d.value("gpuwatch_dram_bandwidth_ratio", **labels(node, 0)) == pytest.approx(0.555)
    m = d.metrics()
    assert not [k for k in m if k[0] in ("gpuwatch_sm_occupancy_ratio", "gpuwatch_graphics_engine_active_ratio")]
    assert {dict(k[1])["pipe"] for k in m if k[0] == "gpuwatch_pipe_active_ratio"} == {"tensor"}


def test_link_down_per_link_detail_and_a_failing_gpm_metric(inproc):
    node = fakenvml.FakeNode.h200(1)
    g = node.gpus[0]
    g.gpm = dict(BUSY_GPM)
    del g.gpm[3]  # the GPU does not report occupancy: that metric alone is absent
    g.nvlink_errors["replay"][3] = 4
    d = inproc(node, args=["--collector.nvlink.per-link", "--collector.gpm.detail"])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_nvlink_link_up", **labels(node, 0, link="5")) == 1
    assert d.value("gpuwatch_nvlink_link_errors_total", **labels(node, 0, link="3", error="replay")) == 4
    assert d.value("gpuwatch_nvlink_link_errors_total", **labels(node, 0, link="17", error="crc_flit")) == 0
    assert d.value("gpuwatch_sm_occupancy_ratio", **labels(node, 0)) is None
    assert d.value("gpuwatch_graphics_engine_active_ratio", **labels(node, 0)) == pytest.approx(0.99)
    assert d.value("gpuwatch_sm_active_ratio", **labels(node, 0)) == pytest.approx(0.875)
    g.nvlink_states[5] = 0
    d.fx.write(node)
    d.wait_value("gpuwatch_nvlink_link_up", 0, **labels(node, 0, link="5"))
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="inactive")) == 1
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="active")) == 17


def test_gpus_polled_through_one_shared_gpm_request_keep_their_own_values(inproc):
    """The GPM metrics request is one per thread (gpm._request_for), not one per GPU: a metric one GPU
    does not answer stays absent there, never the value the GPU before it answered; in another thread
    the request is another."""
    import threading

    from gpuwatch.backends.nvml.gpm import _request_for

    node = fakenvml.FakeNode.h200(3)
    node.gpus[0].gpm = dict(BUSY_GPM)
    node.gpus[1].gpm = {k: v for k, v in BUSY_GPM.items() if k != 3}  # no occupancy on this one
    d = inproc(node, args=["--collector.gpm.detail"])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.wait_for(lambda: d.value("gpuwatch_sm_active_ratio", **labels(node, 1)) is not None, what="GPM on GPU 1")
    assert d.value("gpuwatch_sm_occupancy_ratio", **labels(node, 0)) == pytest.approx(0.4125)
    assert d.value("gpuwatch_sm_occupancy_ratio", **labels(node, 1)) is None
    assert d.value("gpuwatch_sm_active_ratio", **labels(node, 1)) == pytest.approx(0.875)
    assert d.value("gpuwatch_sm_active_ratio", **labels(node, 2)) == 0
    ids = (1, 2, 3)
    here = _request_for(ids)
    there: list = []
    worker = threading.Thread(target=lambda: there.append(_request_for(ids)))
    worker.start()
    worker.join()
    assert _request_for(ids)[0] is here[0] and there[0][0] is not here[0]


def test_fabric_states_status_and_health(inproc, tmp_path):
    node = fakenvml.FakeNode.h200(1)
    g = node.gpus[0]
    g.fabric = (1, 0, 0, 0)  # NOT_STARTED: the fabric manager has not registered the GPU
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {fabric_not_ready: {hold: 0}, fabric_degraded: {hold: 0}}\n")
    d = inproc(node, args=["--config", str(config)])
    d.wait_for(lambda: (fabric(d, node, 0) or {}).get("state") == "not_started", what="not_started")
    d.wait_value("gpuwatch_anomaly", 1, rule="fabric_not_ready", severity="critical", **labels(node, 0))
    degraded_true, unhealthy_false = 1 << 0, 2 << 4
    g.fabric = (3, 999, 7, degraded_true | unhealthy_false)  # completed with NVML_ERROR_UNKNOWN
    g.fabric_cluster_uuid = "0123456789abcdef0123456789abcdef"
    d.fx.write(node)
    d.wait_for(lambda: (fabric(d, node, 0) or {}).get("state") == "completed", what="completed")
    # completed with an error: still not ready, and the summary says which error
    d.wait_for(lambda: any(e["event"] == "anomaly_started" and e["rule"] == "fabric_degraded" for e in d.events()),
             what="fabric_degraded")
    assert d.value("gpuwatch_anomaly", rule="fabric_not_ready", severity="critical", **labels(node, 0)) == 1
    started = [e for e in d.events() if e["event"] == "anomaly_started" and e["rule"] == "fabric_not_ready"]
    assert len(started) == 1 and "not started" in started[0]["summary"]
    status = d.get("/api/v1/status")[1]
    assert "completed with error unknown" in status, status
    assert d.value("gpuwatch_fabric_health_issue", **labels(node, 0, issue="degraded_bandwidth")) == 1
    assert d.value("gpuwatch_fabric_health_issue", **labels(node, 0, issue="route_unhealthy")) is None  # sparse
    assert d.value("gpuwatch_fabric_health_issue", **labels(node, 0, issue="route_recovery")) is None
    assert fabric(d, node, 0) == labels(node, 0, state="completed", clique_id="7",
                                        cluster_uuid="01234567-89ab-cdef-0123-456789abcdef")


def test_fabric_health_summary_and_configuration_from_the_v3_structure(inproc, tmp_path):
    """A driver that knows the v3 structure (R570+) answers the health summary: gpuwatch_fabric_health_summary
    is NVML's number and fabric_degraded fires on limited capacity or unhealthy; the mask's incorrect
    configuration fires it too and is named; the capture's N/A (0) stays absent."""
    node = fakenvml.FakeNode.h200(2)
    g = node.gpus[0]
    g.fabric = (3, 0, 0, 1 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8)  # degraded bandwidth; configuration: none
    g.fabric_health_summary = 3  # NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {fabric_degraded: {hold: 0}}\n")
    d = inproc(node, args=["--config", str(config)])
    d.wait_value("gpuwatch_fabric_health_summary", 3, **labels(node, 0))
    assert d.value("gpuwatch_fabric_health_summary", **labels(node, 1)) is None  # N/A: absent, never 0
    d.wait_value("gpuwatch_anomaly", 1, rule="fabric_degraded", severity="warning", **labels(node, 0))
    status = d.get("/api/v1/status")[1]
    assert "fabric health limited capacity: degraded bandwidth" in status, status
    # a healthy summary, no issue, but too few NVLinks in the configuration: still degraded, named
    g.fabric = (3, 0, 0, 2 | 2 << 2 | 2 << 4 | 2 << 6 | 5 << 8)
    g.fabric_health_summary = 1
    d.fx.write(node)
    d.wait_value("gpuwatch_fabric_health_summary", 1, **labels(node, 0))
    d.wait_for(lambda: "incorrect configuration (insufficient nvlinks)" in d.get("/api/v1/status")[1],
             what="the configuration in the summary")
    assert d.value("gpuwatch_anomaly", rule="fabric_degraded", severity="warning", **labels(node, 1)) is None
    assert d.value("gpuwatch_poll_errors_total", tier="slow", error="argument_version_mismatch") is None


def test_a_driver_before_r570_is_asked_the_v2_structure_once_it_refuses_v3(inproc):
    """The driver answers v3 with ARGUMENT_VERSION_MISMATCH: gpuwatch reads v2 (the health mask, no summary)
    from then on, without an error per poll."""
    node = fakenvml.FakeNode.h200(1)
    g = node.gpus[0]
    g.fabric = (3, 0, 0, 1)  # degraded bandwidth
    g.fabric_health_summary = None  # before R570: no v3
    d = inproc(node)
    d.wait_value("gpuwatch_fabric_health_issue", 1, **labels(node, 0, issue="degraded_bandwidth"))
    assert d.value("gpuwatch_fabric_health_summary", **labels(node, 0)) is None
    assert fabric(d, node, 0)["state"] == "completed"
    at_start = d.fx.counts()["nvmlDeviceGetGpuFabricInfoV"]
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetGpuFabricInfoV"] >= at_start + 3, what="three more slow polls")
    assert d.value("gpuwatch_collector_success", group="fabric") == 1
    assert d.value("gpuwatch_poll_errors_total", tier="slow", error="argument_version_mismatch") is None
    d.stop()
    counts = d.fx.counts()
    polls = counts["nvmlDeviceGetGpuFabricInfoV"] - 2  # discovery: v3 refused, then v2
    assert polls >= 3 and counts.get("nvmlDeviceGetGpuFabricInfo", 0) == 0


def test_the_driver_s_recovery_action_fires_its_rule_and_names_the_action(inproc, tmp_path):
    """Field 230 through the real binding: 0 (None, as every capture's driver says) is quiet and has no series
    (sparse; the feature says the driver reports it); a node reboot fires recovery_action_required at once
    with what to do; back at none it clears; a value gpuwatch does not know is exported as the driver's
    number, called unknown and logged once."""
    node = fakenvml.FakeNode.h200(2)
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {recovery_action_required: {clear: 0}}\n")
    d = inproc(node, args=["--config", str(config)])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 1, feature="recovery_action")) == 1
    assert d.value("gpuwatch_recovery_action", **labels(node, 1)) is None
    assert d.value("gpuwatch_anomaly_onsets_total", rule="recovery_action_required") == 0
    node.gpus[1].recovery_action = 2  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    node.add_xid(gpu=1, xid=154)
    d.fx.write(node)
    d.wait_value("gpuwatch_anomaly", 1, rule="recovery_action_required", severity="critical", **labels(node, 1))
    assert d.value("gpuwatch_recovery_action", **labels(node, 1)) == 2
    assert d.value("gpuwatch_anomaly", rule="recovery_action_required", severity="critical", **labels(node, 0)) is None
    [started] = [e for e in d.events() if e["event"] == "anomaly_started" and e["rule"] == "recovery_action_required"]
    assert started["summary"] == "GPU 1 the driver asks for recovery action node_reboot: drain the node and reboot it"
    [xid] = [e for e in d.events() if e["event"] == "xid_event"]
    assert (xid["xid"], xid["meaning"]) == (154, "GPU recovery action changed")
    node.gpus[1].recovery_action = 0  # rebooted
    d.fx.write(node)
    d.wait_value("gpuwatch_anomaly", None, rule="recovery_action_required", severity="critical", **labels(node, 1))
    assert d.value("gpuwatch_recovery_action", **labels(node, 1)) is None
    node.gpus[0].recovery_action = 9  # a newer driver's action
    d.fx.write(node)
    d.wait_value("gpuwatch_recovery_action", 9, **labels(node, 0))
    d.wait_value("gpuwatch_anomaly", 1, rule="recovery_action_required", severity="critical", **labels(node, 0))
    assert "recovery action unknown (9)" in d.get("/api/v1/status")[1]
    slow_polls = d.fx.counts()["nvmlDeviceGetGpuFabricInfoV"]  # one per GPU and slow poll
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetGpuFabricInfoV"] >= slow_polls + 6, what="three more slow polls")
    assert len([e for e in d.events() if e["event"] == "unknown_recovery_action"]) == 1


def test_old_driver_without_gpm_and_versioned_fabric_call(inproc):
    node = fakenvml.FakeNode.h200(1)
    d = inproc(node, old_driver=True)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="gpm")) is None
    assert fabric(d, node, 0)["state"] == "completed"  # GetGpuFabricInfo
    assert d.value("gpuwatch_fabric_health_issue", **labels(node, 0, issue="degraded_bandwidth")) is None
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="active")) == 18
    # no field 230 before R570: feature 0, no series
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="recovery_action")) == 0
    assert d.value("gpuwatch_recovery_action", **labels(node, 0)) is None
    assert d.value("gpuwatch_poll_errors_total", tier="fast", error="function_not_found") is None


def test_switched_off_groups_make_no_calls(inproc):
    node = fakenvml.FakeNode.h200(1)
    d = inproc(node, args=["--no-collector.gpm", "--no-collector.fabric", "--no-collector.nvlink"])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.stop()
    counts = d.fx.counts()
    for name in ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
                 "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"):
        assert counts.get(name, 0) == 0, name


SLURM_CGROUP = "0::/system.slice/slurmstepd.scope/job_{}/step_0/user/task_0\n"


def test_mig_node_shows_its_instances_memory_activity_and_jobs(inproc, tmp_path):
    """An H100 in MIG mode with the capture's four instances: each with its profile, frame buffer and SM
    activity, the job on one of them; the parent's utilization and remapped rows are not supported there
    (absent, feature 0, no error counted); an instance destroyed goes away with the next slow poll."""
    node = fakenvml.FakeNode.h100_mig(1)
    g = node.gpus[0]
    g.mig_devices[0].gpm = {2: 50.0, 5: 30.0, 10: 20.0}
    g.mig_devices[0].used = 12 * 2**30
    g.add_process(4100, 12 * 2**30, mig=(2, 0))  # on GPU instance 2, the 3g.40gb
    proc = tmp_path / "proc" / "4100"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(SLURM_CGROUP.format("777"))
    (proc / "status").write_text("Name:\tpython\nUid:\t54321\t54321\t54321\t54321\n")
    d = inproc(node, args=["--attribution.proc-root", str(tmp_path / "proc")])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    gpu = labels(node, 0)
    m = d.metrics()
    info = sorted((l["gpu_instance"], l["compute_instance"], l["profile"], l["mig_uuid"])
                  for k in m if k[0] == "gpuwatch_mig_instance_info" for l in [dict(k[1])])
    assert info == sorted((str(x.gpu_instance), "0", x.name.rsplit(" ", 1)[1], x.uuid) for x in g.mig_devices.values())
    assert [p for _, _, p, _ in sorted(info, key=lambda i: int(i[0]))] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert d.value("gpuwatch_mig_memory_total_bytes", **gpu, gpu_instance="2") == 40448 * MIB
    assert d.value("gpuwatch_mig_memory_used_bytes", **gpu, gpu_instance="2") == 12 * 2**30
    d.wait_value("gpuwatch_mig_sm_active_ratio", 0.5, **gpu, gpu_instance="2")
    assert d.value("gpuwatch_mig_pipe_active_ratio", **gpu, gpu_instance="2", pipe="tensor") == pytest.approx(0.3)
    assert d.value("gpuwatch_mig_dram_bandwidth_ratio", **gpu, gpu_instance="2") == pytest.approx(0.2)
    assert d.value("gpuwatch_mig_sm_active_ratio", **gpu, gpu_instance="9") == 0
    assert d.value("gpuwatch_mig_job_info", **gpu, gpu_instance="2", scheduler="slurm", job_id="777",
                   user="54321") == 1
    for feature, supported in (("utilization", 0), ("remapped_rows", 0)):
        assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature=feature)) == supported, feature
    # with MIG on, device-level GPM is not there (no device-level GPM series; MIG and GPM, classes of hardware,
    # have no feature series)
    assert d.value("gpuwatch_sm_active_ratio", **labels(node, 0)) is None
    assert d.value("gpuwatch_utilization_ratio", **labels(node, 0, engine="gpu")) is None
    assert not [k for k in d.metrics() if k[0] == "gpuwatch_poll_errors_total"]
    assert d.value("gpuwatch_collector_success", group="mig") == 1
    # an instance is destroyed (nvidia-smi mig -dci / -dgi): gone from the next enumeration
    del g.mig_devices[3]
    d.fx.write(node)
    d.wait_for(lambda: len([k for k in d.metrics() if k[0] == "gpuwatch_mig_instance_info"]) == 3,
             what="the next enumeration without the destroyed instance")
    assert d.value("gpuwatch_mig_memory_total_bytes", **gpu, gpu_instance="10") is None
    assert d.value("gpuwatch_mig_memory_total_bytes", **gpu, gpu_instance="9") == 9984 * MIB


def test_gpus_without_mig_make_no_mig_calls_after_discovery(inproc):
    node = fakenvml.FakeNode.h200(1)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="mig")) is None
    d.stop()
    counts = d.fx.counts()
    assert counts["nvmlDeviceGetMigMode"] == 1
    for name in ("nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlGpmMigSampleGet"):
        assert counts.get(name, 0) == 0, name


def test_a_mig_configuration_change_event_re_enumerates_at_once(inproc):
    """With a slow poll a minute away, a new instance's frame buffer shows within a few fast polls of
    NVML's MIG configuration-change event; its info series follows at the next slow poll."""
    node = fakenvml.FakeNode.h100_mig(1)
    # XIDs switched off: the events thread still waits, for the MIG events
    d = inproc(node, args=["--poll.slow-interval", "60", "--no-collector.xid"])
    d.wait_value("gpuwatch_mig_memory_total_bytes", 9984 * MIB, **labels(node, 0, gpu_instance="10"))
    g = node.gpus[0]
    g.mig_devices[4] = fakenvml.FakeMig(gpu_instance=11, compute_instance=0, total=9984 * MIB, used=0,
                                        uuid="MIG-0000000b-0000-0000-0000-00000000000b",
                                        name="NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    d.fx.write(node)
    node.add_event(0, fakenvml.EVENT_MIG_CONFIG)
    d.fx.write(node)
    d.wait_value("gpuwatch_mig_memory_total_bytes", 9984 * MIB, **labels(node, 0, gpu_instance="11"))
    assert [e["instances"] for e in d.events() if e["event"] == "mig_config_changed"] == [5]


def test_a_gpu_instance_with_two_compute_instances_is_read_once(inproc):
    """Two MIG devices (compute instances 0 and 1) of one GPU instance share its memory and its SMs:
    one series per GPU instance, its GPM pair sampled once per poll (the values stay the fake's)."""
    node = fakenvml.FakeNode.h100_mig(1)
    g = node.gpus[0]
    second = g.mig_devices[0]
    g.mig_devices[4] = fakenvml.FakeMig(gpu_instance=second.gpu_instance, compute_instance=1, total=second.total,
                                        used=second.used, uuid="MIG-00000004-0000-0000-0000-000000000004",
                                        name=second.name, gpm={2: 40.0, 5: 10.0, 10: 20.0})
    second.gpm = {2: 40.0, 5: 10.0, 10: 20.0}
    d = inproc(node)
    d.wait_value("gpuwatch_mig_sm_active_ratio", 0.4, **labels(node, 0, gpu_instance="2"))
    body = d.get("/metrics")[1]
    lines = [line for line in body.splitlines()
             if line.startswith("gpuwatch_mig_memory_total_bytes{") and 'gpu_instance="2"' in line]
    assert len(lines) == 1, lines
    info = [dict(k[1]) for k in d.metrics() if k[0] == "gpuwatch_mig_instance_info"]
    assert sorted(i["compute_instance"] for i in info if i["gpu_instance"] == "2") == ["0", "1"]
