"""docs/scaling.md's steps 2 and 3 for real: two Prometheus shards, each the shipped
deploy/prometheus/sharding/shard.example.yml (rooms split by ``hashmod``, every shipped rule file,
remote_write of the recorded series), and a global Prometheus that receives them
(``--web.enable-remote-write-receiver``, as Mimir or Thanos Receive would) and evaluates
deploy/prometheus/sharding/global.rules.yml. Eight targets in two rooms, served by one gpuwatch process
over the fake library (tests/fleetsim.py: the Fleet bench/fleet.py also runs).

Only what a test needs differs from the shipped files: 2 s intervals, targets from a file_sd file
here, loopback URLs, no Alertmanager, and the rules made quick (tests/fleetsim.py: the alerts'
``for:`` at 0, every group at the 2 s evaluation interval; promtool's cases check them as shipped).
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from pathlib import Path

import fleetsim
import pytest
import yaml
from daemon import wait_for
from fleetsim import new_fleet, rules_for_tests

pytestmark = [pytest.mark.daemon, pytest.mark.stack]  # sharded Prometheus servers over a fleet of gpuwatch processes

ROOT = Path(__file__).resolve().parents[1]
SHARDING = ROOT / "deploy" / "prometheus" / "sharding"

SHARDS = 2


def shard_of(room: str) -> int:
    """Prometheus' hashmod: the last 8 bytes of the value's MD5, big-endian, modulo the shards."""
    return int.from_bytes(hashlib.md5(room.encode()).digest()[8:], "big") % SHARDS


# two rooms that hashmod puts on different shards (which ones is what the shards must agree on)
ROOMS = sorted({shard_of(f"hall-{i}"): f"hall-{i}" for i in range(1, 20)}.values())[:SHARDS]
assert len({shard_of(room) for room in ROOMS}) == SHARDS


def _layout() -> list[tuple[str, str, dict[str, str]]]:
    """(instance, gpuwatch process, topology): two racks of two nodes per room, 2 GPUs a node."""
    targets = []
    for r, room in enumerate(ROOMS):
        for rack in (f"r{r}a", f"r{r}b"):
            for n in (1, 2):
                targets.append((f"{rack}-n{n}:19400", "node", {"rack": rack, "row": "a", "room": room,
                                                                "pdu": f"pdu-{rack}"}))
    return targets


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded")
    f = new_fleet(work)
    try:
        f.node("node", gpus=2, jobs=1)  # a Slurm job on each node, with a host side (cgroup, process)
        rules = rules_for_tests(work, site=False)  # a shard: the site rules are the global tier's
        budgets = work / "budgets.rules.yml"  # rack r1b: 2 nodes x 2 GPUs x 600 W = 2,400 W of 2,000 W
        budgets.write_text(yaml.safe_dump({"groups": [{"name": "budgets", "rules": [
            {"record": "rack:gpuwatch_power_budget_watts:declared", "expr": "vector(2000)", "labels": {"rack": "r1b"}},
        ]}]}))
        targets = work / "file_sd.yml"
        targets.write_text(yaml.safe_dump(f.static_configs(_layout())))

        receiver = f.server("global", {"global": {"evaluation_interval": "2s"},
                                       "rule_files": [str(SHARDING / "global.rules.yml")]},
                            flags=("--web.enable-remote-write-receiver",))
        shards = []
        for n in range(SHARDS):
            config = yaml.safe_load((SHARDING / "shard.example.yml").read_text())
            config["global"].update(scrape_interval="2s", evaluation_interval="2s")
            config["global"]["external_labels"]["prometheus"] = f"shard-{n}"
            config["rule_files"] = [str(p) for p in (*rules, budgets)]
            del config["alerting"]
            (job,) = config["scrape_configs"]
            job.update(scrape_interval="2s", scrape_timeout="2s")
            job["file_sd_configs"] = [{"files": [str(targets)]}]
            keep = job["relabel_configs"][1]
            assert keep["action"] == "keep" and job["relabel_configs"][0]["modulus"] == SHARDS
            keep["regex"] = str(n)
            (remote,) = config["remote_write"]
            remote["url"] = receiver.base + "/api/v1/write"
            remote["queue_config"] = {"batch_send_deadline": "1s"}
            shards.append(f.server(f"shard-{n}", config))
        wait_for(lambda: all(len(s.result('up{job="gpuwatch"} == 1')) == 4 for s in shards), 60,
                 "each shard to scrape its room's four targets")
        yield f, shards, receiver
    finally:
        f.stop()


def test_each_shard_scrapes_whole_rooms_the_hash_puts_on_it(sharded):
    _, shards, _ = sharded
    for n, shard in enumerate(shards):
        scraped = {(s["metric"]["instance"], s["metric"]["room"]) for s in shard.result('up{job="gpuwatch"}')}
        assert scraped == {(i, labels["room"]) for i, _, labels in _layout() if shard_of(labels["room"]) == n}


def test_the_global_store_gets_the_recordings_and_alerts_only_and_sums_the_shards(sharded):
    _, _, receiver = sharded

    def value(expr: str) -> float | None:
        result = receiver.result(expr)
        return float(result[0]["value"][1]) if result else None

    wait_for(lambda: value("site:gpuwatch_gpus:sum") == 16 and value("site:gpuwatch_nodes:count") == 8, 90,
             "the global rules to sum both shards: 8 nodes, 16 GPUs")
    assert {s["metric"]["prometheus"] for s in receiver.result("job:gpuwatch_gpus:sum")} == {"shard-0", "shard-1"}
    assert value("site:gpuwatch_power_watts:sum") == pytest.approx(16 * 600)
    # no raw per-GPU series crossed: only recordings (per GPU, those of the cooling input), ALERTS, up, ...
    names = {s["metric"]["__name__"] for s in receiver.result('count by (__name__) ({__name__=~".+"})')}
    assert "gpuwatch_temperature_celsius" not in names and "gpuwatch_power_watts" not in names
    assert names <= {n for n in names if ":" in n} | {"ALERTS", "ALERTS_FOR_STATE", "up", "gpuwatch_gpus",
                                                      "gpuwatch_node_info", "gpuwatch_build_info"}, names
    # the rack over its budget alerts on its shard, and the global store sees it there
    shard = f"shard-{shard_of(ROOMS[1])}"
    wait_for(lambda: receiver.result('ALERTS{alertname="GpuwatchRackPowerBudget", alertstate="firing"}'), 60,
             "the rack power alert to reach the global store")
    (alert,) = receiver.result('ALERTS{alertname="GpuwatchRackPowerBudget", alertstate="firing"}')
    assert (alert["metric"]["rack"], alert["metric"]["prometheus"]) == ("r1b", shard)


def _label_values(server, variable: str, values: dict[str, str]) -> set[str]:
    """What Grafana's label_values(metric{...}, label) lists: /api/v1/label/<label>/values?match[]=..."""
    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable).groups()  # type: ignore[union-attr]
    document = fleetsim.get_json(f"{server.base}/api/v1/label/{label}/values?"
                                + urllib.parse.urlencode({"match[]": fleetsim.substitute(metric, values)}))
    assert document["status"] == "success", document
    return set(document["data"])


def test_the_fleet_and_jobs_dashboards_answer_from_the_global_store(sharded):
    """They read recorded series only, variables included, so the global store answers every query that
    a shard answers, and the stats add up over the shards."""
    _, shards, receiver = sharded
    queries = fleetsim.global_queries("r0a-n1:19400")
    # empty on a healthy fleet without per-process memory or I/O wait: the sparse tables and lines
    quiet = {("gpuwatch-fleet", "Firing anomalies by rule", "A"), ("gpuwatch-fleet", "GPUs needing attention", "A"),
             ("gpuwatch-fleet", "Nodes needing attention: what", "A"), ("gpuwatch-jobs", "Running jobs", "B"),
             ("gpuwatch-jobs", "Idle allocated GPUs", "A"), ("gpuwatch-jobs", "Input-bound GPUs", "A"),
             ("gpuwatch-jobs", "GPU busy against CPU saturation and I/O wait per job", "C"),
             ("gpuwatch-jobs", "Frame buffer per job", "A")}
    wrong: dict = {}

    def all_answer() -> bool:
        wrong.clear()
        for q in queries:
            key = (q["uid"], q["title"], q["ref"])
            document = receiver.query(q["expr"])
            assert document["status"] == "success", (key, document.get("error"))
            here, there = bool(document["data"]["result"]), any(s.result(q["expr"]) for s in shards)
            if here != there or here == (key in quiet):
                wrong[key] = (here, there)
        return not wrong

    try:
        wait_for(all_answer, 60, "the global store to answer what the shards answer")
    except AssertionError:
        raise AssertionError(f"(global store, shards) answering, not as expected: {wrong}") from None
    stats = {(q["uid"], q["title"]): q["expr"] for q in queries}
    for key, wanted in ((("gpuwatch-fleet", "Nodes"), 8), (("gpuwatch-fleet", "GPUs"), 16),
                        (("gpuwatch-jobs", "Jobs"), 1), (("gpuwatch-jobs", "GPUs held"), 16)):
        (sample,) = receiver.result(stats[key])
        assert float(sample["value"][1]) == wanted, key
    (rack,) = receiver.result(stats[("gpuwatch-fleet", "Power by rack against budget")])
    assert rack["metric"]["rack"] == "r1b" and float(rack["value"][1]) == pytest.approx(1.2)
    # the variables Grafana fills its drop-downs from
    for path in fleetsim.DASHBOARDS:
        dashboard = json.loads(path.read_text())
        if dashboard["uid"] == "gpuwatch-node":
            continue
        variables = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
        values = {"job": "gpuwatch", "instance": ".+", "user": ".*"}
        assert _label_values(receiver, variables["job"], values) == {"gpuwatch"}
        assert _label_values(receiver, variables["instance"], values) == {i for i, _, _ in _layout()}
        if "job_id" in variables:
            assert _label_values(receiver, variables["job_id"], values) == {"7000"}
