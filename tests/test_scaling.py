"""docs/scaling.md's steps 2 and 3 for real: two Prometheus shards, each the shipped
deploy/prometheus/sharding/shard.example.yml (rooms split by ``hashmod``, every shipped rule file,
remote_write of the recorded series), and a global Prometheus that receives them
(``--web.enable-remote-write-receiver``, as Mimir or Thanos Receive would) and evaluates
deploy/prometheus/sharding/global.rules.yml. Eight targets in two rooms, served by one gpuwatch process
over the fake library (bench/fleet.py's Fleet).

Only what a test needs differs from the shipped files: 2 s intervals, targets from a file_sd file
here, loopback URLs, no Alertmanager, and the alerts' ``for:`` at 0 (promtool's cases check it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from daemon import wait_for

ROOT = Path(__file__).resolve().parents[1]
SHARDING = ROOT / "deploy" / "prometheus" / "sharding"
_spec = importlib.util.spec_from_file_location("bench_fleet", ROOT / "bench" / "fleet.py")
fleet_bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_fleet"] = fleet_bench  # its dataclasses look their module up
_spec.loader.exec_module(fleet_bench)  # type: ignore[union-attr]

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
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is missing: scripts/test installs it (Debian package prometheus)")
    work = tmp_path_factory.mktemp("sharded")
    f = fleet_bench.Fleet(work, interval="2s")
    try:
        f.node("node", gpus=2)
        rules = []
        for path in fleet_bench.RULE_FILES[:2]:
            copy = work / path.name
            copy.write_text(re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", path.read_text(), flags=re.MULTILINE))
            rules.append(copy)
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


def test_the_fleet_dashboard_answers_from_the_global_store(sharded):
    """It reads recorded series only, so it works on the global store as on one Prometheus."""
    _, _, receiver = sharded
    wait_for(lambda: receiver.result("instance:gpuwatch_gpus_by_state:count"), 60, "recordings in the global store")
    queries = [q for q in fleet_bench.dashboard_queries("r0a-n1:19400") if q["uid"] == "gpuwatch-fleet"]
    assert len(queries) > 20
    for q in queries:
        document = receiver.query(q["expr"])
        assert document["status"] == "success", (q["title"], q["ref"], document.get("error"))
    stats = {q["title"]: q for q in queries if q["title"] in ("Nodes", "GPUs")}
    wait_for(lambda: [float(receiver.result(stats[t]["expr"])[0]["value"][1]) for t in ("Nodes", "GPUs")] == [8, 16],
             60, "the Fleet's Nodes and GPUs stats over both shards")
