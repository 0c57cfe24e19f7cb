"""The facility side on the node: where it stands (gpuwatch_node_info) and its power budget, through
the real daemon and its configuration."""

from __future__ import annotations

import subprocess
import sys

import fakenvml
from daemon import fake_env


def test_node_topology_and_power_budget_are_exported_from_the_configuration(start, tmp_path):
    node = fakenvml.FakeNode.h200(2)
    for gpu in node.gpus:
        gpu.power_mw = 650_000
    config = tmp_path / "gpuwatch.yml"
    config.write_text("node: {rack: r12, row: b, room: hall-1, pdu: pdu-r12-a, power_budget_watts: 1400}\n"
                      "rules: {node_power_budget: {hold: 0}}\n")
    d = start(node, args=["--config", str(config), "--node.rack", "r13"])  # a flag beats the file
    d.wait_value("gpuwatch_node_info", 1, rack="r13", row="b", room="hall-1", pdu="pdu-r12-a")
    assert d.value("gpuwatch_node_power_budget_watts") == 1400
    d.wait_value("gpuwatch_node_anomaly", 1, rule="node_power_budget", severity="warning")  # 1,300 W: 93 %


def test_a_budget_that_is_not_a_positive_number_is_a_configuration_error(tmp_path):
    fx = fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(1))
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "run", "--node.power-budget-watts", "-5"],
                            env=fake_env(fx), capture_output=True, text=True, timeout=60)
    assert result.returncode == 78
    assert "node.power-budget-watts: must be a positive number of watts" in result.stderr
