"""Golden exposition: the real `gpuwatch` process over fixture GPUs, diffed against a checked-in file.

Every change to the exposition shows up as a reviewable diff of tests/golden/*.prom. Regenerate with
GPUWATCH_UPDATE_GOLDEN=1 scripts/test tests/test_golden.py
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import fakenvml
import pytest
from daemon import Daemon, fake_env

GOLDEN = Path(__file__).parent / "golden"
# Samples whose values differ from run to run; their HELP/TYPE lines stay in the file.
VOLATILE = re.compile(r"^(process_\w+|gpuwatch_build_info|gpuwatch_poll_duration_seconds|gpuwatch_collector_duration_seconds|"
                      r"gpuwatch_last_poll_timestamp_seconds|gpuwatch_anomaly_since_timestamp_seconds|"
                      r"gpuwatch_pcie_traffic_bytes_total)(\{| )")  # PCIe bytes: integrated over the elapsed time


def stable(exposition: str) -> str:
    return "".join(line + "\n" for line in exposition.splitlines() if not VOLATILE.match(line))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GPUWATCH_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    expected = path.read_text()
    assert text == expected, f"exposition differs from {path}; regenerate with GPUWATCH_UPDATE_GOLDEN=1 if intended"


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: scripts/test installs it (Debian package prometheus)")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture()
def fixture_node_daemon(tmp_path):
    node = fakenvml.FakeNode.from_profiles(["h200", "h200", "rtx"])
    fx = fakenvml.prepare(tmp_path, node)
    daemon = Daemon(tmp_path, fake_env(fx))
    yield daemon
    daemon.stop()


def test_golden_exposition_over_the_fake_library(fixture_node_daemon):
    d = fixture_node_daemon
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.wait_value("gpuwatch_collector_success", 1, group="jobs")  # the host job has read (no job here)
    status, body = d.get("/metrics")
    assert status == 200
    promtool_check(body)
    check_golden("nvml-fixture.prom", stable(body))
    # the contract's series budget at defaults: 80 per GPU, 100 on an NVLink/GPM-capable one (the H200s)
    per_gpu, h200 = series_per_gpu(body), h200_uuids(d)
    assert len(per_gpu) == 3 and len(h200) == 2
    assert min(per_gpu[u] for u in h200) > 90  # the count sees the data-center families
    for uuid, count in per_gpu.items():
        assert count <= (100 if uuid in h200 else 80), (uuid, count)


def series_per_gpu(exposition: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in exposition.splitlines():
        match = re.search(r'[{,]uuid="(GPU-[^"]+)"', line)
        if match and not line.startswith("#"):
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def h200_uuids(d) -> set[str]:
    return {dict(k[1])["uuid"] for k in d.metrics() if k[0] == "gpuwatch_gpu_info" and dict(k[1])["name"] == "NVIDIA H200"}


def test_once_prints_the_same_exposition(tmp_path):
    """`gpuwatch once` gives the daemon's exposition on stdout, for cron and the textfile collector."""
    node = fakenvml.FakeNode.from_profiles(["h200", "h200", "rtx"])
    fx = fakenvml.prepare(tmp_path, node)
    result = subprocess.run([os.sys.executable, "-m", "gpuwatch", "once", "--log.format", "json"],
                            env=fake_env(fx), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    promtool_check(result.stdout)
    # once runs no second poll, so poll_success is the only difference allowed: none here
    check_golden("nvml-fixture.prom", stable(result.stdout))


def test_golden_exposition_with_firing_anomalies(tmp_path):
    """GPU 1 reports 2 uncorrectable ECC errors and a pending row remap: both rules fire on it alone."""
    node = fakenvml.FakeNode.from_profiles(["h200", "h200", "rtx"])
    broken = node.gpus[1]
    broken.ecc_errors = {(0, 0): 0, (1, 0): 2, (0, 1): 0, (1, 1): 2}
    broken.remapped_rows = (0, 1, 1, 0)
    fx = fakenvml.prepare(tmp_path, node)
    d = Daemon(tmp_path, fake_env(fx))
    try:
        labels = dict(gpu="1", uuid=broken.uuid)
        d.wait_value("gpuwatch_anomaly", 1, rule="ecc_uncorrectable", severity="critical", **labels)
        d.wait_value("gpuwatch_anomaly", 1, rule="row_remap_pending", severity="warning", **labels)
        d.wait_value("gpuwatch_poll_success", 1, tier="slow")
        d.wait_value("gpuwatch_collector_success", 1, group="jobs")
        status, body = d.get("/metrics")
        promtool_check(body)
        check_golden("nvml-fixture-anomalies.prom", stable(body))
        assert d.value("gpuwatch_anomaly_since_timestamp_seconds", rule="ecc_uncorrectable", **labels) > 1.7e9
        started = [e for e in d.events() if e["event"] == "anomaly_started"]
        assert sorted((e["rule"], e["gpu"]) for e in started) == [("ecc_uncorrectable", "1"), ("row_remap_pending", "1")]
    finally:
        d.stop()
