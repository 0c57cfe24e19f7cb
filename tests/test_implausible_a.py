"""What NVML answers that no GPU can have (a sentinel, NaN, a value beyond physics) in the thermal, fans,
power, utilization and memory groups: left out of the exposition, counted as implausible_value in
gpuwatch_poll_errors_total, logged once per GPU and reading (nvml_reading_implausible), the GPU's other
readings and the other GPUs exported as usual, and the reading exported again once it is plausible.

Over the real pynvml binding and the fake libnvidia-ml.so.1 (tests/fakenvml), the agent in-process on
simulated time (the ``inproc`` fixture); the fan-count cap patches the binding in a child process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter

import fakenvml
from daemon import isolated_env

U32 = 0xFFFFFFFF
NAN = math.nan


def labels(node, i, **extra):
    return dict(gpu=str(i), uuid=node.gpus[i].uuid, **extra)


def start(inproc, node, args=None):
    """The agent after its first slow poll and a few fast ones (the warnings of the first polls logged)."""
    d = inproc(node, args=args)
    d.wait_value("gpuwatch_poll_success", 1, tier="slow")
    d.polls(3)
    return d


def implausible(d, tier):
    return d.value("gpuwatch_poll_errors_total", tier=tier, error="implausible_value")


def logged(d):
    """(uuid, reading) -> how many nvml_reading_implausible lines say so."""
    return Counter((e.get("uuid"), e.get("reading")) for e in d.events() if e["event"] == "nvml_reading_implausible")


def fixed(d, node, slow=False):
    """Write the node's plausible state and let the next poll (fast, or slow too) read it."""
    d.fx.write(node)
    if slow:
        d.advance(d.config.poll_slow_interval)
    d.polls(2)


def test_thermal_sentinels_and_nan_are_left_out_and_no_threshold_is_derived_from_them(inproc):
    node = fakenvml.FakeNode.h200(2)
    g0, g1 = node.gpus
    g0.temperature = 1000  # beyond physics
    g0.set_field(82, NAN, "d")  # memory temperature: a double field answering NaN
    g0.tlimit_thresholds = (-8, -2**31, 0, 0)  # slowdown T.Limit: INT_MIN
    d = start(inproc, node)
    value = d.value
    assert value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) is None
    assert value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="memory")) is None
    assert value("gpuwatch_temperature_margin_threshold_celsius", **labels(node, 0, threshold="slowdown")) is None
    # no derived (absolute) threshold from a rejected temperature: none at all, NVML has no absolute ones here
    assert not [k for k in d.metrics() if k[0] == "gpuwatch_temperature_threshold_celsius"
                and dict(k[1])["gpu"] == "0"]
    # the GPU's other readings, and the other GPU
    assert value("gpuwatch_temperature_margin_celsius", **labels(node, 0)) == g0.margin_temperature
    assert value("gpuwatch_temperature_margin_threshold_celsius", **labels(node, 0, threshold="shutdown")) == -8
    assert value("gpuwatch_temperature_celsius", **labels(node, 1, sensor="gpu")) == g1.temperature
    assert value("gpuwatch_temperature_celsius", **labels(node, 1, sensor="memory")) == g1.memory_temperature
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 1, threshold="slowdown")) == \
        g1.temperature + g1.margin_temperature + 2
    assert implausible(d, "fast") >= 2 * 4 and implausible(d, "slow") >= 1
    assert value("gpuwatch_collector_success", group="thermal") == 0
    assert value("gpuwatch_collector_success", group="power") == 1
    assert logged(d) == {(g0.uuid, "temperature_celsius"): 1, (g0.uuid, "memory_temperature_celsius"): 1,
                         (g0.uuid, "temperature_margin_threshold_celsius{threshold=slowdown}"): 1}

    g0.temperature, g0.tlimit_thresholds = 40, (-8, -2, 0, 0)
    g0.set_field(82, 45, "ui")
    fixed(d, node, slow=True)
    assert value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == 40
    assert value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="memory")) == 45
    assert value("gpuwatch_temperature_margin_threshold_celsius", **labels(node, 0, threshold="slowdown")) == -2
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 0, threshold="slowdown")) == \
        40 + g0.margin_temperature + 2
    assert value("gpuwatch_collector_success", group="thermal") == 1
    assert len(logged(d)) == 3  # nothing more logged


def test_an_implausible_margin_derives_no_threshold_and_an_absolute_sentinel_is_left_out(inproc):
    node = fakenvml.FakeNode.from_profiles(["h200", "rtx", "rtx"])
    h200, rtx, other = node.gpus
    h200.margin_temperature = 0x7FFFFFFF
    rtx.thresholds[1] = U32  # slowdown, from nvmlDeviceGetTemperatureThreshold
    d = start(inproc, node)
    value = d.value
    assert value("gpuwatch_temperature_margin_celsius", **labels(node, 0)) is None
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 0, threshold="slowdown")) is None
    assert value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == h200.temperature
    assert value("gpuwatch_temperature_margin_threshold_celsius", **labels(node, 0, threshold="slowdown")) == -2
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 1, threshold="slowdown")) is None
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 1, threshold="shutdown")) == \
        rtx.thresholds[0]
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 2, threshold="slowdown")) == \
        other.thresholds[1]
    assert implausible(d, "fast") >= 4 and implausible(d, "slow") >= 1
    assert logged(d) == {(h200.uuid, "temperature_margin_celsius"): 1,
                         (rtx.uuid, "temperature_threshold_celsius{threshold=slowdown}"): 1}

    h200.margin_temperature, rtx.thresholds[1] = 50, 90
    fixed(d, node, slow=True)
    assert value("gpuwatch_temperature_margin_celsius", **labels(node, 0)) == 50
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 0, threshold="slowdown")) == \
        h200.temperature + 50 + 2
    assert value("gpuwatch_temperature_threshold_celsius", **labels(node, 1, threshold="slowdown")) == 90


def test_old_drivers_temperature_sentinel_is_left_out(inproc):
    node = fakenvml.FakeNode.l40s(2)
    node.gpus[0].temperature = U32  # nvmlDeviceGetTemperature (no TemperatureV): unsigned
    d = inproc(node, old_driver=True)
    d.wait_value("gpuwatch_temperature_celsius", node.gpus[1].temperature, **labels(node, 1, sensor="gpu"))
    d.polls(2)
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) is None
    assert implausible(d, "fast") >= 2
    assert logged(d) == {(node.gpus[0].uuid, "temperature_celsius"): 1}
    node.gpus[0].temperature = 35
    fixed(d, node)
    assert d.value("gpuwatch_temperature_celsius", **labels(node, 0, sensor="gpu")) == 35


def test_fan_readings_beyond_their_range_are_left_out(inproc):
    node = fakenvml.FakeNode.rtx(2)
    g0, g1 = node.gpus
    g0.fan_speeds[0] = 255  # beyond the 200 % NVML allows
    g0.fan_targets[0] = U32
    g0.fan_rpms[1] = U32
    d = start(inproc, node)
    value = d.value
    assert value("gpuwatch_fan_speed_ratio", **labels(node, 0, fan="0")) is None
    assert value("gpuwatch_fan_target_speed_ratio", **labels(node, 0, fan="0")) is None
    assert value("gpuwatch_fan_speed_rpm", **labels(node, 0, fan="1")) is None
    assert value("gpuwatch_fan_speed_rpm", **labels(node, 0, fan="0")) == g0.fan_rpms[0]
    assert value("gpuwatch_fan_speed_ratio", **labels(node, 0, fan="1")) == g0.fan_speeds[1] / 100
    assert value("gpuwatch_fan_target_speed_ratio", **labels(node, 0, fan="1")) == g0.fan_targets[1] / 100
    for fan in ("0", "1"):
        assert value("gpuwatch_fan_speed_ratio", **labels(node, 1, fan=fan)) == g1.fan_speeds[int(fan)] / 100
    assert implausible(d, "fast") >= 3 * 4
    assert value("gpuwatch_collector_success", group="fans") == 0
    assert logged(d) == {(g0.uuid, "fan_speed{fan=0}"): 1, (g0.uuid, "fan_target_speed{fan=0}"): 1,
                         (g0.uuid, "fan_speed_rpm{fan=1}"): 1}

    g0.fan_speeds[0], g0.fan_targets[0], g0.fan_rpms[1] = 150, 120, 2000  # over 100 %: what NVML allows
    fixed(d, node)
    assert value("gpuwatch_fan_speed_ratio", **labels(node, 0, fan="0")) == 1.5
    assert value("gpuwatch_fan_target_speed_ratio", **labels(node, 0, fan="0")) == 1.2
    assert value("gpuwatch_fan_speed_rpm", **labels(node, 0, fan="1")) == 2000
    assert value("gpuwatch_collector_success", group="fans") == 1


_NUM_FANS = r'''
import io, json, os, sys
import pynvml as N
N.nvmlDeviceGetNumFans = lambda handle: 0xFFFFFFFF  # a driver answering its sentinel
from gpuwatch import logs
buf = io.StringIO()
logs.configure("debug", "json", stream=buf)
from gpuwatch.agent import Agent
from gpuwatch.testing import load_config
agent = Agent(load_config([], dict(os.environ)))
agent.poller.poll_fast()
agent.poller.poll_fast()
out = agent.exposition.render()[0]
print(json.dumps({"exposition": out.decode() if isinstance(out, bytes) else out, "log": buf.getvalue()}))
'''


def test_an_absurd_fan_count_is_capped_to_the_fans_that_answer(tmp_path):
    """nvmlDeviceGetNumFans answering 0xFFFFFFFF builds no 4e9 readers: at most 32 fans are probed, those that
    answer are read, and the count is logged once."""
    node = fakenvml.FakeNode.rtx(1)
    fx = fakenvml.prepare(tmp_path, node)
    result = subprocess.run([sys.executable, "-c", _NUM_FANS], env=isolated_env({**fx.env, "FAKE_NVML_RECHECK_MS": "0"}),
                            capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.splitlines()[-1])
    fans = sorted(line.split(" ")[0] for line in answer["exposition"].splitlines() if line.startswith("gpuwatch_fan_"))
    assert len(fans) == 3 * len(node.gpus[0].fan_speeds), fans
    assert f'gpuwatch_fan_speed_ratio{{fan="1",gpu="0",uuid="{node.gpus[0].uuid}"}}' in fans
    events = [json.loads(line) for line in answer["log"].splitlines() if line.startswith("{")]
    capped = [e for e in events if e["event"] == "nvml_reading_implausible"]
    assert [e["reading"] for e in capped] == ["fan_count"], capped
    assert 'gpuwatch_poll_errors_total{' not in answer["exposition"]


def test_power_sentinels_nan_and_a_negative_energy_are_left_out(inproc):
    node = fakenvml.FakeNode.h200(2)
    g0, g1 = node.gpus
    g0.power_mw = U32  # field 185
    g0.enforced_power_limit_mw = U32
    g0.power_limit_constraints_mw = (U32, 700_000)
    g0.set_field(83, NAN, "d")  # the energy counter
    g1.set_field(83, -5, "sll")
    d = start(inproc, node)
    value = d.value
    for name, extra in (("gpuwatch_power_watts", {}), ("gpuwatch_energy_joules_total", {}),
                        ("gpuwatch_power_limit_watts", {"limit": "enforced"}),
                        ("gpuwatch_power_limit_watts", {"limit": "min"})):
        assert value(name, **labels(node, 0, **extra)) is None, (name, extra)
    assert value("gpuwatch_energy_joules_total", **labels(node, 1)) is None
    assert value("gpuwatch_power_limit_watts", **labels(node, 0, limit="max")) == 700
    assert value("gpuwatch_power_limit_watts", **labels(node, 0, limit="default")) == 700
    assert value("gpuwatch_performance_state", **labels(node, 0)) == 0
    assert value("gpuwatch_power_watts", **labels(node, 1)) == g1.power_mw / 1000
    assert value("gpuwatch_power_limit_watts", **labels(node, 1, limit="enforced")) == 700
    assert implausible(d, "fast") >= 4 and implausible(d, "slow") >= 4  # 3 on GPU 0, 1 on GPU 1
    assert value("gpuwatch_collector_success", group="power") == 0
    assert value("gpuwatch_collector_success", group="thermal") == 1
    assert logged(d) == {(g0.uuid, "power_watts"): 1, (g0.uuid, "power_limit_watts{limit=enforced}"): 1,
                         (g0.uuid, "power_limit_watts{limit=min}"): 1, (g0.uuid, "energy_joules"): 1,
                         (g1.uuid, "energy_joules"): 1}

    g0.power_mw, g0.enforced_power_limit_mw, g0.power_limit_constraints_mw = 250_000, 650_000, (200_000, 700_000)
    g0.set_field(83, 92_000_000, "ull")
    g1.set_field(83, 93_000_000, "ull")
    fixed(d, node, slow=True)
    assert value("gpuwatch_power_watts", **labels(node, 0)) == 250
    assert value("gpuwatch_power_limit_watts", **labels(node, 0, limit="enforced")) == 650
    assert value("gpuwatch_power_limit_watts", **labels(node, 0, limit="min")) == 200
    assert value("gpuwatch_energy_joules_total", **labels(node, 0)) == 92_000
    assert value("gpuwatch_energy_joules_total", **labels(node, 1)) == 93_000
    assert value("gpuwatch_collector_success", group="power") == 1


def test_module_power_sentinel_is_left_out(inproc):
    node = fakenvml.FakeNode.gh200(2)
    g0, g1 = node.gpus
    g0.module_power_mw = U32
    d = start(inproc, node)
    assert d.value("gpuwatch_module_power_watts", **labels(node, 0)) is None
    assert d.value("gpuwatch_power_watts", **labels(node, 0)) == g0.power_mw / 1000
    assert d.value("gpuwatch_module_power_watts", **labels(node, 1)) == g1.module_power_mw / 1000
    assert implausible(d, "fast") >= 4
    assert logged(d) == {(g0.uuid, "module_power_watts"): 1}
    g0.module_power_mw = 900_000
    fixed(d, node)
    assert d.value("gpuwatch_module_power_watts", **labels(node, 0)) == 900


def test_a_power_smoothing_lifetime_out_of_range_at_a_poll_is_counted(inproc):
    """Plausible at discovery (92 %), 0xFFFFFFFF at a poll: left out and counted, no longer silently dropped."""
    node = fakenvml.FakeNode.gb200(2)
    g0, g1 = node.gpus
    d = start(inproc, node)
    assert d.value("gpuwatch_power_smoothing_lifetime_remaining_ratio", **labels(node, 0)) == 0.92
    g0.power_smoothing = {**g0.power_smoothing, 258: U32}
    d.fx.write(node)
    d.advance(d.config.poll_slow_interval)
    d.polls(2)
    assert d.value("gpuwatch_power_smoothing_lifetime_remaining_ratio", **labels(node, 0)) is None
    assert d.value("gpuwatch_power_smoothing_lifetime_remaining_ratio", **labels(node, 1)) == 0.92
    assert d.value("gpuwatch_gpu_feature_supported", **labels(node, 0, feature="power_smoothing")) is None
    assert implausible(d, "slow") >= 1
    assert d.value("gpuwatch_collector_success", group="power") == 0
    assert logged(d) == {(g0.uuid, "power_smoothing_lifetime"): 1}
    g0.power_smoothing = {**g0.power_smoothing, 258: 91}
    fixed(d, node, slow=True)
    assert d.value("gpuwatch_power_smoothing_lifetime_remaining_ratio", **labels(node, 0)) == 0.91


def test_utilization_beyond_100_percent_is_left_out(inproc):
    node = fakenvml.FakeNode.h200(2)
    g0, g1 = node.gpus
    g0.utilization = (255, 40)
    g0.encoder_utilization = (U32, 167_000)
    g1.utilization = (30, U32)
    d = start(inproc, node, args=["--collector.utilization.video"])
    value = d.value
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="gpu")) is None
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="memory")) == 0.4
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="encoder")) is None
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="decoder")) == 0
    assert value("gpuwatch_utilization_ratio", **labels(node, 1, engine="gpu")) == 0.3
    assert value("gpuwatch_utilization_ratio", **labels(node, 1, engine="memory")) is None
    assert value("gpuwatch_utilization_ratio", **labels(node, 1, engine="encoder")) == 0
    assert implausible(d, "fast") >= 2 * 4 and implausible(d, "slow") >= 1
    assert value("gpuwatch_collector_success", group="utilization") == 0
    assert logged(d) == {(g0.uuid, "utilization_ratio{engine=gpu}"): 1,
                         (g0.uuid, "utilization_ratio{engine=encoder}"): 1,
                         (g1.uuid, "utilization_ratio{engine=memory}"): 1}

    g0.utilization, g0.encoder_utilization, g1.utilization = (100, 40), (12, 167_000), (30, 55)
    fixed(d, node, slow=True)
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="gpu")) == 1
    assert value("gpuwatch_utilization_ratio", **labels(node, 0, engine="encoder")) == 0.12
    assert value("gpuwatch_utilization_ratio", **labels(node, 1, engine="memory")) == 0.55
    assert value("gpuwatch_collector_success", group="utilization") == 1


def test_memory_beyond_the_frame_buffer_is_left_out(inproc):
    node = fakenvml.FakeNode.h200(3)
    g0, g1, g2 = node.gpus
    g0.memory_used = 10**15  # more than the total (the fake answers free 0)
    g1.memory_total = 2**51  # beyond 1 PiB: free (total - reserved - used) is beyond any total too
    d = start(inproc, node)
    value = d.value
    assert value("gpuwatch_memory_used_bytes", **labels(node, 0)) is None
    assert value("gpuwatch_memory_total_bytes", **labels(node, 0)) == g0.memory_total
    assert value("gpuwatch_memory_free_bytes", **labels(node, 0)) == 0
    assert value("gpuwatch_memory_reserved_bytes", **labels(node, 0)) == g0.memory_reserved
    assert value("gpuwatch_memory_total_bytes", **labels(node, 1)) is None
    assert value("gpuwatch_memory_free_bytes", **labels(node, 1)) is None
    assert value("gpuwatch_memory_used_bytes", **labels(node, 1)) == 0
    assert value("gpuwatch_memory_reserved_bytes", **labels(node, 1)) == g1.memory_reserved
    assert value("gpuwatch_memory_total_bytes", **labels(node, 2)) == g2.memory_total
    assert value("gpuwatch_memory_used_bytes", **labels(node, 2)) == g2.memory_used
    assert implausible(d, "fast") >= 3 * 4
    assert value("gpuwatch_collector_success", group="memory") == 0
    assert logged(d) == {(g0.uuid, "memory_used_bytes"): 1, (g1.uuid, "memory_total_bytes"): 1,
                         (g1.uuid, "memory_free_bytes"): 1}

    g0.memory_used, g1.memory_total = 2**30, g2.memory_total
    fixed(d, node)
    assert value("gpuwatch_memory_used_bytes", **labels(node, 0)) == 2**30
    assert value("gpuwatch_memory_total_bytes", **labels(node, 1)) == g2.memory_total
    assert value("gpuwatch_memory_free_bytes", **labels(node, 1)) == g2.memory_total - g1.memory_reserved
    assert value("gpuwatch_collector_success", group="memory") == 1
    assert len(logged(d)) == 3
