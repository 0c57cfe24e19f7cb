"""End to end: gpuwatch -> Prometheus with the shipped alert rules -> Alertmanager -> a webhook.

A fan that stalls arrives as a GpuwatchFanStalled notification with instance, gpu and uuid, and its
resolution arrives when the fan recovers; the same for a GPU that overheats. The shipped rules are
used as they are except for their `for:` durations, shortened in a temporary copy; gpuwatch's own
hold/clear times are shortened through its configuration file.
"""

import re
from pathlib import Path

import fakenvml
import pytest
import yaml
from daemon import Daemon, fake_env, wait_for
from promstack import Alertmanager, Prometheus, Webhook

pytestmark = [pytest.mark.daemon, pytest.mark.stack]  # gpuwatch, Prometheus and Alertmanager end to end

ALERTS = Path(__file__).resolve().parents[1] / "alerts" / "gpuwatch.rules.yml"


def short_rules(tmp_path):
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


@pytest.fixture()
def stack(tmp_path):
    node = fakenvml.FakeNode.rtx(2)
    fx = fakenvml.prepare(tmp_path, node)
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules:\n  fan_stalled: {hold: 2, clear: 2}\n  overheating: {hold: 2, clear: 2}\n"
                      "  thermal_throttling: {enabled: false}\n  fan_at_max: {enabled: false}\n")
    gw = Daemon(tmp_path, fake_env(fx), ["--config", str(config)])
    hook = Webhook()
    am = Alertmanager(tmp_path, hook.url)
    target = gw.base.removeprefix("http://")
    prom = Prometheus(tmp_path, [target], [short_rules(tmp_path)], alertmanager=am.address)
    try:
        yield node, fx, gw, prom, hook, target
    finally:
        prom.stop()
        am.stop()
        hook.close()
        gw.stop()


def notification(hook, name, status):
    found = hook.alerts(name, status)
    return found[0] if found else None


def test_fan_stall_and_overheating_are_notified_and_resolved(stack):
    node, fx, gw, prom, hook, target = stack
    wait_for(lambda: prom.query('up{job="gpuwatch"} == 1'), 30, "the first scrape")
    # GPU 1's fan stops while the driver asks for 80 %; GPU 0 runs 2 °C under its 96 °C slowdown.
    node.gpus[1].fan_speeds = [0, 0]
    node.gpus[1].fan_targets = [80, 80]
    node.gpus[1].fan_rpms = [0, 0]
    node.gpus[1].temperature = 70
    node.gpus[0].temperature = 94
    fx.write(node)

    stalled = wait_for(lambda: notification(hook, "GpuwatchFanStalled", "firing"), 60, "GpuwatchFanStalled")
    assert stalled["labels"]["instance"] == target
    assert stalled["labels"]["gpu"] == "1" and stalled["labels"]["uuid"] == node.gpus[1].uuid
    assert stalled["labels"]["severity"] == "critical"
    assert stalled["annotations"]["summary"] and re.search(r"runbooks\.md#gpuwatchfanstalled$",
                                                           stalled["annotations"]["runbook_url"])
    hot = wait_for(lambda: notification(hook, "GpuwatchOverheating", "firing"), 60, "GpuwatchOverheating")
    assert (hot["labels"]["instance"], hot["labels"]["gpu"], hot["labels"]["uuid"]) == (target, "0", node.gpus[0].uuid)
    assert not [a for a in hook.alerts("GpuwatchFanStalled", "firing") if a["labels"]["gpu"] != "1"]

    node.gpus[1].fan_speeds = [80, 80]
    node.gpus[1].fan_rpms = [3000, 3000]
    node.gpus[0].temperature = 60
    fx.write(node)
    resolved = wait_for(lambda: notification(hook, "GpuwatchFanStalled", "resolved"), 90, "the fan's resolution")
    assert (resolved["labels"]["gpu"], resolved["labels"]["uuid"]) == ("1", node.gpus[1].uuid)
    wait_for(lambda: notification(hook, "GpuwatchOverheating", "resolved"), 90, "the overheating resolution")
