"""The facility side on the node: where it stands (gpuwatch_node_info) and its power budget, through
the agent (in-process) and its configuration."""

from __future__ import annotations

import subprocess
import sys

import fakenvml
import pytest
from daemon import fake_env


def test_node_topology_and_power_budget_are_exported_from_the_configuration(inproc, tmp_path):
    node = fakenvml.FakeNode.h200(2)
    for gpu in node.gpus:
        gpu.power_mw = 650_000
    config = tmp_path / "gpuwatch.yml"
    config.write_text("node: {rack: r12, row: b, room: hall-1, pdu: pdu-r12-a, power_budget_watts: 1400}\n"
                      "rules: {node_power_budget: {hold: 0}}\n")
    d = inproc(node, args=["--config", str(config), "--node.rack", "r13"])  # a flag beats the file
    d.wait_value("gpuwatch_node_info", 1, rack="r13", row="b", room="hall-1", pdu="pdu-r12-a")
    assert d.value("gpuwatch_node_power_budget_watts") == 1400
    d.wait_value("gpuwatch_node_anomaly", 1, rule="node_power_budget", severity="warning")  # 1,300 W: 93 %


@pytest.mark.daemon  # the command's exit status
def test_a_budget_that_is_not_a_positive_number_is_a_configuration_error(tmp_path):
    fx = fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(1))
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "run", "--node.power-budget-watts", "-5"],
                            env=fake_env(fx), capture_output=True, text=True, timeout=60)
    assert result.returncode == 78
    assert "node.power-budget-watts: must be a positive number of watts" in result.stderr


def test_sim_fault_specs_run_faults_from_the_start_on_one_gpu_or_all():
    """--sim.fault (fleet runs): inlet_warm@1 heats GPU 1 by about its 10 °C at the same power; a spec
    that is not KIND[@GPU][:param=value] or names an unknown kind is a configuration error."""
    import pytest

    from gpuwatch import config as configuration
    from gpuwatch.agent import make_backend
    from gpuwatch.backends.simulated.tour import parse_fault_spec
    from gpuwatch.clock import FakeClock
    from gpuwatch.errors import ConfigError

    faults = parse_fault_spec("load:utilization=0.9", 2) + parse_fault_spec("inlet_warm@1:celsius=10", 2)
    assert [(f.kind, f.gpu, f.params.get("celsius")) for f in faults] == [
        ("load", 0, None), ("load", 1, None), ("inlet_warm", 1, 10.0)]
    clock = FakeClock()
    backend = make_backend(configuration.load(overrides={"backend": "simulated", "sim_profile": "h200", "sim_gpus": 2,
                                                         "sim_fault": ["load:utilization=0.9", "inlet_warm@1"]}), clock)
    backend.open()
    uuids = [g.identity.uuid for g in backend.discover()]
    clock.advance(600)
    cool, warm = (backend.read_fast(u) for u in uuids)
    assert abs(cool.power.power_watts - warm.power.power_watts) < 30
    assert 7 <= warm.thermal.temperature_celsius - cool.thermal.temperature_celsius <= 13
    for bad, says in (("inlet warm", "is not KIND"), ("nope@1", "unknown fault kind"), ("load@7", "has 2 GPUs")):
        with pytest.raises(ConfigError, match=says):
            make_backend(configuration.load(overrides={"backend": "simulated", "sim_gpus": 2, "sim_fault": [bad]}),
                         FakeClock())
