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
from fakehost import fake_process, proc_stat, slurm_v1_job

pytestmark = [pytest.mark.daemon, pytest.mark.stack]  # the golden file: the real process, promtool

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


# One golden exposition per GPU generation the fake library models, through `gpuwatch once`: each profile's
# readings on its own driver (A100 on R550, B200 on R580.126, GB200 on R580.65, the others on R590), two GPUs,
# GPU 0 held by a Slurm job with its process (cgroup v1), so the budget below counts a job's series too.
PROFILE_NODES = {
    "a100": lambda: fakenvml.FakeNode.a100(2),
    "h100": lambda: fakenvml.FakeNode.h100(2),
    "h200": lambda: fakenvml.FakeNode.h200(2),
    "b200": lambda: fakenvml.FakeNode.b200(2),
    "gh200": lambda: fakenvml.FakeNode.gh200(2),
    "gb200": lambda: fakenvml.FakeNode.gb200(2),
    "l40s": lambda: fakenvml.FakeNode.l40s(2),
    "rtx4090": lambda: fakenvml.FakeNode.rtx4090(2),
}
# NVLink/GPM-capable: 100 series a GPU; the others 80
DATA_CENTER = {"a100", "h100", "h200", "b200", "gh200", "gb200"}


@pytest.mark.parametrize("profile", sorted(PROFILE_NODES))
def test_golden_exposition_per_profile(tmp_path, profile):
    node = PROFILE_NODES[profile]()
    node.gpus[0].add_process(4242, 2 * 2**30)  # Slurm job 7001's process (cgroup v1) on GPU 0
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    slurm_v1_job(cgroup, 7001, 54321, [4242], minors=[node.gpus[0].minor])
    fake_process(proc, 4242, cgroup="12:devices:/slurm/uid_54321/job_7001/step_0\n", uid=54321)
    fx = fakenvml.prepare(tmp_path, node)
    result = subprocess.run([os.sys.executable, "-m", "gpuwatch", "once", "--log.format", "json",
                             "--attribution.proc-root", str(proc), "--attribution.cgroup-root", str(cgroup)],
                            env=fake_env(fx), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    promtool_check(result.stdout)
    check_golden(f"profile-{profile}.prom", stable(result.stdout))
    per_gpu = series_per_gpu(result.stdout)
    assert set(per_gpu) == {g.uuid for g in node.gpus}
    assert 'job_id="7001"' in result.stdout  # the job's series are in the count
    budget = 100 if profile in DATA_CENTER else 80
    assert max(per_gpu.values()) <= budget, per_gpu
