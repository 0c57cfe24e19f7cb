"""Right on every driver branch and NVLink generation, through the real process, the real pynvml binding and the
fake library: the field ids that moved between branches (groups/fieldids.py), NVLink5 on Blackwell."""

import json
import subprocess
import sys

import fakenvml
import pytest
from daemon import fake_env, parse
from inproc import InProc

from gpuwatch.groups import fieldids
from gpuwatch.groups.nvlink import decode_ber

S = 1_000_000_000  # ns
# distinct throttle times (R580.126+ ids), so that a counter read under the wrong id shows
THROTTLE = {74: 11 * S, 75: 13 * S, 76: 17 * S, 77: 0, 78: 0, 79: 0, 269: 19 * S, 270: 23 * S, 271: 29 * S}


def once(tmp_path, node, *args):
    """What `gpuwatch once` shows over ``node`` (the agent in-process: the first fast poll, the slow poll it
    runs, the host groups): (samples by (name, labels), the JSON log events)."""
    workdir = tmp_path / f"once{len(list(tmp_path.glob('once*')))}"
    d = InProc(workdir, node, args=["--log.level", "info", *args])
    try:
        return parse(d.scrape()), d.events()
    finally:
        d.stop()


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def reasons(samples, node, i=0):
    g = node.gpus[i]
    return {dict(k)["reason"]: v for (n, k), v in samples.items()
            if n == "gpuwatch_clocks_event_seconds_total" and dict(k)["uuid"] == g.uuid}


@pytest.mark.parametrize(("driver", "branch"), [
    ("470.256.02", "R535"), ("535.230.02", "R535"), ("550.163.01", "R550"), ("555.42.06", "R555"),
    ("560.35.03", "R560"), ("570.124.06", "R570"), ("575.57.08", "R575"), ("580.65.06", "R580.65"),
    ("580.126.09", "R580.126"), ("590.48.01", "R590"), ("595.71.05", "R595"), ("610.57.04", "R610"),
    ("615.10", "R615"),
])
def test_each_branch_has_its_numbering(driver, branch):
    numbering = fieldids.numbering(driver)
    assert (numbering.branch, numbering.known) == (branch, True)


def test_the_moved_ids_per_branch():
    """251-253 are the throttle counters only on R575 and R580 before 580.126; elsewhere 251 is power smoothing."""
    ids = {d: tuple(fieldids.numbering(d).id(n) for n in (fieldids.SW_THERMAL_NS, fieldids.HW_THERMAL_NS,
                                                          fieldids.HW_POWER_BRAKE_NS, fieldids.POWER_SMOOTHING_LIFETIME))
           for d in ("560.35.03", "570.124.06", "575.57.08", "580.65.06", "580.126.09", "590.48.01")}
    assert ids == {"560.35.03": (None, None, None, None), "570.124.06": (269, 270, 271, 258),
                   "575.57.08": (251, 252, 253, 263), "580.65.06": (251, 252, 253, 263),
                   "580.126.09": (269, 270, 271, 258), "590.48.01": (269, 270, 271, 258)}
    mig = fieldids.MIG_INDEPENDENT_QUERY
    assert [fieldids.numbering(d).id(mig) for d in ("535.1", "550.1", "555.1", "560.1", "570.1")] == \
        [None, 199, 200, 200, 199]


@pytest.mark.parametrize("driver", ["620.10.01", "1000.1", "garbage", ""])
def test_a_branch_newer_than_the_table_is_checked_not_trusted(driver):
    numbering = fieldids.numbering(driver)
    assert not numbering.known
    assert numbering.id(fieldids.SW_THERMAL_NS) == 269  # the newest numbering, to be checked


@pytest.mark.parametrize("driver", ["570.124.06", "575.57.08", "580.65.06", "580.126.09", "590.48.01"])
def test_throttle_counters_and_power_smoothing_under_each_numbering(tmp_path, driver):
    """The fake numbers the fields as that branch does (251 is the power-smoothing flag, 1, outside R575/R580.65):
    gpuwatch reads the same seconds and the same lifetime on every branch."""
    node = fakenvml.FakeNode.b200(1, driver_version=driver)
    node.gpus[0].throttle_ns = dict(THROTTLE)
    node.gpus[0].power_smoothing = {251: 1, 252: 2, 253: 1, 258: 87}
    samples, events = once(tmp_path, node)
    assert reasons(samples, node) == {"sw_power_cap": 11.0, "sync_boost": 17.0, "sw_thermal_slowdown": 19.0,
                                      "hw_thermal_slowdown": 23.0, "hw_power_brake_slowdown": 29.0}
    g = dict(gpu="0", uuid=node.gpus[0].uuid)
    assert value(samples, "gpuwatch_power_smoothing_lifetime_remaining_ratio", **g) == pytest.approx(0.87)
    assert not [e for e in events if e["event"] == "nvml_reading_implausible"]


def test_before_r570_the_perf_policy_counter_stands_in_for_thermal(tmp_path):
    node = fakenvml.FakeNode.h100(1, driver_version="560.35.03")
    node.gpus[0].throttle_ns = dict(THROTTLE)
    samples, _ = once(tmp_path, node)
    assert reasons(samples, node) == {"sw_power_cap": 11.0, "sync_boost": 17.0, "thermal": 13.0}
    g = dict(gpu="0", uuid=node.gpus[0].uuid)
    assert value(samples, "gpuwatch_power_smoothing_lifetime_remaining_ratio", **g) is None  # no such field


def test_an_unknown_branch_drops_a_moved_id_that_does_not_answer_a_counter(tmp_path):
    """A driver newer than the table: the newest numbering is assumed; where 269 answers a small unsigned int
    (a renumbering gpuwatch does not know), it is logged once and left out, never exported as seconds."""
    node = fakenvml.FakeNode.b200(2, driver_version="620.10.01")
    for g in node.gpus:
        g.throttle_ns = dict(THROTTLE)
        g.fields[269] = ("ui", 3)
        g.power_smoothing = {258: 250}  # not a percentage
    samples, events = once(tmp_path, node)
    assert reasons(samples, node) == {"sw_power_cap": 11.0, "sync_boost": 17.0, "thermal": 13.0,
                                      "hw_thermal_slowdown": 23.0, "hw_power_brake_slowdown": 29.0}
    g = dict(gpu="0", uuid=node.gpus[0].uuid)
    assert value(samples, "gpuwatch_power_smoothing_lifetime_remaining_ratio", **g) is None
    # the board has the circuitry but its reading was refused: shown as the feature being 0
    assert value(samples, "gpuwatch_gpu_feature_supported", feature="power_smoothing", **g) == 0
    implausible = [(e["gpu"], e["reading"]) for e in events if e["event"] == "nvml_reading_implausible"]
    assert sorted(implausible) == [("0", "power smoothing lifetime (field 258)"),
                                   ("0", "sw_thermal_slowdown throttle time (field 269)"),
                                   ("1", "power smoothing lifetime (field 258)"),
                                   ("1", "sw_thermal_slowdown throttle time (field 269)")]
    assert [e["event"] for e in events].count("nvml_field_numbering_unknown") == 1


@pytest.mark.parametrize(("packed", "ber"), [
    (fakenvml.pack_ber(15, 255), 0.0), (fakenvml.pack_ber(3, 12), 3e-12), (fakenvml.pack_ber(1, 0), 1.0),
    (fakenvml.pack_ber(9, 15), 9e-15), (-1, None), (0x1000, None), (0.0, 0.0), (2.5e-13, 2.5e-13), (7.0, None),
])
def test_ber_decoding(packed, ber):
    assert decode_ber(packed) == (pytest.approx(ber) if ber is not None else None)


@pytest.mark.parametrize("aggregate", [True, False])
def test_blackwell_reads_the_nvlink5_counters_not_the_dl_counters(tmp_path, aggregate):
    """On NVLink5 the device totals (scopeId 0xFFFFFFFF) where the driver answers them, else the links summed;
    the DL counters a mock may still serve on Blackwell are never read; a sleeping link is not down."""
    node = fakenvml.FakeNode.b200(1)
    g = node.gpus[0]
    g.nvlink5_aggregate = aggregate
    g.nvlink5_errors["recovery_successful"][2] = 3
    g.nvlink5_errors["recovery_successful"][9] = 1
    g.nvlink5_errors["effective"][4] = 40
    g.nvlink5_errors["symbol"][4] = 1234
    g.nvlink5_errors["malformed_packet"][1] = 5
    g.nvlink5_ber["effective"] = fakenvml.pack_ber(2, 13)
    g.nvlink_errors = {"replay": [7] * 18, "recovery": [7] * 18, "crc_flit": [7] * 18}  # served, not to be read
    g.nvlink_states[5] = 2  # SLEEP
    samples, _ = once(tmp_path, node)
    labels = dict(gpu="0", uuid=g.uuid)
    errors = {dict(k)["error"]: v for (n, k), v in samples.items() if n == "gpuwatch_nvlink_errors_total"}
    assert errors == {"recovery_successful": 4, "recovery_failed": 0, "effective": 40}  # symbol: a detail
    assert value(samples, "gpuwatch_nvlink_bit_error_ratio", kind="effective", **labels) == pytest.approx(2e-13)
    assert value(samples, "gpuwatch_nvlink_links", state="active", **labels) == 18
    with_detail, _ = once(tmp_path, node, "--collector.nvlink.packet-errors")
    errors = {dict(k)["error"]: v for (n, k), v in with_detail.items() if n == "gpuwatch_nvlink_errors_total"}
    assert errors["malformed_packet"] == 5 and errors["recovery"] == 0 and errors["symbol"] == 1234
    assert len(errors) == 12
    assert value(with_detail, "gpuwatch_nvlink_bit_error_ratio", kind="symbol", **labels) == 0.0


def test_blackwell_per_link_errors(tmp_path):
    node = fakenvml.FakeNode.b200(1)
    node.gpus[0].nvlink5_errors["recovery_failed"][17] = 2
    samples, _ = once(tmp_path, node, "--collector.nvlink.per-link")
    per_link = {(dict(k)["link"], dict(k)["error"]): v for (n, k), v in samples.items()
                if n == "gpuwatch_nvlink_link_errors_total"}
    assert len(per_link) == 18 * 4  # recoveries successful and failed, effective and symbol errors, per link
    assert per_link[("17", "recovery_failed")] == 2 and per_link[("0", "symbol")] == 0


def test_hopper_sums_the_dl_counters_where_the_driver_has_no_totals(tmp_path):
    """NVIDIA's mock (and, per DCGM#173, some HGX H100 drivers) answer no CRC/replay/recovery totals: the links'
    DL counters (161-163) are summed instead."""
    node = fakenvml.FakeNode.h100(1)
    g = node.gpus[0]
    for name in ("replay", "recovery", "crc_flit"):
        g.field_errors[fakenvml.NVLINK_TOTAL_FIELDS[name]] = fakenvml.ERROR_NOT_SUPPORTED
    g.nvlink_errors["replay"][3] = 5
    g.nvlink_errors["crc_flit"][0] = 11
    samples, _ = once(tmp_path, node)
    errors = {dict(k)["error"]: v for (n, k), v in samples.items() if n == "gpuwatch_nvlink_errors_total"}
    assert errors == {"crc_flit": 11, "crc_data": 0, "replay": 5, "recovery": 0, "ecc_data": 0}


# ------------------------------------------------------------------------------------ nvlink_errors_rising

def _nvlink_window(points, ber=None):
    """A window whose GPU 0 had the NVLink error totals ``points`` (oldest first), one slow sample every 30 s."""
    from test_rules import NOW, gpu, snapshot, uuid_of

    from gpuwatch.rules.base import Window
    from gpuwatch.testing import slow_sample

    def sample(errors):
        return slow_sample(nvlink_up={str(i): True for i in range(18)}, nvlink_errors=errors,
                           nvlink_bit_error_rate={} if ber is None else {"effective": ber},
                           nvlink_generation=5 if "effective" in errors else None)

    snap = snapshot(gpu(0, slow=sample(points[-1])))
    history = {uuid_of(0): [(NOW - 30 * (len(points) - 1 - i), sample(p)) for i, p in enumerate(points)]}
    return Window(snap, {}, 6.0, slow_history=history)


def _rising(points, ber=None, **params):
    from test_rules import evaluate
    return evaluate("nvlink_errors_rising", _nvlink_window(points, ber), **params)


NV5 = {"recovery_successful": 0, "recovery_failed": 0, "effective": 0, "symbol": 0}


def test_nvlink5_one_failed_recovery_fires():
    steady = [dict(NV5)] * 10
    assert not _rising(steady).active
    failed = steady + [{**NV5, "recovery_failed": 1}]
    assert _rising(failed).active


def test_nvlink5_successful_recoveries_and_effective_errors_against_their_rates():
    slow = [{**NV5, "recovery_successful": i // 5} for i in range(11)]  # 2 in 5 min: under 1/min
    assert not _rising(slow).active
    fast = [{**NV5, "recovery_successful": 2 * i} for i in range(11)]  # 4/min
    assert _rising(fast).active
    effective = [{**NV5, "effective": 100 * i} for i in range(11)]  # 200/min against 10/min
    assert _rising(effective).active
    assert not _rising(effective, effective_per_minute=500).active
    symbol = [{**NV5, "symbol": 10_000 * i} for i in range(11)]  # corrected symbols: FEC at work, no limit
    assert not _rising(symbol).active


def test_nvlink5_effective_ber_worse_than_1e_12_fires():
    steady = [dict(NV5)] * 10
    assert _rising(steady, ber=3e-12).active
    assert not _rising(steady, ber=9e-13).active
    assert _rising(steady[:1], ber=5e-12).active  # a fact of the latest reading: no history needed


def test_nvlink_before_blackwell_keeps_its_rates():
    legacy = {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0, "ecc_data": 0}
    assert not _rising([legacy] * 11).active
    assert _rising([{**legacy, "recovery": i} for i in range(11)]).active  # 2/min against 1/min
    assert not _rising([{**legacy, "replay": 1}] + [{**legacy, "replay": 2}] * 10).active


@pytest.mark.parametrize(("profile", "version", "errors"), [
    ("b200", 7, {"recovery_successful", "recovery_failed", "effective"}),  # NVML_NVLINK_VERSION_5_0: NVLink5
    ("h100", 6, {"crc_flit", "crc_data", "replay", "recovery", "ecc_data"}),  # 4.0: the DL totals
])
def test_an_unknown_architecture_takes_its_nvlink_counters_from_the_nvlink_version(tmp_path, profile, version, errors):
    """A GPU whose architecture gpuwatch does not know (NVML_DEVICE_ARCH_* 11) chooses its NVLink counters by
    nvmlDeviceGetNvLinkVersion: NVML's enum (7 = 5.0), not the marketing number."""
    node = fakenvml.FakeNode.from_profiles([profile])
    node.gpus[0].architecture = 11
    node.gpus[0].nvlink_version = version
    samples, _ = once(tmp_path, node)
    assert {dict(k)["error"] for (n, k) in samples if n == "gpuwatch_nvlink_errors_total"} == errors


def test_nvlink_that_cannot_be_read_is_an_unsupported_feature(tmp_path):
    """The link count says 18 links but no link's state answers: no NVLink series, the nvlink feature 0 (a
    class of hardware shows a feature series only then; an H200 whose NVLink reads has none, a PCIe card none)."""
    node = fakenvml.FakeNode.h100(2)
    for link in range(18):
        node.gpus[0].field_errors[(165, link)] = fakenvml.ERROR_UNKNOWN
    samples, _ = once(tmp_path, node)
    g0, g1 = (dict(gpu=str(i), uuid=node.gpus[i].uuid) for i in (0, 1))
    assert value(samples, "gpuwatch_gpu_feature_supported", feature="nvlink", **g0) == 0
    assert not [n for (n, k) in samples if n.startswith("gpuwatch_nvlink_") and dict(k)["gpu"] == "0"]
    assert value(samples, "gpuwatch_gpu_feature_supported", feature="nvlink", **g1) is None
    assert value(samples, "gpuwatch_nvlink_links", state="active", **g1) == 18


# ------------------------------------------------------------------------------------ hostile answers

def test_hostile_field_values_are_left_out_and_the_other_readings_stay(tmp_path):
    """A recovery action of NaN (a double) or -1 (signed), a C2C error count of 2.5 and an NVLink5 counter of
    inf are no readings: left out (logged once per GPU and reading, counted), never an exception that would take the
    GPU's other readings with it, never a drain on a number that is no action."""
    node = fakenvml.FakeNode.gb200(2)
    node.gpus[0].fields[230] = ("d", float("nan"))
    node.gpus[1].fields[230] = ("sll", -1)
    node.gpus[0].fields[231] = ("d", 2.5)
    for link in range(18):
        node.gpus[0].fields[(213, link)] = ("d", float("inf"))
    node.gpus[0].nvlink5_aggregate = node.gpus[1].nvlink5_aggregate = False
    samples, events = once(tmp_path, node)
    for i in (0, 1):
        g = dict(gpu=str(i), uuid=node.gpus[i].uuid)
        assert value(samples, "gpuwatch_recovery_action", **g) is None
        assert value(samples, "gpuwatch_temperature_celsius", sensor="gpu", **g) == 36  # the rest is there
        assert value(samples, "gpuwatch_nvlink_links", state="active", **g) == 18
    g0 = dict(gpu="0", uuid=node.gpus[0].uuid)
    assert value(samples, "gpuwatch_c2c_errors_total", error="crc", **g0) is None
    assert value(samples, "gpuwatch_nvlink_errors_total", error="recovery_successful", **g0) is None
    assert value(samples, "gpuwatch_nvlink_errors_total", error="recovery_failed", **g0) == 0
    implausible = [e for e in events if e["event"] == "nvml_reading_implausible"]
    assert sorted((e["reading"], e["gpu"]) for e in implausible if e["reading"] == "recovery_action") == [
        ("recovery_action", "0"), ("recovery_action", "1")]
    # counted too: the two recovery actions, the C2C count and GPU 0's 18 NVLink5 counters of the slow poll
    assert value(samples, "gpuwatch_poll_errors_total", tier="slow", error="implausible_value") == 2 + 1 + 18
    assert not [e for e in events if e["event"] in ("group_read_failed", "poll_failed")]


@pytest.mark.parametrize(("packed", "ber"), [(fakenvml.pack_ber(1, 12), 1e-12), (fakenvml.pack_ber(2, 12), 2e-12)])
def test_an_effective_ber_of_exactly_1e_12_is_not_exceeded(packed, ber):
    """DCGM's IsEffectiveBerThresholdExceeded: worse than 1e-12 fails, 1e-12 itself does not."""
    assert decode_ber(packed) == pytest.approx(ber)
    assert _rising([dict(NV5)] * 10, ber=decode_ber(packed)).active == (ber > 1e-12)


def test_a_link_counter_reset_does_not_make_the_sum_go_back(inproc):
    """Where the driver has no device total the links are summed: one link's counter reset (a link retrained,
    a GPU reset of its peer) is that link's alone; the sum never goes back, so nothing reads as a reset."""
    node = fakenvml.FakeNode.b200(1)
    g = node.gpus[0]
    g.nvlink5_aggregate = False
    g.nvlink5_errors["effective"][0] = 1_000_000
    g.nvlink5_errors["effective"][5] = 10
    d = inproc(node, args=["--poll.slow-interval", "1"])
    labels = dict(gpu="0", uuid=g.uuid, error="effective")
    d.wait_value("gpuwatch_nvlink_errors_total", 1_000_010, **labels)
    g.nvlink5_errors["effective"][5] = 0  # link 5's counter reset
    d.fx.write(node)
    written = d.clock.wall()
    d.wait_for(lambda: (d.value("gpuwatch_last_poll_timestamp_seconds", tier="slow") or 0) > written + 0.5,
               what="a slow poll after the reset")
    assert d.value("gpuwatch_nvlink_errors_total", **labels) == 1_000_010  # a plain sum would say 1,000,000
    g.nvlink5_errors["effective"][5] = 3
    d.fx.write(node)
    d.wait_value("gpuwatch_nvlink_errors_total", 1_000_013, **labels)


def test_a_group_whose_read_raises_loses_its_reading_alone(tmp_path):
    """A group's read that raises (a bug, an answer it cannot take) costs that group on that GPU: the other
    groups' readings are there, the poll reports an `internal` error, the group's collection fails, and it is
    logged once (not every poll)."""
    node = fakenvml.FakeNode.h200(1)
    fx = fakenvml.prepare(tmp_path, node)
    script = (
        "import json, sys\n"
        "from gpuwatch import logs\n"
        "logs.configure('info', 'json')\n"
        "from gpuwatch.backends.nvml import NvmlBackend\n"
        "from gpuwatch.groups import ecc\n"
        "def boom(self, q):\n"
        "    raise ValueError('cannot take this')\n"
        "ecc.Nvml.read_slow = boom\n"
        "b = NvmlBackend()\n"
        "b.open()\n"
        "(gpu,) = b.discover()\n"
        "samples = [b.read_slow(gpu.identity.uuid) for _ in range(3)]\n"
        "s = samples[-1]\n"
        "print(json.dumps({'errors': list(s.errors), 'collected': {n: ok for n, _, ok in s.collected},\n"
        "                  'pcie': s.pcie.pcie_link_generation, 'ecc': dict(s.ecc.ecc_errors)}))\n"
        "b.close()\n")
    result = subprocess.run([sys.executable, "-c", script], env=fake_env(fx), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["errors"] == ["internal"] and out["ecc"] == {}
    assert out["collected"]["ecc"] is False and out["collected"]["pcie"] is True
    assert out["pcie"] == {"current": 5, "max": 5}
    logged = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in logged].count("group_read_failed") == 1
