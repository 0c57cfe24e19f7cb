"""One contract suite over every backend: the same shapes, and features that match the series.

Each backend runs as `gpuwatch once` (a real process): NVML over the fake library and the
simulated node, both with fanless H200s and with fanned cards.
"""

import os
import subprocess
import sys

import fakenvml
import pytest
from daemon import fake_env
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch import groups
from gpuwatch.exporter.catalogue import CATALOGUE

pytestmark = pytest.mark.daemon  # one contract run per backend: `gpuwatch once` / `record` as shipped

# feature -> (family, extra label filter) that must exist exactly when the feature is supported
FEATURE_SERIES = {
    "fan": ("gpuwatch_fan_speed_ratio", {}),
    "fan_target": ("gpuwatch_fan_target_speed_ratio", {}),
    "fan_rpm": ("gpuwatch_fan_speed_rpm", {}),
    "memory_temperature": ("gpuwatch_temperature_celsius", {"sensor": "memory"}),
    "temperature_margin": ("gpuwatch_temperature_margin_celsius", {}),
    "power": ("gpuwatch_power_watts", {}),
    "energy": ("gpuwatch_energy_joules_total", {}),
    "power_limit": ("gpuwatch_power_limit_watts", {"limit": "enforced"}),
    "utilization": ("gpuwatch_utilization_ratio", {"engine": "gpu"}),
    "clocks_event_reasons": ("gpuwatch_clocks_event_active", {}),
    "clocks_event_time": ("gpuwatch_clocks_event_seconds_total", {}),
    "ecc": ("gpuwatch_ecc_errors_total", {}),
    "remapped_rows": ("gpuwatch_remapped_rows_pending", {}),
    "retired_pages": ("gpuwatch_retired_pages_pending", {}),
    "pcie": ("gpuwatch_pcie_link_generation", {"link": "current"}),
    "xid_events": ("gpuwatch_xid_events_total", {}),
    "gpm": ("gpuwatch_sm_active_ratio", {}),
    "nvlink": ("gpuwatch_nvlink_links", {"state": "active"}),
    "fabric": ("gpuwatch_fabric_state", {"state": "completed"}),
    "mig": ("gpuwatch_mig_instance_info", {}),
    "power_smoothing": ("gpuwatch_power_smoothing_lifetime_remaining_ratio", {}),
}
HARDWARE_FEATURES = groups.HARDWARE_FEATURES
# Features whose family is sparse: absent at its quiet value (recovery action 0, none: the series budget),
# so only "unsupported -> absent" holds.
SPARSE_FEATURE_SERIES = {"recovery_action": "gpuwatch_recovery_action"}
# Every GPU of every backend has these.
ALWAYS = ("gpuwatch_gpu_info", "gpuwatch_gpu_up", "gpuwatch_temperature_celsius", "gpuwatch_clock_hertz",
          "gpuwatch_memory_total_bytes", "gpuwatch_memory_used_bytes", "gpuwatch_memory_free_bytes",
          "gpuwatch_performance_state", "gpuwatch_temperature_threshold_celsius", "gpuwatch_clock_max_hertz")


def once(env, *args):
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "once", "--log.format", "json", *args],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [
        (s.name if f.type != "counter" or s.name.endswith("_total") else s.name, s.labels, s.value)
        for f in text_string_to_metric_families(result.stdout)
        for s in f.samples
        if s.name.startswith("gpuwatch_")
    ]


def nvml(tmp_path, profiles):
    fx = fakenvml.prepare(tmp_path, fakenvml.FakeNode.from_profiles(profiles))
    return once(fake_env(fx), "--backend", "nvml")


def simulated(tmp_path, profile):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    return once(env, "--backend", "simulated", "--sim.gpus", "2", "--sim.profile", profile)


def replay(tmp_path, profile):
    """A simulated node recorded with `gpuwatch record`, played back with the replay backend."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    trace = tmp_path / "trace.jsonl"
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "record", "--output", str(trace), "--duration", "1.5s",
                             "--backend", "simulated", "--sim.gpus", "2", "--sim.profile", profile,
                             "--poll.interval", "0.5", "--log.format", "json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return once(env, "--backend", "replay", "--replay.file", str(trace))


BACKENDS = {
    "nvml-h200": lambda tmp: nvml(tmp, ["h200", "h200"]),
    "nvml-rtx": lambda tmp: nvml(tmp, ["rtx", "rtx"]),
    "nvml-h100-mig": lambda tmp: nvml(tmp, ["h100-mig", "h100-mig"]),
    "simulated-h200": lambda tmp: simulated(tmp, "h200"),
    "simulated-rtx6000": lambda tmp: simulated(tmp, "rtx6000"),
    "simulated-h100-mig": lambda tmp: simulated(tmp, "h100-mig"),
    "replay-h200": lambda tmp: replay(tmp, "h200"),
    "replay-rtx6000": lambda tmp: replay(tmp, "rtx6000"),
}


@pytest.fixture(params=sorted(BACKENDS), scope="module")
def exposition(request, tmp_path_factory):
    return request.param, BACKENDS[request.param](tmp_path_factory.mktemp(request.param))


def per_gpu(samples):
    gpus = {}
    for name, labels, value in samples:
        if "uuid" in labels:
            gpus.setdefault(labels["uuid"], []).append((name, labels, value))
    return gpus


def test_names_and_labels_follow_the_catalogue(exposition):
    _, samples = exposition
    for name, labels, _ in samples:
        spec = CATALOGUE[name]
        assert sorted(labels) == sorted(spec.labels), (name, labels)
        if "gpu" in labels:
            assert labels["gpu"].isdigit() and labels["uuid"].startswith("GPU-")


def test_features_match_the_series_present(exposition):
    backend, samples = exposition
    gpus = per_gpu(samples)
    assert len(gpus) == 2
    for uuid, series in gpus.items():
        features = {l["feature"]: v for n, l, v in series if n == "gpuwatch_gpu_feature_supported"}
        # a class of hardware (NVLink, GPM, ...) has a feature series only where the GPU has it and it cannot be
        # read (0; device-level GPM on a MIG-enabled GPU); every other feature is 1 or 0; 1 exactly where its
        # family has a series
        assert set(FEATURE_SERIES) - HARDWARE_FEATURES | set(SPARSE_FEATURE_SERIES) <= set(features), backend
        assert set(features) <= set(FEATURE_SERIES) | set(SPARSE_FEATURE_SERIES), backend
        assert all(features[f] == 0 for f in set(features) & HARDWARE_FEATURES), backend
        for feature, (family, match) in FEATURE_SERIES.items():
            present = any(n == family and all(l.get(k) == v for k, v in match.items()) for n, l, _ in series)
            if feature in HARDWARE_FEATURES:
                assert not (present and feature in features), (backend, uuid, feature)
                continue
            assert present == bool(features[feature]), (backend, uuid, feature)
        for feature, family in SPARSE_FEATURE_SERIES.items():
            assert features[feature] or not any(n == family for n, _, _ in series), (backend, uuid, feature)
        for family in ALWAYS:
            assert any(n == family for n, _, _ in series), (backend, family)


def test_values_are_in_base_units_and_never_nan(exposition):
    backend, samples = exposition
    for name, labels, value in samples:
        assert value == value, (name, labels)  # no NaN
        if name.endswith("_ratio"):
            assert 0 <= value <= 2, (name, value)
        if name == "gpuwatch_temperature_celsius":
            assert 0 < value < 130
        if name == "gpuwatch_clock_hertz":
            assert value >= 1e6  # hertz, not MHz
        if name == "gpuwatch_power_watts":
            assert 1 < value < 2000  # watts, not mW


def test_fanless_profiles_have_no_fans_and_fanned_ones_do(exposition):
    backend, samples = exposition
    fan = [v for n, l, v in samples if n == "gpuwatch_gpu_feature_supported" and l["feature"] == "fan"]
    fan_series = [n for n, _, _ in samples if n.startswith("gpuwatch_fan_")]
    if "h200" in backend or "h100" in backend:  # SXM boards are passively cooled
        assert fan == [0.0, 0.0] and fan_series == []
    else:
        assert fan == [1.0, 1.0] and "gpuwatch_fan_speed_ratio" in fan_series
