"""Grace Hopper and Grace Blackwell: the C2C links (the c2c group and the rule c2c_link_down), the
module-scope power and energy, and the Grace hwmon sensors (the grace host group). Through the real
process and binding over the fake library, over fake hwmon trees, and as rules over snapshots."""

from __future__ import annotations

import json
import os

import fakenvml
import pytest
from test_golden import series_per_gpu
from test_rules import evaluate, gpu, snapshot, window

from gpuwatch.backends.simulated import Fault, SimulatedBackend, demo_tour
from gpuwatch.backends.simulated.tour import parse_fault_spec
from gpuwatch.clock import FakeClock
from gpuwatch.groups import Selection
from gpuwatch.groups.grace import GraceSensor
from gpuwatch.hostside import HostReader
from gpuwatch.hostside.grace import GraceHwmon
from gpuwatch.testing import slow_sample

C2C_MBPS = 44_712


def labels(node, i, **extra):
    return dict(gpu=str(i), uuid=node.gpus[i].uuid, **extra)


# ------------------------------------------------------------------- the real binding, fake library


def test_gh200_reads_module_power_c2c_links_and_their_detail(inproc):
    """Module power from field 185 with scopeId 1 beside the GPU's own power; the energy counter as NVML
    gives it (module-scoped on these GPUs); at defaults the 10 links, their bandwidth and the error counters,
    (C2C, a class of hardware, has no feature series: these say the GPU has it)."""
    node = fakenvml.FakeNode.gh200(2)
    node.gpus[1].c2c_errors = {"crc": 3, "replay": 7, "replay_b2b": 1}
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    g0 = labels(node, 0)
    assert d.value("gpuwatch_power_watts", **g0) == pytest.approx(90.12)
    assert d.value("gpuwatch_module_power_watts", **g0) == pytest.approx(201.35)
    assert d.value("gpuwatch_energy_joules_total", **g0) == pytest.approx(123_456.789)
    assert d.value("gpuwatch_c2c_links", **labels(node, 0, state="active")) == 10
    assert d.value("gpuwatch_c2c_links", **labels(node, 0, state="inactive")) == 0
    assert d.value("gpuwatch_c2c_bandwidth_bytes_per_second", **g0) == 10 * C2C_MBPS * 1e6
    for error, count in {"crc": 3, "replay": 7, "replay_b2b": 1}.items():
        assert d.value("gpuwatch_c2c_errors_total", **labels(node, 1, error=error)) == count, error
    # sparse: a kind appears with its first error, so GPU 0's clean links have none
    assert not [k for k in d.metrics() if k[0] == "gpuwatch_c2c_errors_total" and dict(k[1])["gpu"] == "0"]
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="active")) is None  # no NVSwitch here
    # a link goes down: one fewer active, its bandwidth gone from the sum
    node.gpus[0].c2c_links[3] = 0
    d.fx.write(node)
    d.wait_value("gpuwatch_c2c_links", 1, **labels(node, 0, state="inactive"))
    assert d.value("gpuwatch_c2c_bandwidth_bytes_per_second", **g0) == 9 * C2C_MBPS * 1e6


def test_c2c_link_down_fires_naming_the_link_and_low_power_is_not_down(inproc, tmp_path):
    """Link 3 of GPU 0 inactive fires c2c_link_down on GPU 0 alone, its summary naming link 3; GPU 1's
    link 5 inactive in the low-power state is idle, not down (and counted active)."""
    node = fakenvml.FakeNode.gh200(2)
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {c2c_link_down: {hold: 0, clear: 0}}\n")
    d = inproc(node, args=["--config", str(config)])
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    node.gpus[0].c2c_links[3] = 0
    node.gpus[1].c2c_links[5] = 0
    node.gpus[1].c2c_power_state[5] = 1  # NVML_C2C_POWER_STATE_LOW_POWER
    d.fx.write(node)
    d.wait_value("gpuwatch_anomaly", 1, rule="c2c_link_down", severity="critical", **labels(node, 0))
    started = [e for e in d.events() if e["event"] == "anomaly_started" and e["rule"] == "c2c_link_down"]
    assert [e["gpu"] for e in started] == ["0"]
    assert "C2C link 3 to the Grace CPU inactive; 9 of 10 active" in started[0]["summary"]
    assert d.value("gpuwatch_c2c_links", **labels(node, 0, state="inactive")) == 1
    assert d.value("gpuwatch_c2c_links", **labels(node, 1, state="inactive")) == 0  # low power: idle, not down
    assert d.value("gpuwatch_anomaly", rule="c2c_link_down", severity="critical", **labels(node, 1)) is None
    node.gpus[0].c2c_links[3] = 1
    d.fx.write(node)
    d.wait_for(lambda: any(e["event"] == "anomaly_resolved" and e["rule"] == "c2c_link_down" for e in d.events()),
             what="c2c_link_down to resolve")


def test_gb200_defaults_stay_within_the_series_budget(inproc):
    """A GB200 (NVLink5, fabric, GPM, C2C) at defaults: at most 100 series per GPU with its module power;
    C2C at defaults; the driver is the mock configuration's."""
    node = fakenvml.FakeNode.gb200(2)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.wait_for(lambda: d.value("gpuwatch_pcie_traffic_bytes_total", **labels(node, 0, direction="tx")) is not None,
             what="the GPM counters")
    _, body = d.get("/metrics")
    counts = series_per_gpu(body)
    assert len(counts) == 2 and all(n <= 100 for n in counts.values()), counts
    assert d.value("gpuwatch_module_power_watts", **labels(node, 0)) == pytest.approx(262.5)
    assert d.value("gpuwatch_power_limit_watts", **labels(node, 0, limit="max")) == 1200
    assert d.value("gpuwatch_nvlink_links", **labels(node, 0, state="active")) == 18
    info = [dict(k[1]) for k in d.metrics() if k[0] == "gpuwatch_driver_info"]
    assert info == [{"driver_version": "580.65.06", "nvml_version": "13.580.65", "cuda_driver_version": "13.0"}]
    assert {dict(k[1])["architecture"] for k in d.metrics() if k[0] == "gpuwatch_gpu_info"} == {"blackwell"}


def test_gpus_without_c2c_are_asked_once_and_show_no_module_power(inproc):
    """An x86 HGX H200 and an L40S: C2C mode is asked once per GPU at discovery, never again; no module
    power (the H200 answers NOT_SUPPORTED for the module scope, as NVIDIA's mock does), no C2C series."""
    node = fakenvml.FakeNode.from_profiles(["h200", "l40s"])
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    at_start = d.fx.counts()["nvmlDeviceGetTemperatureV"]
    d.wait_for(lambda: d.fx.counts()["nvmlDeviceGetTemperatureV"] >= at_start + 6, what="three more polls")
    assert d.fx.counts()["nvmlDeviceGetC2cModeInfoV"] == 2
    m = d.metrics()
    assert not [k for k in m if k[0].startswith("gpuwatch_c2c_") or k[0] == "gpuwatch_module_power_watts"]
    assert d.value("gpuwatch_power_watts", **labels(node, 0)) == pytest.approx(77.67)


def test_an_old_driver_without_the_c2c_mode_call_still_reads_the_links(inproc):
    """Without nvmlDeviceGetC2cModeInfoV (FUNCTION_NOT_FOUND) the link count decides; the R575 error
    counters are INVALID_ARGUMENT on that driver and stay absent."""
    node = fakenvml.FakeNode.gh200(1)
    d = inproc(node, old_driver=True)
    d.wait_value("gpuwatch_c2c_links", 10, **labels(node, 0, state="active"))
    assert d.value("gpuwatch_module_power_watts", **labels(node, 0)) == pytest.approx(201.35)
    assert not [k for k in d.metrics() if k[0] == "gpuwatch_c2c_errors_total"]


def test_a_grace_gpu_without_module_scope_power_says_so_once(inproc):
    """NVIDIA's mock answers NOT_SUPPORTED for the module scope: no module power series, one log line
    per GPU at discovery, and the C2C links are read all the same."""
    node = fakenvml.FakeNode.gh200(1)
    node.gpus[0].module_power_mw = None
    d = inproc(node)
    d.wait_value("gpuwatch_c2c_links", 10, **labels(node, 0, state="active"))
    assert d.value("gpuwatch_module_power_watts", **labels(node, 0)) is None
    assert d.value("gpuwatch_power_watts", **labels(node, 0)) == pytest.approx(90.12)
    assert len([e for e in d.events() if e["event"] == "module_power_unavailable"]) == 1


def test_grace_hwmon_sensors_through_the_daemon(inproc, tmp_path):
    """--collector.grace.hwmon-root: the node-level Grace power and cap series; a garbage sensor file is
    counted and the valid sensors stay."""
    root = tmp_path / "hwmon"
    grace_tree(root, sockets=1)
    sensor(root, 9, "SysIO Power Socket 1", average=b"lots\n")
    d = inproc(fakenvml.FakeNode.gh200(1), args=["--collector.grace.hwmon-root", str(root)])
    d.wait_value("gpuwatch_grace_power_watts", 250.5, sensor="cpu", socket="0")
    assert d.value("gpuwatch_grace_power_watts", sensor="module", socket="0") == pytest.approx(612.25)
    assert d.value("gpuwatch_grace_power_cap_watts", socket="0") == 500
    assert d.value("gpuwatch_grace_power_watts", sensor="sysio", socket="0") == 21
    assert d.value("gpuwatch_grace_power_watts", sensor="sysio", socket="1") is None
    assert d.value("gpuwatch_collector_success", group="grace") == 0
    assert d.value("gpuwatch_collector_errors_total", group="grace", error="bad_sensor") >= 1


# --------------------------------------------------------------------------------- hwmon reader


def sensor(root, n, name, average=None, cap=None, in_device=True, raw_name=None):
    entry = root / f"hwmon{n}"
    directory = entry / "device" if in_device else entry
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "power1_oem_info").write_bytes(raw_name if raw_name is not None else name.encode() + b"\n")
    if average is not None:
        (directory / "power1_average").write_bytes(average if isinstance(average, bytes) else f"{average}\n".encode())
    if cap is not None:
        (directory / "power1_cap").write_bytes(cap if isinstance(cap, bytes) else f"{cap}\n".encode())


def grace_tree(root, sockets=2):
    """What a Grace node's /sys/class/hwmon has: per socket CPU, SysIO, Module (µW) and Grace (the cap),
    beside chips that are not Grace's (a temperature sensor, an NVMe drive)."""
    n = 0
    for s in range(sockets):
        sensor(root, n, f"Grace Power Socket {s}", cap=500_000_000)
        sensor(root, n + 1, f"CPU Power Socket {s}", average=250_500_000 + s)
        sensor(root, n + 2, f"SysIO Power Socket {s}", average=21_000_000, in_device=False)
        sensor(root, n + 3, f"Module Power Socket {s}", average=612_250_000)
        n += 4
    (root / "hwmon90" / "device").mkdir(parents=True)
    (root / "hwmon90" / "name").write_text("nvme\n")
    (root / "hwmon91").mkdir()
    (root / "hwmon91" / "name").write_text("acpitz\n")


def warnings(capsys) -> list[dict]:
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == "grace_sensor_skipped"]


def test_grace_sensors_per_socket_in_watts(tmp_path, capsys):
    grace_tree(tmp_path, sockets=2)
    errors: list[tuple[str, str]] = []
    sensors = GraceHwmon(str(tmp_path), FakeClock().monotonic, errors).read()
    assert sensors == (
        GraceSensor("cap", "0", 500.0), GraceSensor("cap", "1", 500.0),
        GraceSensor("cpu", "0", 250.5), GraceSensor("cpu", "1", 250.500001),
        GraceSensor("module", "0", 612.25), GraceSensor("module", "1", 612.25),
        GraceSensor("sysio", "0", 21.0), GraceSensor("sysio", "1", 21.0),
    )
    assert errors == [] and warnings(capsys) == []


def test_x86_node_has_no_grace_sensors_and_says_nothing(tmp_path, capsys):
    """A node whose hwmon chips are coretemp and an NVMe drive, one without hwmon at all: no reading
    (no series, no collector series), no warning, no error."""
    (tmp_path / "hwmon0").mkdir()
    (tmp_path / "hwmon0" / "name").write_text("coretemp\n")
    (tmp_path / "hwmon1" / "device").mkdir(parents=True)
    (tmp_path / "hwmon1" / "device" / "power1_average").write_text("12000000\n")  # a power meter, not Grace's
    errors: list[tuple[str, str]] = []
    assert GraceHwmon(str(tmp_path), FakeClock().monotonic, errors).read() is None
    assert GraceHwmon(str(tmp_path / "absent"), FakeClock().monotonic, errors).read() is None
    assert errors == [] and warnings(capsys) == []
    sample = HostReader(Selection.of({"grace"}, {"grace.hwmon-root": str(tmp_path)}))([])
    assert sample.grace is None and sample.collected == ()


def test_another_power_meter_s_oem_text_is_not_a_grace_sensor(tmp_path, capsys):
    sensor(tmp_path, 0, "PSU1 Input Power", average=300_000_000)
    assert GraceHwmon(str(tmp_path), FakeClock().monotonic).read() is None
    assert warnings(capsys) == []


@pytest.mark.parametrize("bad, why", [
    (dict(average=b"garbage\n"), "not a number"),
    (dict(average=b"\xff\xfe\x00\x01"), "not a number"),
    (dict(average=-5_000_000), "out of range"),
    (dict(average=10**30), "out of range"),
    (dict(average=b""), "not a number"),
    (dict(average=b"1_000"), "not a number"),  # int() takes it; the kernel never writes it
    (dict(average=b"12\x1f"), "not a number"),
    (dict(average=b"9" * 5000), "out of range"),  # a runaway file: only its first bytes are read
    (dict(), "missing or unreadable"),
    (dict(raw_name=b"CPU Power Socket \xff0\n", average=1), "not UTF-8 text"),
])
def test_hostile_sensor_files_are_skipped_with_one_warning_naming_the_file(tmp_path, capsys, bad, why):
    grace_tree(tmp_path, sockets=1)
    sensor(tmp_path, 50, "CPU Power Socket 1", **bad)
    clock = FakeClock()
    errors: list[tuple[str, str]] = []
    reader = GraceHwmon(str(tmp_path), clock.monotonic, errors)
    sensors = reader.read()
    assert sensors is not None and len(sensors) == 4  # socket 0's valid sensors are all kept
    assert ("cpu", "1") not in {(s.sensor, s.socket) for s in sensors}
    first = warnings(capsys)
    assert len(first) == 1 and first[0]["reason"] == why
    assert first[0]["file"].startswith(str(tmp_path / "hwmon50"))
    assert errors == [("grace", "bad_sensor")]
    reader.read()  # the same bad file: counted again, not logged again
    clock.advance(3599)
    reader.read()
    assert warnings(capsys) == [] and len(errors) == 3
    clock.advance(2)  # an hour after the first warning: once more
    reader.read()
    assert len(warnings(capsys)) == 1


@pytest.mark.parametrize("name", [
    "CPU Power Socket \u0660",  # ARABIC-INDIC DIGIT ZERO: \\d and int() take it
    "CPU Power Socket \uff10",  # FULLWIDTH DIGIT ZERO
    "CPU Power Socket 00", "CPU Power Socket 01", "CPU Power Socket 0000",
    "CPU Power Socket 0\u00a0", "CPU Power Socket\u30000", "CPU Power Socket", "CPU Power Socket 0x0",
])
def test_a_socket_number_the_kernel_never_writes_is_skipped_and_the_real_sensor_kept(tmp_path, capsys, name):
    """hwmon00 sorts before socket 0's real CPU sensor (hwmon1): read as socket 0, its 999 W displaced the real
    250.5 W without a word. It is a bad sensor file: counted, one warning naming it."""
    grace_tree(tmp_path, sockets=1)
    sensor(tmp_path, "00", name, average=999_000_000)
    errors: list[tuple[str, str]] = []
    sensors = GraceHwmon(str(tmp_path), FakeClock().monotonic, errors).read()
    assert sensors is not None and {(s.sensor, s.socket): s.watts for s in sensors} == {
        ("cap", "0"): 500.0, ("cpu", "0"): 250.5, ("module", "0"): 612.25, ("sysio", "0"): 21.0}
    assert errors == [("grace", "bad_sensor")]
    (warning,) = warnings(capsys)
    assert warning["file"] == str(tmp_path / "hwmon00" / "device" / "power1_oem_info")
    assert warning["reason"] == "not a socket number as the kernel writes it"


def test_two_entries_naming_one_sensor_keep_the_first_valid_one_and_report_the_other(tmp_path, capsys):
    """The first entry in sorted order whose reading is valid is the sensor; a later entry naming the same
    sensor and socket is reported as a duplicate (not read); an earlier one with a bad reading is reported as
    that and does not hide the valid one."""
    grace_tree(tmp_path, sockets=1)  # socket 0's CPU sensor: hwmon1, 250.5 W
    sensor(tmp_path, "00", "CPU Power Socket 0", average=b"garbage\n")  # sorts first, its reading bad
    sensor(tmp_path, 7, "CPU Power Socket 0", average=999_000_000)  # sorts after hwmon1: a duplicate
    errors: list[tuple[str, str]] = []
    sensors = GraceHwmon(str(tmp_path), FakeClock().monotonic, errors).read()
    assert sensors is not None and [(s.sensor, s.socket, s.watts) for s in sensors if s.sensor == "cpu"] == [
        ("cpu", "0", 250.5)]
    assert errors == [("grace", "bad_sensor")] * 2
    bad, duplicate = warnings(capsys)
    assert (bad["file"], bad["reason"]) == (str(tmp_path / "hwmon00" / "device" / "power1_average"), "not a number")
    assert duplicate["file"] == str(tmp_path / "hwmon7" / "device" / "power1_oem_info")
    assert duplicate["reason"] == f"names the same sensor as {tmp_path / 'hwmon1' / 'device' / 'power1_oem_info'}"


def _unblock(fifo) -> None:
    """A reader blocked opening ``fifo`` goes on (and reads nothing) once a writer opens and closes it."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting: nothing to unblock
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["hwmon50/device/power1_oem_info", "hwmon50/power1_oem_info",
                                   "hwmon50/device/power1_average", "hwmon50/device/power1_cap"])
def test_a_fifo_where_a_sensor_file_should_be_is_skipped_without_blocking(tmp_path, capsys, where):
    """open() and read() of a FIFO block until a writer comes: the host reader thread stalled for good. It is
    not a regular file: skipped as a bad sensor file, the others read. Bounded: the read runs in a thread and the
    FIFO is unblocked if it is still there after 10 s, so a regression fails instead of hanging."""
    import threading

    grace_tree(tmp_path, sockets=1)
    fifo = tmp_path / where
    fifo.parent.mkdir(parents=True, exist_ok=True)
    if where.endswith("power1_average"):
        (fifo.parent / "power1_oem_info").write_bytes(b"CPU Power Socket 1\n")
    elif where.endswith("power1_cap"):
        (fifo.parent / "power1_oem_info").write_bytes(b"Grace Power Socket 1\n")
    os.mkfifo(fifo)
    errors: list[tuple[str, str]] = []
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(GraceHwmon(str(tmp_path), FakeClock().monotonic,
                                                                      errors).read()), daemon=True)
    reader.start()
    reader.join(10)
    blocked = reader.is_alive()
    while reader.is_alive():
        _unblock(fifo)
        reader.join(0.1)
    assert not blocked, "GraceHwmon.read() blocked on a FIFO"
    (sensors,) = result
    assert isinstance(sensors, tuple) and {(s.sensor, s.socket) for s in sensors} == {
        ("cap", "0"), ("cpu", "0"), ("module", "0"), ("sysio", "0")}
    assert errors == [("grace", "bad_sensor")]
    (warning,) = warnings(capsys)
    assert (warning["file"], warning["reason"]) == (str(fifo), "not a regular file")


def test_host_reader_runs_the_grace_group_with_its_root_and_reports_it(tmp_path):
    grace_tree(tmp_path, sockets=1)
    reader = HostReader(Selection.of({"grace"}, {"grace.hwmon-root": str(tmp_path)}), cgroup_root=str(tmp_path / "none"))
    sample = reader([])
    assert [(s.sensor, s.watts) for s in sample.grace or ()] == [("cap", 500.0), ("cpu", 250.5), ("module", 612.25),
                                                                ("sysio", 21.0)]
    assert [(name, ok) for name, _, ok in sample.collected] == [("grace", True)]
    assert sample.slurm is None and sample.jobs is None  # the other host groups are off
    os.chmod(tmp_path / "hwmon1" / "device" / "power1_average", 0)
    if os.access(tmp_path / "hwmon1" / "device" / "power1_average", os.R_OK):  # root reads it anyway
        return
    sample = reader([])
    assert ("cpu", "0") not in {(s.sensor, s.socket) for s in sample.grace or ()}
    assert sample.collected[0][2] is False and ("grace", "bad_sensor") in sample.errors


# ---------------------------------------------------------------------------------------- the rule


def c2c(up, low=None, at_discovery=None):
    links = {str(i): bool(v) for i, v in enumerate(up)}
    return slow_sample(c2c_up=links, c2c_low_power={str(i): bool(v) for i, v in enumerate(low or [0] * len(up))},
                       c2c_up_at_discovery={str(i): bool(v) for i, v in enumerate(at_discovery or [1] * len(up))})


def test_c2c_link_down_rule():
    win = window(snapshot(gpu(0, slow=c2c([1] * 10)), gpu(1, slow=c2c([1, 1, 0, 1, 1, 1, 1, 1, 1, 0])),
                          gpu(2, slow=c2c([1, 0, 1], low=[0, 1, 0])), gpu(3),
                          gpu(4, slow=c2c([0, 1], at_discovery=[0, 1]))))
    quiet = evaluate("c2c_link_down", win, 0)
    assert quiet is not None and not quiet.active and "10 of 10 C2C links" in quiet.summary
    down = evaluate("c2c_link_down", win, 1)
    assert down is not None and down.active and down.value == 2
    assert "C2C links 2, 9 to the Grace CPU inactive; 8 of 10 active" in down.summary
    low_power = evaluate("c2c_link_down", win, 2)
    assert low_power is not None and not low_power.active
    assert evaluate("c2c_link_down", win, 3) is None  # an H200 without C2C: cannot tell
    since_boot = evaluate("c2c_link_down", win, 4)  # the link count says it exists: down since discovery
    assert since_boot is not None and since_boot.active and "inactive since discovery: 0" in since_boot.summary


def test_c2c_link_down_cannot_tell_on_a_lost_or_stale_gpu():
    assert evaluate("c2c_link_down", window(snapshot(gpu(0, slow=c2c([0, 1]), up=False))), 0) is None
    assert evaluate("c2c_link_down", window(snapshot(gpu(0, slow=c2c([0, 1])), backend_up=False)), 0) is None


# -------------------------------------------------------------------------------- the simulator


def sim(profile, gpu_count=2, faults=()):
    clock = FakeClock(wall=1_700_000_000.0, monotonic=1000.0)
    backend = SimulatedBackend(clock, gpu_count=gpu_count, profile=profile, faults=faults)
    backend.open()
    return clock, backend, [g.identity.uuid for g in backend.discover()]


@pytest.mark.parametrize("profile", ["gh200", "gb200"])
def test_simulated_grace_module_power_energy_and_c2c(profile):
    """The module's power is the GPU's plus its Grace share; the energy counter integrates the module's
    power (NVML's module scope on these GPUs), not the GPU's; 10 C2C links up."""
    clock, backend, uuids = sim(profile, faults=[Fault("load", 0, 0, None, params={"utilization": 0.8})])
    first = backend.read_fast(uuids[0]).power
    module = gpu_only = 0.0
    for _ in range(120):
        clock.advance(1)
        p = backend.read_fast(uuids[0]).power
        assert p.module_power_watts is not None and p.power_watts is not None
        assert p.module_power_watts > p.power_watts + 50
        module += p.module_power_watts
        gpu_only += p.power_watts
    gained = backend.read_fast(uuids[0]).power.energy_joules - first.energy_joules
    assert gained == pytest.approx(module, rel=1e-3) and gained > gpu_only * 1.05
    c2c = backend.read_slow(uuids[0]).c2c
    assert c2c.c2c_up == {str(link): True for link in range(10)}
    assert sum(c2c.c2c_bandwidth_bytes.values()) == 10 * C2C_MBPS * 1e6


def test_simulated_grace_host_sensors_follow_the_gpus():
    """GB200: two GPUs per Grace socket; each socket's module sensor is its GPUs' and Grace's power."""
    clock, backend, uuids = sim("gb200", gpu_count=4)
    clock.advance(30)
    fast = [backend.read_fast(u).power for u in uuids]
    host = backend.read_host()
    sensors = {(s.sensor, s.socket): s.watts for s in host.grace or ()}
    assert {socket for _, socket in sensors} == {"0", "1"}
    for socket, pair in (("0", fast[:2]), ("1", fast[2:])):
        assert sensors[("module", socket)] == pytest.approx(sum(p.module_power_watts for p in pair), abs=0.01)
        assert sensors[("cpu", socket)] + sensors[("sysio", socket)] == pytest.approx(
            sum(p.module_power_watts - p.power_watts for p in pair), abs=0.01)
        assert sensors[("cap", socket)] == 500.0
    assert ("grace", 0.0, True) in host.collected
    assert backend.open().driver_version == "580.65.06"


def test_simulated_c2c_fault_and_profiles_without_grace():
    clock, backend, uuids = sim("gh200", faults=[Fault("c2c_link_down", 1, 60, 120, params={"link": 7})])
    clock.advance(90)
    assert backend.read_slow(uuids[1]).c2c.c2c_up["7"] is False
    assert all(backend.read_slow(uuids[0]).c2c.c2c_up.values())
    clock.advance(60)
    assert all(backend.read_slow(uuids[1]).c2c.c2c_up.values())
    _, h200, (u,) = sim("h200", gpu_count=1)
    assert h200.read_fast(u).power.module_power_watts is None and not h200.read_slow(u).c2c.c2c_up
    assert h200.read_host().grace is None
    with pytest.raises(ValueError, match="c2c"):
        SimulatedBackend(FakeClock(), gpu_count=1, profile="h200", faults=[Fault("c2c_link_down", 0, 0)])
    assert parse_fault_spec("c2c_link_down@1:link=2", 4) == [Fault("c2c_link_down", 1, 0.0, None, {"link": 2.0})]


@pytest.mark.parametrize("profile", ["gh200", "gb200"])
def test_demo_tour_on_grace_profiles_takes_a_c2c_link_down(profile):
    faults = demo_tour(600, gpu_count=8, profile=profile)
    assert [(f.kind, f.gpu, f.params["link"]) for f in faults if f.kind == "c2c_link_down"] == [("c2c_link_down", 0, 3)]
    clock, backend, uuids = sim(profile, gpu_count=8, faults=faults)
    clock.advance(120)
    assert backend.read_slow(uuids[0]).c2c.c2c_up["3"] is False


def test_a_read_of_the_hwmon_tree_interns_no_string(tmp_path, interned):
    """A Path per hwmon entry interned its name (pathlib) at every read, and the name was let go after it:
    churn of the interpreter's interned-string table (tests/test_hostside.py says what that cost)."""
    grace_tree(tmp_path, sockets=2)
    hwmon = GraceHwmon(str(tmp_path), FakeClock().monotonic, [])
    first = hwmon.read()
    added = interned()
    assert hwmon.read() == first and first
    assert added == []
