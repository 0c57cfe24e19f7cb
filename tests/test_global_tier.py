"""docs/scaling.md's global tier on VictoriaMetrics, run end to end on loopback: two Prometheus shards (the
shipped deploy/prometheus/sharding/shard.example.yml, sharded by rack so that a room can span both)
scrape gpuwatch processes, evaluate the shipped rules for their racks and remote-write
(deploy/victoriametrics/remote-write.yml) to VictoriaMetrics; vmalert evaluates the site-level rule files
(deploy/prometheus/sharding/global.rules.yml, alerts/gpuwatch-site.rules.yml) against it, with the flags
of deploy/victoriametrics/*.default; shards and vmalert send to one real Alertmanager. Beside them, one
Prometheus over the same targets with every shipped rule file: what the dashboards must read alike.

Shard 0 runs as an HA pair (two Prometheus servers with the same configuration): VictoriaMetrics keeps one
of their identical series (-dedup.minScrapeInterval), Alertmanager one of their identical alerts.

Faults: rack ``RACK_HOT`` (2 nodes) runs 10 °C hotter than the rest of its room on shard 0 -> one
GpuwatchRackCooling, from shard 0; every GPU of room ``ROOM_HOT``, whose two racks hash to different
shards, runs 20 °C hotter than the site -> one GpuwatchRoomCooling, from the global tier. Neither shard
alone can see the room's fault (each holds half of it, and compares it with nothing but itself).

Only what a test needs differs from the shipped files: 2 s intervals, loopback addresses and paths,
vmalert's queue flushed every second, VictoriaMetrics' latency offset and dedup interval at the 2 s
evaluation, and the rules made quick (tests/fleetsim.py: ``for:`` at 0, every group at 2 s).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import fleetsim
import pytest
import yaml
from daemon import wait_for
from fleetsim import RULE_FILES, SITE_RULES, Server, new_fleet, quick, rules_for_tests
from promstack import Alertmanager, VictoriaMetrics, VmAlert, Webhook, _get

pytestmark = [pytest.mark.daemon, pytest.mark.stack]  # shards, VictoriaMetrics, vmalert, Alertmanager over gpuwatch

ROOT = Path(__file__).resolve().parents[1]
SHARDING = ROOT / "deploy" / "prometheus" / "sharding"
VM = ROOT / "deploy" / "victoriametrics"
SHARDS = 2
EXTERNAL = {"prometheus", "site"}  # the tiers' external labels, which one Prometheus's series do not carry


def shard_of(value: str) -> int:
    """Prometheus' hashmod: the last 8 bytes of the value's MD5, big-endian, modulo the shards."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % SHARDS


def _racks(shard: int, count: int, prefix: str) -> list[str]:
    return [r for r in (f"{prefix}{i}" for i in range(1, 200)) if shard_of(r) == shard][:count]


# room hall-a: a hot rack and two normal ones on shard 0 (the shard's part of the room that the rack is
# compared with), one more rack on shard 1; room hall-h: one rack on each shard, all of it hot
RACK_HOT, *NORMAL_0 = _racks(0, 3, "a")
(NORMAL_1,) = _racks(1, 1, "a")
ROOM_HOT = "hall-h"
HOT_RACKS = [_racks(0, 1, "h")[0], _racks(1, 1, "h")[0]]


def _layout() -> list[tuple[str, str, dict[str, str]]]:
    """(instance, gpuwatch process, topology): two nodes a rack, 2 GPUs a node."""
    racks = [(RACK_HOT, "hall-a", "inlet"), *((r, "hall-a", "node") for r in (*NORMAL_0, NORMAL_1)),
             *((r, ROOM_HOT, "room") for r in HOT_RACKS)]
    return [(f"{rack}-n{n}:19400", process, {"rack": rack, "row": "a", "room": room, "pdu": f"pdu-{rack}"})
            for rack, room, process in racks for n in (1, 2)]


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    work = tmp_path_factory.mktemp("global-tier")
    f = new_fleet(work)
    hook = Webhook()
    stopping = []
    try:
        f.node("node", gpus=2, jobs=1)  # 27 °C of headroom, a Slurm job each (the Jobs dashboard)
        f.node("inlet", gpus=2, margin=15)  # 17 °C: the rack's inlet is 10 °C warm
        f.node("room", gpus=2, margin=5)  # 7 °C: the room's cooling fails
        am = Alertmanager(work, hook.url)
        stopping.append(am)
        vm = VictoriaMetrics(work, VM / "victoria-metrics.default", dedup_minScrapeInterval="2s",
                             search_latencyOffset="2s")
        stopping.append(vm)
        targets = work / "file_sd.yml"
        targets.write_text(yaml.safe_dump(f.static_configs(_layout())))
        budgets = RULE_FILES[2]  # as shipped (rack r12: none here)
        (remote,) = yaml.safe_load((VM / "remote-write.yml").read_text())["remote_write"]
        remote["url"] = vm.base + "/api/v1/write"
        remote["queue_config"] = {"batch_send_deadline": "1s"}
        shards = []
        for name in ("shard-0-rules", "shard-1-rules", "single-rules", "site-rules"):
            (work / name).mkdir()
        for n in range(SHARDS):
            config = yaml.safe_load((SHARDING / "shard.example.yml").read_text())
            config["global"].update(scrape_interval="2s", evaluation_interval="2s")
            config["global"]["external_labels"]["prometheus"] = f"shard-{n}"
            config["rule_files"] = [str(p) for p in (*rules_for_tests(work / f"shard-{n}-rules", site=False),
                                                     budgets)]
            config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am.address]
            (job,) = config["scrape_configs"]
            job.update(scrape_interval="2s", scrape_timeout="2s")
            job["file_sd_configs"] = [{"files": [str(targets)]}]
            by, keep = job["relabel_configs"][:2]
            assert by["source_labels"] == ["room"] and by["modulus"] == SHARDS and keep["action"] == "keep"
            by["source_labels"] = ["rack"]  # by rack: a room larger than a shard spans shards
            keep["regex"] = str(n)
            config["remote_write"] = [remote]
            shards.append(f.server(f"shard-{n}", config))
            if n == 0:  # its HA replica: the same configuration, so the same series and alerts
                shards.append(f.server("shard-0-replica", config))
        # the one Prometheus over the same targets, every shipped rule file, no Alertmanager
        single = f.server("single", {"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
                                     "scrape_configs": [{"job_name": "gpuwatch", "scrape_interval": "2s",
                                                         "file_sd_configs": [{"files": [str(targets)]}]}],
                                     "rule_files": [str(p) for p in (*rules_for_tests(work / "single-rules"),
                                                                     budgets)]})
        site_rules = work / "site-rules"
        rules = []
        for path in (SHARDING / "global.rules.yml", SITE_RULES):
            rules.append(site_rules / path.name)
            rules[-1].write_text(quick(path.read_text()))
        vmalert = VmAlert(work, VM / "vmalert.default", rules, vm.base, am.address, evaluationInterval="2s",
                          remoteWrite_flushInterval="1s")
        stopping.append(vmalert)
        store = Server("victoria-metrics", None, vm.base)
        wait_for(lambda: all(len(s.result('up{job="gpuwatch"} == 1'))
                             == sum(shard_of(labels["rack"]) == int(s.name[6]) for _, _, labels in _layout())
                             for s in shards), 60, "each shard (and the replica) to scrape its racks' targets")
        yield f, shards, single, store, am, hook
    finally:
        f.stop()  # the shards first: they flush their remote_write queue to the store on the way out
        for process in reversed(stopping):
            process.stop()
        hook.close()


def test_the_racks_hash_so_that_a_room_spans_both_shards():
    assert {shard_of(r) for r in HOT_RACKS} == {0, 1}
    assert len({shard_of(r) for r in (RACK_HOT, *NORMAL_0)}) == 1 and shard_of(NORMAL_1) == 1


def _alertmanager(am, name: str) -> list[dict]:
    """The alerts Alertmanager holds now under ``name`` (its API v2)."""
    status, body = _get(f"http://{am.address}/api/v2/alerts?"
                        + urllib.parse.urlencode({"filter": f'alertname="{name}"'}))
    assert status == 200, body
    return json.loads(body)


def test_a_rack_fault_and_a_room_fault_across_shards_each_reach_alertmanager_once_from_their_tier(tier):
    f, shards, single, store, am, hook = tier
    rack = wait_for(lambda: _alertmanager(am, "GpuwatchRackCooling"), 120, "GpuwatchRackCooling in Alertmanager")
    room = wait_for(lambda: _alertmanager(am, "GpuwatchRoomCooling"), 120, "GpuwatchRoomCooling in Alertmanager")
    # the single Prometheus over the same targets sees the same two faults, and only them
    firing = {(s["metric"]["alertname"], s["metric"].get("rack") or s["metric"].get("room"))
              for s in single.result('ALERTS{alertstate="firing", alertname=~"Gpuwatch(Node|Rack|Room)Cooling"}')}
    assert firing == {("GpuwatchRackCooling", RACK_HOT), ("GpuwatchRoomCooling", ROOM_HOT)}
    # a few more evaluations of both tiers (the ALERTS each writes to the store): still one alert each
    since = time.time() + 6

    def evaluated() -> bool:
        latest = store.result('min(max by (alertname) (timestamp(ALERTS{alertstate="firing", '
                              'alertname=~"GpuwatchR(ack|oom)Cooling"})))')
        return bool(latest) and float(latest[0]["value"][1]) > since
    wait_for(evaluated, 60, "both tiers to evaluate their alerts again")
    assert [s["metric"]["prometheus"] for s in store.result('ALERTS{alertname="GpuwatchRoomCooling"}')] == ["global"]
    rack, room = _alertmanager(am, "GpuwatchRackCooling"), _alertmanager(am, "GpuwatchRoomCooling")
    assert [(a["labels"]["rack"], a["labels"]["prometheus"]) for a in rack] == [(RACK_HOT, "shard-0")]
    assert [(a["labels"]["room"], a["labels"]["prometheus"]) for a in room] == [(ROOM_HOT, "global")]
    assert room[0]["labels"]["severity"] == "critical" and room[0]["labels"]["site"] == "dc1"
    assert room[0]["annotations"]["summary"] == f"The GPUs of room {ROOM_HOT} heat together."
    # what the webhook got: each alert under one label set, firing
    for name in ("GpuwatchRackCooling", "GpuwatchRoomCooling"):
        notified = {tuple(sorted(a["labels"].items())) for a in hook.alerts(name, "firing")}
        assert len(notified) == 1, (name, notified)
    # the replica fires it too, under the same labels: one alert all the same
    assert [s["metric"]["rack"] for s in shards[1].result('ALERTS{alertname="GpuwatchRackCooling", '
                                                          'alertstate="firing"}')] == [RACK_HOT]
    # no tier fires the other's: no room alert from a shard, no rack or node alert for the hot room
    assert not [s for shard in shards for s in shard.result('ALERTS{alertname="GpuwatchRoomCooling"}')]
    assert not _alertmanager(am, "GpuwatchNodeCooling")
    # the site rules see the whole room: one series, not one per shard
    (hot,) = store.result(f'site_room:gpuwatch_thermal_headroom_celsius:median{{room="{ROOM_HOT}"}}')
    assert float(hot["value"][1]) == pytest.approx(7) and hot["metric"]["prometheus"] == "global"
    assert {s["metric"]["prometheus"] for s in store.result(f'room:gpuwatch_thermal_headroom_celsius:median'
                                                              f'{{room="{ROOM_HOT}"}}')} == {"shard-0", "shard-1"}


def _comparable(result: list[dict], drop: frozenset[str] = frozenset()) -> dict[tuple, float]:
    """Each series' labels without the tiers' external labels (and ``drop``) -> its value."""
    out: dict[tuple, float] = {}
    for s in result:
        key = tuple(sorted((k, v) for k, v in s["metric"].items() if k not in EXTERNAL | drop))
        out[key] = float(s["value"][1])
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=0.02, abs_tol=1e-6)


def test_every_fleet_and_jobs_query_answers_from_victoriametrics_as_from_one_prometheus(tier):
    """The same series (labels but the tiers' external ones) with the same values: exactly for counts and
    gauges, to 2 % for averages over the data each one holds; a ranking (topk, bottomk) among equal nodes
    picks its own: there the values. Queries that read time() differ by the seconds between the two
    queries, sums over time by the evaluations each store holds since it started: there the series."""
    f, shards, single, store, am, hook = tier
    queries = fleetsim.global_queries("a1-n1:19400")
    wrong: dict = {}

    def all_agree() -> bool:
        wrong.clear()
        for q in queries:
            key = (q["uid"], q["title"], q["ref"])
            document = store.query(q["expr"])
            assert document["status"] == "success", (key, document.get("error"))
            there, here = _comparable(document["data"]["result"]), _comparable(single.result(q["expr"]))
            if re.search(r"\b(topk|bottomk)\(", q["expr"]):
                agree = len(here) == len(there) and all(map(_same, sorted(here.values()), sorted(there.values())))
            elif "time()" in q["expr"] or "sum_over_time" in q["expr"]:
                agree = here.keys() == there.keys()
            else:
                agree = here.keys() == there.keys() and all(_same(here[k], there[k]) for k in here)
            if not agree:
                wrong[key] = (q["expr"], sorted(there.items())[:4], sorted(here.items())[:4])
        return not wrong

    try:
        wait_for(all_agree, 90, "VictoriaMetrics to answer what one Prometheus answers")
    except AssertionError:
        raise AssertionError(f"(VictoriaMetrics, one Prometheus) disagree: {wrong}") from None
    stats = {(q["uid"], q["title"]): q["expr"] for q in queries}
    nodes = len(_layout())
    for key, wanted in ((("gpuwatch-fleet", "Nodes"), nodes), (("gpuwatch-fleet", "GPUs"), 2 * nodes),
                        (("gpuwatch-jobs", "Jobs"), 1)):
        (sample,) = store.result(stats[key])
        assert float(sample["value"][1]) == wanted, key
    # the variables Grafana fills its drop-downs from
    for path in fleetsim.DASHBOARDS:
        dashboard = json.loads(path.read_text())
        if dashboard["uid"] == "gpuwatch-node":
            continue
        variables = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
        values = {"job": "gpuwatch", "instance": ".+", "user": ".*"}
        for name, variable in variables.items():
            assert _label_values(store, variable, values) == _label_values(single, variable, values), name


def _label_values(server, variable: str, values: dict[str, str]) -> set[str]:
    """What Grafana's label_values(metric{...}, label) lists: /api/v1/label/<label>/values?match[]=..."""
    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable).groups()  # type: ignore[union-attr]
    document = fleetsim.get_json(f"{server.base}/api/v1/label/{label}/values?"
                                 + urllib.parse.urlencode({"match[]": fleetsim.substitute(metric, values)}))
    assert document["status"] == "success", document
    return set(document["data"])


def test_the_shards_send_victoriametrics_what_shard_example_sends():
    """deploy/victoriametrics/remote-write.yml selects what shard.example.yml's remote_write does."""
    (vm,) = yaml.safe_load((VM / "remote-write.yml").read_text())["remote_write"]
    (shipped,) = yaml.safe_load((SHARDING / "shard.example.yml").read_text())["remote_write"]
    assert vm["write_relabel_configs"] == shipped["write_relabel_configs"]
    assert vm["url"].endswith(":8428/api/v1/write")


def test_vmalert_records_from_the_shards_what_one_prometheus_records_from_the_nodes(tier):
    """The site-level rules, evaluated by vmalert in MetricsQL over the shards' recordings, against one
    Prometheus over the nodes: alerts/gpuwatch-site.rules.yml's recordings against its own, and
    global.rules.yml's site: sums against its job: series (one Prometheus is a site of one shard)."""
    f, shards, single, store, am, hook = tier
    pairs = [(r["record"], r["record"]) for g in yaml.safe_load(SITE_RULES.read_text())["groups"]
             for r in g["rules"] if "record" in r]
    pairs += [(r["record"], re.sub(r"^site(_rule)?:", lambda m: f"job{m.group(1) or ''}:", r["record"]))
              for g in yaml.safe_load((SHARDING / "global.rules.yml").read_text())["groups"] for r in g["rules"]]
    assert len(pairs) == 10
    wrong: dict = {}

    def all_agree() -> bool:
        wrong.clear()
        for there_name, here_name in pairs:
            there = _comparable(store.result(there_name), frozenset({"__name__"}))
            here = _comparable(single.result(here_name), frozenset({"__name__"}))
            if (not there and there_name != "site_rule:gpuwatch_anomaly:sum") or there.keys() != here.keys() \
                    or not all(_same(here[k], there[k]) for k in here):
                wrong[there_name] = (sorted(there.items()), sorted(here.items()))
        return not wrong

    try:
        wait_for(all_agree, 60, "vmalert's recordings to agree with one Prometheus's")
    except AssertionError:
        raise AssertionError(f"(vmalert over VictoriaMetrics, one Prometheus) disagree: {wrong}") from None


@pytest.mark.parametrize("path", [SHARDING / "global.rules.yml", SITE_RULES], ids=lambda p: p.name)
def test_vmalert_parses_and_checks_the_site_rule_files_as_shipped(path):
    """What vmalert.default loads, as shipped (not made quick): its parser and MetricsQL check both."""
    vmalert = shutil.which("vmalert")
    assert vmalert, "vmalert is missing: scripts/test installs it (Debian package victoria-metrics)"
    result = subprocess.run([vmalert, "-dryRun", f"-rule={path}", "-rule.validateExpressions",
                             "-rule.validateTemplates"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"\t(error|fatal)\t", result.stdout + result.stderr), result.stdout + result.stderr
