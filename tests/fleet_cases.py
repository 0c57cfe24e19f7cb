"""The promtool cases of the facility rules, written from one description of a simulated fleet.

    .venv/bin/python tests/fleet_cases.py      # writes alerts/tests/fleet.test.yml

Two rooms: hall-1 with racks r1-r3, hall-2 with rack r4; four nodes per rack, two H200s per node,
every GPU loaded (600 W of its 700 W limit) at 60 °C, 27 °C below its 87 °C slowdown threshold.
One timeline, a fault per 20-minute phase, each of which must fire exactly its own alert:

    0-20 m   nothing: quiet everywhere
    20-40 m  rack r2's inlet warms by 10 °C: its GPUs run at 70 °C    -> GpuwatchRackCooling{rack="r2"}
    40-60 m  node r1-n2's chassis fans fail: its GPUs at 74 °C          -> GpuwatchNodeCooling{instance="r1-n2:19400"}
    60-80 m  one GPU (r3-n1, GPU 1) loses its cooling: 85 °C           -> none of these (thermal_outlier's, on the node)
    80-100 m room hall-2's cooling fails: its GPUs at 72 °C, throttling -> GpuwatchRoomCooling{room="hall-2"}
    100-120 m rack r1's 8 GPUs draw 700 W each (5.6 kW budget: 100 %)    -> GpuwatchRackPowerBudget{rack="r1"},
                                                                          GpuwatchPduPowerBudget{pdu="pdu-r1"}
tests/test_alerts.py checks that the file is what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "alerts" / "tests" / "fleet.test.yml"
RACKS = {"r1": "hall-1", "r2": "hall-1", "r3": "hall-1", "r4": "hall-2"}
NODES, GPUS, PHASE, PHASES = 4, 2, 20, 6
BASE_C, SLOWDOWN_C, WATTS, LIMIT = 60, 87, 600, 700


def timeline(values: list[float]) -> str:
    """promtool's expanding notation for one value per minute: 'a x n b x m' runs."""
    runs: list[tuple[float, int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return " ".join(f"{v:g}x{n - 1}" if n > 1 else f"{v:g}" for v, n in runs)


def phase_of(minute: int) -> int:
    return minute // PHASE


def temperature(rack: str, node: int, gpu: int, minute: int) -> float:
    p = phase_of(minute)
    if p == 1 and rack == "r2":
        return BASE_C + 10
    if p == 2 and rack == "r1" and node == 2:
        return BASE_C + 14
    if p == 3 and rack == "r3" and node == 1 and gpu == 1:
        return 85
    if p == 4 and RACKS[rack] == "hall-2":
        return BASE_C + 12
    return BASE_C + (gpu + node) % 2  # 60 or 61: not all equal


def power(rack: str, minute: int) -> float:
    return LIMIT if phase_of(minute) == 5 and rack == "r1" else WATTS


def throttling(rack: str, minute: int) -> int:
    return int(phase_of(minute) == 4 and RACKS[rack] == "hall-2")


def series() -> list[tuple[str, str]]:
    minutes = range(PHASE * PHASES + 1)
    out = []
    for rack, room in RACKS.items():
        for node in range(1, NODES + 1):
            instance = f"{rack}-n{node}:19400"
            pdu = f"pdu-{rack}"
            out.append((f'gpuwatch_node_info{{job="gpuwatch",instance="{instance}",rack="{rack}",row="a",'
                        f'room="{room}",pdu="{pdu}"}}', timeline([1] * len(minutes))))
            for gpu in range(GPUS):
                ids = f'job="gpuwatch",instance="{instance}",gpu="{gpu}",uuid="GPU-{rack}-{node}-{gpu}"'
                out.append((f'gpuwatch_temperature_celsius{{{ids},sensor="gpu"}}',
                            timeline([temperature(rack, node, gpu, m) for m in minutes])))
                out.append((f'gpuwatch_temperature_threshold_celsius{{{ids},threshold="slowdown"}}',
                            timeline([SLOWDOWN_C] * len(minutes))))
                out.append((f'gpuwatch_power_watts{{{ids}}}', timeline([power(rack, m) for m in minutes])))
                out.append((f'gpuwatch_power_limit_watts{{{ids},limit="enforced"}}', timeline([LIMIT] * len(minutes))))
                for reason in ("sw_thermal_slowdown", "hw_thermal_slowdown"):
                    out.append((f'gpuwatch_clocks_event_active{{{ids},reason="{reason}"}}',
                                timeline([throttling(rack, m) for m in minutes])))
    return out


BASE = "https://github.com/gpuwatch/gpuwatch/blob/main/docs/runbooks.md#"
EXPECTED = {  # alert -> (phase, labels, summary, description with the value, runbook)
    "GpuwatchRackCooling": (1, {"job": "gpuwatch", "rack": "r2", "row": "a", "room": "hall-1", "severity": "warning"},
                            "The GPUs of rack r2 heat together."),
    "GpuwatchNodeCooling": (2, {"job": "gpuwatch", "instance": "r1-n2:19400", "rack": "r1", "row": "a",
                                "room": "hall-1", "pdu": "pdu-r1", "severity": "warning"},
                            "Every loaded GPU of r1-n2:19400 runs hotter than its rack."),
    "GpuwatchRoomCooling": (4, {"job": "gpuwatch", "room": "hall-2", "severity": "critical"},
                            "The GPUs of room hall-2 heat together."),
    "GpuwatchRackPowerBudget": (5, {"job": "gpuwatch", "rack": "r1", "row": "a", "room": "hall-1",
                                    "severity": "warning"},
                                "The GPUs of rack r1 draw close to its power budget."),
    "GpuwatchPduPowerBudget": (5, {"job": "gpuwatch", "pdu": "pdu-r1", "severity": "warning"},
                               "The GPUs on PDU pdu-r1 draw close to its power budget."),
}


def descriptions() -> dict[str, str]:
    """The alerts' descriptions with the values this fleet gives (kept beside the rules' text)."""
    return {
        "GpuwatchRackCooling": (
            "The loaded GPUs of rack r2 (room hall-1) run more than 8 °C hotter than the rest of their room at "
            "comparable power, or a quarter of them throttle for heat at once (value 17): the rack's air supply "
            "cannot keep up (inlet temperature, a failed rear-door or in-row cooler, hot-aisle leakage). Check the "
            "rack's inlet sensors and the room's cooling; single hot GPUs are GpuwatchThermalOutlier, single nodes "
            "GpuwatchNodeCooling."),
        "GpuwatchNodeCooling": (
            "Even the coolest loaded GPU of r1-n2:19400 (rack r1) has only 13 °C left before its slowdown "
            "threshold, more than 10 °C less than the rack's median at comparable power: the node's own cooling is "
            "failing (chassis fans, a blocked inlet, a missing blank). Check the BMC's fan and inlet sensors "
            "(ipmitool sdr type Fan, Temperature)."),
        "GpuwatchRoomCooling": (
            "The loaded GPUs of room hall-2 run more than 8 °C hotter than the rest of the site at comparable "
            "power, or a quarter of them throttle for heat at once (value 15): the room's cooling cannot keep up "
            "and every job there runs at reduced clocks. Call facilities: CRAC/CRAH units, chilled water, the "
            "room's temperature and humidity."),
        "GpuwatchRackPowerBudget": (
            "The GPUs of rack r1 have drawn 100% of the rack's declared power budget for 10 minutes (GPUs only: the "
            "nodes' CPUs, fans and the switches come on top). Lower the GPUs' power limits there, move jobs, or "
            "raise the budget with facilities."),
        "GpuwatchPduPowerBudget": (
            "The GPUs fed by PDU pdu-r1 have drawn 100% of its declared budget for 10 minutes (GPUs only: the rest "
            "of the nodes comes on top): one more busy node can trip the circuit. Lower the GPUs' power limits on "
            "that PDU or move jobs."),
    }


def render() -> str:
    lines = [
        "# Generated by tests/fleet_cases.py (the fleet and its timeline are described there); regenerate with",
        "#   .venv/bin/python tests/fleet_cases.py",
        "rule_files:",
        "  - ../gpuwatch.rules.yml",
        "  - ../gpuwatch-site.rules.yml",
        "  - ../../deploy/prometheus/recording.rules.yml",
        "  - ../../deploy/prometheus/budgets.rules.yml",
        "",
        "evaluation_interval: 1m",
        "",
        "tests:",
        "  - name: a simulated fleet, one facility fault per 20 minutes, each fires exactly its own alert",
        "    interval: 1m",
        "    input_series:",
    ]
    for name, values in series():
        lines.append(f"      - series: '{name}'")
        lines.append(f"        values: '{values}'")
    # the power budgets below are the example file's for r12/pdu-r12-a, not r1: declare r1's here
    lines.append("      - series: 'rack:gpuwatch_power_budget_watts:declared{rack=\"r1\"}'")
    lines.append(f"        values: '{timeline([5600] * (PHASE * PHASES + 1))}'")
    lines.append("      - series: 'pdu:gpuwatch_power_budget_watts:declared{pdu=\"pdu-r1\"}'")
    lines.append(f"        values: '{timeline([5600] * (PHASE * PHASES + 1))}'")
    lines.append("    alert_rule_test:")
    texts = descriptions()
    for alert, (phase, labels, summary) in EXPECTED.items():
        for minute in sorted({p * PHASE + 15 for p in range(PHASES)} | {phase * PHASE + 5}):
            firing = phase_of(minute) == phase and minute % PHASE >= 12
            lines.append(f"      - eval_time: {minute}m")
            lines.append(f"        alertname: {alert}")
            if not firing:
                lines.append("        exp_alerts: []")
                continue
            lines.append("        exp_alerts:")
            shown = ", ".join(f'{k}: "{v}"' for k, v in labels.items())
            lines.append(f"            - exp_labels: {{{shown}}}")
            lines.append("              exp_annotations:")
            lines.append(f'                summary: "{summary}"')
            lines.append(f'                description: "{texts[alert]}"')
            lines.append(f'                runbook_url: "{BASE}{alert.lower()}"')
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.exit(0)
