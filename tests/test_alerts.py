"""Prometheus alert and recording rules: promtool checks and unit tests, plus what promtool cannot see.

- `promtool check rules` on both rule files (no warnings, lint problems fatal), `promtool test rules`
  on every test file, `promtool check config` on the scrape-config example in its installed layout;
- every gpuwatch rule has exactly one alert driven by its anomaly series, named after it, with the
  rule's severity; every alert has a severity, summary, description and a runbook_url whose anchor is
  a heading of docs/runbooks.md, and at least one firing and one quiet promtool test case;
- every recording rule is named level:metric:operations, tested, and documented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuwatch.rules import all_rules

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: the same documents, faster

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "alerts" / "gpuwatch.rules.yml"
# the room against the site: on one Prometheus beside ALERT_RULES, or on the global tier of a sharded fleet
SITE_RULES = ROOT / "alerts" / "gpuwatch-site.rules.yml"
ALERT_TESTS = sorted((ROOT / "alerts" / "tests").glob("*.yml"))
PROM_DIR = ROOT / "deploy" / "prometheus"
RECORDING_RULES = PROM_DIR / "recording.rules.yml"
GLOBAL_RULES = PROM_DIR / "sharding" / "global.rules.yml"  # the global store's, over the shards' recordings
SHARD_EXAMPLE = PROM_DIR / "sharding" / "shard.example.yml"
RECORDING_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
SCRAPE_EXAMPLE = PROM_DIR / "scrape-config.example.yml"
FILE_SD_EXAMPLES = sorted((PROM_DIR / "file_sd").glob("*.yml"))
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PROMETHEUS_DOC = ROOT / "docs" / "prometheus.md"
RUNBOOK_BASE = "https://github.com/gpuwatch/gpuwatch/blob/main/docs/runbooks.md#"
SEVERITIES = {"critical", "warning", "info"}
NODE_RULE_METRIC = "gpuwatch_node_anomaly"
GPU_RULE_METRIC = "gpuwatch_anomaly"
# A reference to a rule that drives an alert: the anomaly == 1, or the GPU alerts' recording of it with
# the GPU model (gpu_rule:gpuwatch_anomaly:named, the first rule of their group); the same selector after
# `unless on(...) (` only excludes (e.g. GpuwatchGpuDown stays quiet while GpuwatchGpuLost fires).
RULE_REF = re.compile(r'(gpuwatch_(?:node_)?anomaly)\{rule="([a-z0-9_]+)"\} == 1'
                      r'|gpu_rule:(gpuwatch_anomaly):named\{rule="([a-z0-9_]+)"\}')
EXCLUSION_BEFORE = re.compile(r"unless\s+on\s*\([^)]*\)\s*\(\s*$")



@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install the Debian package `prometheus` (scripts/test does) "
                    "to check and unit-test the alert and recording rules")
    return path


def run(promtool: str, *args: str | Path, cwd: Path | None = None) -> tuple[int, str]:
    result = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)
    return result.returncode, result.stdout + result.stderr


def load(path: Path) -> dict:
    with path.open(encoding="utf-8") as fh:
        return yaml.load(fh, Loader=YAML_LOADER)


def fleet_alerts() -> dict[str, str]:
    """The facility alerts (groups gpuwatch-fleet and gpuwatch-site) -> the label of the level they name."""
    found = {}
    for group in load(ALERT_RULES)["groups"] + load(SITE_RULES)["groups"]:
        if group["name"] in ("gpuwatch-fleet", "gpuwatch-site"):
            for rule in (r for r in group["rules"] if "alert" in r):
                name = rule["alert"]
                found[name] = next(level for level in ("Node", "Rack", "Room", "Pdu") if level in name).lower()
    return {name: "instance" if level == "node" else level for name, level in found.items()}


def alerts() -> list[dict]:
    return [rule for path in (ALERT_RULES, SITE_RULES) for group in load(path)["groups"] for rule in group["rules"]
            if "alert" in rule]


def recording_rules() -> list[dict]:
    """Of the recording rule files and the alert rules' own (the GPU alerts' named anomalies)."""
    return [rule for path in (RECORDING_RULES, GLOBAL_RULES, ALERT_RULES, SITE_RULES) for group in load(path)["groups"]
            for rule in group["rules"] if "record" in rule]


def test_the_fleet_promtool_cases_are_what_their_generator_writes():
    """alerts/tests/fleet.test.yml is written by tests/fleet_cases.py from its description of the fleet."""
    import fleet_cases

    assert (ROOT / "alerts" / "tests" / "fleet.test.yml").read_text() == fleet_cases.render(), \
        "regenerate with .venv/bin/python tests/fleet_cases.py"


def test_the_example_budgets_are_recorded_constants_the_ratio_rules_read():
    budgets = [rule for group in load(PROM_DIR / "budgets.rules.yml")["groups"] for rule in group["rules"]]
    assert budgets and all(r["record"] in ("rack:gpuwatch_power_budget_watts:declared",
                                           "pdu:gpuwatch_power_budget_watts:declared") for r in budgets)
    assert all(r["expr"].startswith("vector(") and len(r["labels"]) == 1 for r in budgets)
    ratios = {r["record"]: r["expr"] for r in recording_rules() if r["record"].endswith(":gpuwatch_power_budget:ratio")}
    assert "rack:gpuwatch_power_budget_watts:declared" in ratios["rack:gpuwatch_power_budget:ratio"]
    assert "pdu:gpuwatch_power_budget_watts:declared" in ratios["pdu:gpuwatch_power_budget:ratio"]


FLEET_LEVEL: dict[str, str] = fleet_alerts()


def camel(rule_id: str) -> str:
    return "Gpuwatch" + "".join(part.capitalize() for part in rule_id.split("_"))


def driving_refs(expr: str) -> list[tuple[str, str]]:
    """(metric, rule id) of every anomaly selector that makes the alert fire (not an `unless` one)."""
    return [(m.group(1) or m.group(3), m.group(2) or m.group(4)) for m in RULE_REF.finditer(expr)
            if not EXCLUSION_BEFORE.search(expr[:m.start()])]


def rule_refs(expr: str) -> list[str]:
    """Every rule id the expression refers to, driving or excluding."""
    return [m.group(2) or m.group(4) for m in RULE_REF.finditer(expr)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def runbook_anchors() -> set[str]:
    text = RUNBOOKS.read_text(encoding="utf-8")
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


def duration_seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


# ------------------------------------------------------------------------------------- promtool


@pytest.mark.stack
@pytest.mark.parametrize("path", [ALERT_RULES, SITE_RULES, RECORDING_RULES, GLOBAL_RULES], ids=lambda p: p.name)
def test_promtool_check_rules(promtool, path):
    rc, output = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", path)
    assert rc == 0, output
    assert "SUCCESS" in output, output
    assert "warning" not in output.lower(), output


@pytest.mark.stack
@pytest.mark.parametrize("path", ALERT_TESTS + RECORDING_TESTS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_promtool_test_rules(promtool, path):
    rc, output = run(promtool, "test", "rules", path.name, cwd=path.parent)
    assert rc == 0, output
    assert "SUCCESS" in output and "FAILED" not in output, output


def test_there_are_promtool_tests():
    assert ALERT_TESTS, "no promtool tests under alerts/tests"
    assert RECORDING_TESTS, "no promtool tests under deploy/prometheus/tests"


@pytest.mark.stack
def test_scrape_config_example_passes_promtool_check_config(promtool, tmp_path):
    """Installed as the example's header says: rule files under rules/, targets under file_sd/."""
    shutil.copy(SCRAPE_EXAMPLE, tmp_path / "prometheus.yml")
    (tmp_path / "rules").mkdir()
    shutil.copy(ALERT_RULES, tmp_path / "rules" / "gpuwatch.rules.yml")
    shutil.copy(RECORDING_RULES, tmp_path / "rules" / "gpuwatch-recording.rules.yml")
    shutil.copy(SITE_RULES, tmp_path / "rules" / "gpuwatch-site.rules.yml")
    (tmp_path / "file_sd").mkdir()
    assert FILE_SD_EXAMPLES, "no file_sd example under deploy/prometheus/file_sd"
    for path in FILE_SD_EXAMPLES:
        shutil.copy(path, tmp_path / "file_sd" / path.name)
    rc, output = run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert rc == 0, output
    assert "SUCCESS: 3 rule files found" in output, output
    assert "warning" not in output.lower(), output  # e.g. a file_sd glob matching no file


@pytest.mark.stack
def test_shard_example_passes_promtool_check_config(promtool, tmp_path):
    """The sharded layout of docs/scaling.md, installed as the example's header says."""
    shutil.copy(SHARD_EXAMPLE, tmp_path / "prometheus.yml")
    (tmp_path / "rules").mkdir()
    shutil.copy(ALERT_RULES, tmp_path / "rules" / "gpuwatch.rules.yml")
    shutil.copy(RECORDING_RULES, tmp_path / "rules" / "gpuwatch-recording.rules.yml")
    shutil.copy(PROM_DIR / "budgets.rules.yml", tmp_path / "rules" / "gpuwatch-budgets.rules.yml")
    (tmp_path / "file_sd").mkdir()
    for path in FILE_SD_EXAMPLES:
        shutil.copy(path, tmp_path / "file_sd" / path.name)
    rc, output = run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert rc == 0, output
    assert "SUCCESS: 3 rule files found" in output and "warning" not in output.lower(), output


def test_scrape_config_example_scrapes_gpuwatch_every_15s_from_file_sd():
    config = load(SCRAPE_EXAMPLE)
    jobs = [job for job in config["scrape_configs"] if job["job_name"].startswith("gpuwatch")]
    assert len(jobs) == 1
    job = jobs[0]
    assert re.fullmatch(r"gpuwatch.*", job["job_name"])  # what GpuwatchTargetDown selects
    assert job["scrape_interval"] == "15s"
    assert job["file_sd_configs"]
    for path in FILE_SD_EXAMPLES:
        for group in load(path):
            assert group["targets"]
            assert all(re.fullmatch(r"[a-z0-9.-]+:19400", target) for target in group["targets"])


# ------------------------------------------------------------------------------------- alerts


def test_alert_names_are_unique_camel_case_with_the_gpuwatch_prefix():
    names = [alert["alert"] for alert in alerts()]
    assert len(names) == len(set(names)), names
    for name in names:
        assert re.fullmatch(r"Gpuwatch(?:[A-Z][a-z0-9]*)+", name), name


def test_every_rule_has_exactly_one_alert_named_after_it_with_its_severity():
    """Warning and critical rules page; info rules (power_capped: normal at full load) are no per-GPU
    alert at all, at 10,000 nodes thousands of them would pend and cost the rule group most of its
    time: dashboards and /api/v1/status show them."""
    by_name = {alert["alert"]: alert for alert in alerts()}
    for rule in all_rules():
        drivers = [alert["alert"] for alert in alerts()
                   if any(ref_id == rule.id for _, ref_id in driving_refs(alert["expr"]))]
        if rule.severity == "info":
            assert drivers == [], f"{rule.id} is info: no alert, found {drivers}"
            continue
        assert drivers == [camel(rule.id)], f"{rule.id}: driven by {drivers}"
        alert = by_name[camel(rule.id)]
        metric = NODE_RULE_METRIC if rule.scope == "node" else GPU_RULE_METRIC
        assert driving_refs(alert["expr"]) and all(ref == (metric, rule.id) for ref in driving_refs(alert["expr"])), \
            f"{alert['alert']}: {alert['expr']}"
        assert alert["labels"]["severity"] == rule.severity, alert["alert"]


def test_every_alert_driver_is_a_known_rule():
    ids = {rule.id for rule in all_rules()}
    for alert in alerts():
        for rule_id in rule_refs(alert["expr"]):
            assert rule_id in ids, f"{alert['alert']} refers to unknown rule {rule_id}"


def test_exporter_health_is_covered():
    exprs = {alert["alert"]: alert["expr"] for alert in alerts()}
    assert re.search(r'up\{job=~"gpuwatch\.\*"\} == 0', exprs["GpuwatchTargetDown"])
    assert "gpuwatch_last_poll_timestamp_seconds" in exprs["GpuwatchDataStale"]
    assert "gpuwatch_gpu_up == 0" in exprs["GpuwatchGpuDown"]
    # against a recorded expectation (a 5-minute rule group), never a day of raw gpuwatch_gpus
    assert "max_over_time(instance:gpuwatch_gpus:max1d[15m])" in exprs["GpuwatchGpuCountDropped"]
    assert "gpuwatch_gpus[1d]" not in exprs["GpuwatchGpuCountDropped"]


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_alert_has_severity_summary_description_and_runbook(alert):
    assert alert["labels"]["severity"] in SEVERITIES
    annotations = alert["annotations"]
    assert annotations["summary"].strip().endswith(".")
    assert annotations["summary"][0].isupper() or annotations["summary"].startswith(("gpuwatch", "{{"))
    assert len(annotations["description"]) > len(annotations["summary"])
    level = FLEET_LEVEL.get(alert["alert"], "instance")  # fleet alerts name their rack, room or PDU
    assert f"{{{{ $labels.{level} }}}}" in annotations["summary"] + annotations["description"]
    url = annotations["runbook_url"]
    assert url == RUNBOOK_BASE + alert["alert"].lower()
    assert url.removeprefix(RUNBOOK_BASE) in runbook_anchors(), f"no section {alert['alert']} in docs/runbooks.md"


def test_gpu_alerts_name_the_gpu():
    for alert in alerts():
        refs = driving_refs(alert["expr"])
        if refs and refs[0][0] == GPU_RULE_METRIC or "gpuwatch_gpu_up" in alert["expr"]:
            text = alert["annotations"]["summary"] + alert["annotations"]["description"]
            for label in ("gpu", "uuid", "instance"):
                assert f"$labels.{label}" in text, (alert["alert"], label)


def test_anomaly_alerts_keep_for_short():
    """gpuwatch already holds a rule before gpuwatch_anomaly turns 1: a long `for:` only delays."""
    for alert in alerts():
        if driving_refs(alert["expr"]) and alert["labels"]["severity"] != "info":
            limit = 60 if alert["labels"]["severity"] == "critical" else 300
            assert duration_seconds(alert.get("for", "0s")) <= limit, alert["alert"]


def test_every_runbook_section_is_an_alert():
    names = {alert["alert"].lower() for alert in alerts()}
    text = RUNBOOKS.read_text(encoding="utf-8")
    for heading in re.findall(r"^##\s+(Gpuwatch\w+)\s*$", text, re.MULTILINE):
        assert heading.lower() in names, f"runbook section {heading} has no alert"


def promtool_cases(paths: list[Path]) -> list[dict]:
    return [test for path in paths for test in load(path)["tests"]]


def test_every_alert_has_a_firing_and_a_quiet_test_case():
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for case in promtool_cases(ALERT_TESTS):
        for check in case.get("alert_rule_test", []):
            target = firing if check.get("exp_alerts") else quiet
            target[check["alertname"]] = target.get(check["alertname"], 0) + 1
    for alert in alerts():
        assert firing.get(alert["alert"]), f"{alert['alert']}: no promtool case where it fires"
        assert quiet.get(alert["alert"]), f"{alert['alert']}: no promtool case where it must not fire"


def test_firing_test_cases_check_labels_and_all_annotations():
    by_name = {alert["alert"]: alert for alert in alerts()}
    for case in promtool_cases(ALERT_TESTS):
        for check in case.get("alert_rule_test", []):
            alert = by_name[check["alertname"]]
            for expected in check.get("exp_alerts") or []:
                labels = expected["exp_labels"]
                assert labels["severity"] == alert["labels"]["severity"]
                assert FLEET_LEVEL.get(alert["alert"], "instance") in labels and "job" in labels
                refs = driving_refs(alert["expr"])
                if refs and refs[0][0] == GPU_RULE_METRIC or "gpuwatch_gpu_up" in alert["expr"]:
                    assert {"gpu", "uuid"} <= labels.keys(), check
                assert set(expected["exp_annotations"]) == set(alert["annotations"]), check


# ------------------------------------------------------------------------------------- recording rules


def test_recording_rules_are_named_level_metric_operations():
    for rule in recording_rules():
        assert "record" in rule, rule
        level, metric, operations = rule["record"].split(":")
        assert re.fullmatch(r"[a-z]+(?:_[a-z]+)*", level), rule["record"]
        assert re.fullmatch(r"gpuwatch_[a-z0-9_]+", metric), rule["record"]
        assert not metric.endswith("_total"), f"{rule['record']}: drop _total after rate()"
        assert re.fullmatch(r"[a-z0-9_]+", operations), rule["record"]


def test_every_recording_rule_is_tested_and_documented():
    tested = {check["expr"].strip() for case in promtool_cases(RECORDING_TESTS + ALERT_TESTS)
              for check in case.get("promql_expr_test", [])}
    doc = PROMETHEUS_DOC.read_text(encoding="utf-8")
    for name in {rule["record"] for rule in recording_rules()}:
        assert name in tested, f"{name}: no promql_expr_test"
        assert f"`{name}`" in doc, f"{name}: not in docs/prometheus.md"


def test_every_alert_is_documented_in_prometheus_md():
    doc = PROMETHEUS_DOC.read_text(encoding="utf-8")
    for alert in alerts():
        assert f"`{alert['alert']}`" in doc, f"{alert['alert']}: not in docs/prometheus.md"
