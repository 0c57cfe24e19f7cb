"""The clocks, ecc and pcie groups over the real binding and the fake libnvidia-ml: a sentinel (0xFFFFFFFF,
2**64-1, -1 in a signed field), NaN, an infinity, a fraction where NVML counts, or a value beyond physics is left
out of the exposition, counted (gpuwatch_poll_errors_total{error="implausible_value"}, the group's
gpuwatch_collector_success 0) and logged once per GPU and reading (nvml_reading_implausible); the group's other
readings and the other GPUs stay, no rule fires on it, and a plausible value at a later poll is exported again.
"""

from __future__ import annotations

from collections import Counter

import fakenvml
import pytest

U32, U64 = 0xFFFFFFFF, 2**64 - 1
NAN, INF = float("nan"), float("inf")
ECC = ("gpuwatch_ecc_errors_total", "gpuwatch_remapped_rows_total", "gpuwatch_remapped_rows_pending",
       "gpuwatch_remapped_rows_failed")
PCIE = ("gpuwatch_pcie_link_generation", "gpuwatch_pcie_link_width", "gpuwatch_pcie_replays_total")
CLOCKS = ("gpuwatch_clock_hertz", "gpuwatch_clock_max_hertz", "gpuwatch_clocks_event_active",
          "gpuwatch_clocks_event_seconds_total")
# the rules that read these groups: none may fire on a value left out
RULES = {"thermal_throttling", "power_brake", "hw_slowdown", "power_capped", "ecc_uncorrectable", "row_remap_failed",
         "row_remap_pending", "retired_pages_pending", "pcie_link_degraded", "pcie_replays_rising"}


def series(d, uuid: str, families: tuple[str, ...]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The GPU's samples of ``families``: (family, its labels but gpu and uuid) -> value."""
    out = {}
    for (name, labels), value in d.metrics().items():
        kept = dict(labels)
        if name in families and kept.pop("uuid", None) == uuid:
            kept.pop("gpu")
            out[(name, tuple(sorted(kept.items())))] = value
    return out


def key(family: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return family, tuple(sorted(labels.items()))


def implausible(d) -> Counter[tuple[str, str]]:
    """(uuid, reading) -> nvml_reading_implausible lines logged."""
    return Counter((e["uuid"], e["reading"]) for e in d.events() if e["event"] == "nvml_reading_implausible")


def onsets(d) -> list[tuple[str, str]]:
    return [(e["rule"], e["uuid"]) for e in d.events() if e["event"] == "anomaly_started" and e["rule"] in RULES]


def errors(d, tier: str) -> float:
    return d.value("gpuwatch_poll_errors_total", tier=tier, error="implausible_value") or 0


def check_left_out(d, node, families, bad: set, readings: set[str], tier: str, group: str) -> None:
    """GPU 0 exports every series of ``families`` GPU 1 does but the ``bad`` ones; the rest is counted and logged."""
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    good = series(d, gpu1, families)
    assert bad <= good.keys(), "the healthy GPU exports every series"
    assert series(d, gpu0, families).keys() == good.keys() - bad
    assert errors(d, tier) >= 2, "counted at every poll"
    assert d.value("gpuwatch_collector_success", group=group) == 0
    assert implausible(d) == Counter({(gpu0, reading): 1 for reading in readings}), "once per GPU and reading"
    assert onsets(d) == []


# ------------------------------------------------------------------------------------ clocks


def test_clock_sentinels_nan_and_negative_counters_are_left_out_and_come_back(inproc):
    node = fakenvml.FakeNode.h200(2)
    g = node.gpus[0]
    g.clocks[1] = U32  # SM clock 0xFFFFFFFF MHz: 4.29e15 Hz
    g.max_clocks[0] = U32  # max graphics clock (slow tier)
    g.clocks_event_reasons = U64  # all ones: NVML's "not available", not every reason at once
    g.set_field(74, NAN, "d")  # sw_power_cap throttle time
    g.set_field(76, -5_000_000_000, "sll")  # sync_boost: a negative counter
    g.throttle_ns[270] = -1  # hw_thermal_slowdown: 0xFFFFFFFFFFFFFFFF ns
    d = inproc(node)
    d.advance(3)
    reasons = {key("gpuwatch_clocks_event_active", reason=r) for r in (
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal_slowdown",
        "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")}
    bad = {key("gpuwatch_clock_hertz", clock="sm"), key("gpuwatch_clock_max_hertz", clock="graphics"), *reasons,
           *(key("gpuwatch_clocks_event_seconds_total", reason=r)
             for r in ("sw_power_cap", "sync_boost", "hw_thermal_slowdown"))}
    check_left_out(d, node, CLOCKS, bad, {"sm clock", "graphics max clock", "clocks event reasons",
                                          "sw_power_cap throttle time", "sync_boost throttle time",
                                          "hw_thermal_slowdown throttle time"}, "fast", "clocks")
    assert errors(d, "slow") >= 2  # the max clock
    kept = series(d, g.uuid, CLOCKS)
    assert kept[key("gpuwatch_clock_hertz", clock="graphics")] == 345e6
    assert kept[key("gpuwatch_clock_max_hertz", clock="sm")] == 1980e6
    assert kept[key("gpuwatch_clocks_event_seconds_total", reason="sw_thermal_slowdown")] == 0

    g.clocks[1], g.max_clocks[0], g.clocks_event_reasons = 1980, 1980, 0x1
    g.fields.clear()
    g.throttle_ns[270] = 5_000_000_000
    d.write(node)
    d.advance(2)
    back = series(d, g.uuid, CLOCKS)
    assert back.keys() == series(d, node.gpus[1].uuid, CLOCKS).keys()
    assert back[key("gpuwatch_clock_hertz", clock="sm")] == 1980e6
    assert back[key("gpuwatch_clock_max_hertz", clock="graphics")] == 1980e6
    assert back[key("gpuwatch_clocks_event_active", reason="gpu_idle")] == 1
    assert back[key("gpuwatch_clocks_event_active", reason="hw_thermal_slowdown")] == 0
    assert back[key("gpuwatch_clocks_event_seconds_total", reason="hw_thermal_slowdown")] == 5.0
    assert back[key("gpuwatch_clocks_event_seconds_total", reason="sw_power_cap")] == 0
    assert d.value("gpuwatch_collector_success", group="clocks") == 1
    assert sum(implausible(d).values()) == 6  # not logged again


def test_throttle_counter_sentinels_and_an_all_ones_mask_fire_no_rule(inproc):
    """An idle GPU whose HW thermal and power-brake counters answer 2**64-1 ns and whose reason mask is all ones
    (it was: thermal_throttling and power_brake fired on a GPU that never throttled)."""
    node = fakenvml.FakeNode.h200(2)
    d = inproc(node)
    d.advance(60)
    g = node.gpus[0]
    g.throttle_ns[270] = g.throttle_ns[271] = -1
    g.clocks_event_reasons = U64
    d.write(node)
    d.advance(60)
    assert onsets(d) == []
    left = series(d, g.uuid, CLOCKS)
    assert key("gpuwatch_clocks_event_seconds_total", reason="hw_thermal_slowdown") not in left
    assert key("gpuwatch_clocks_event_seconds_total", reason="hw_power_brake_slowdown") not in left
    assert not [k for k in left if k[0] == "gpuwatch_clocks_event_active"]
    assert implausible(d) == Counter({(g.uuid, r): 1 for r in (
        "hw_thermal_slowdown throttle time", "hw_power_brake_slowdown throttle time", "clocks event reasons")})
    assert errors(d, "fast") >= 200

    g.throttle_ns[270] = g.throttle_ns[271] = 0
    g.clocks_event_reasons = 0x1
    d.write(node)
    d.advance(60)
    assert onsets(d) == []
    back = series(d, g.uuid, CLOCKS)
    assert back[key("gpuwatch_clocks_event_seconds_total", reason="hw_power_brake_slowdown")] == 0
    assert back[key("gpuwatch_clocks_event_active", reason="gpu_idle")] == 1


# ------------------------------------------------------------------------------------ ecc, pcie (field values)


@pytest.mark.parametrize(("field", "kind", "value", "family", "labels", "reading", "sane"), [
    (4, "ull", -1, "gpuwatch_ecc_errors_total", {"error": "uncorrected", "counter": "volatile"},
     "ECC uncorrected volatile", 0),  # 0xFFFFFFFFFFFFFFFF: ecc_uncorrectable (critical) fired
    (4, "sll", -1, "gpuwatch_ecc_errors_total", {"error": "uncorrected", "counter": "volatile"},
     "ECC uncorrected volatile", 0),
    (6, "d", INF, "gpuwatch_ecc_errors_total", {"error": "uncorrected", "counter": "aggregate"},
     "ECC uncorrected aggregate", 0),
    (3, "d", NAN, "gpuwatch_ecc_errors_total", {"error": "corrected", "counter": "volatile"},
     "ECC corrected volatile", 7),  # int(nan) raised: the whole group was lost
    (142, "ui", U32, "gpuwatch_remapped_rows_total", {"error": "correctable"}, "correctable remapped rows", 2),
    (143, "d", 1.5, "gpuwatch_remapped_rows_total", {"error": "uncorrectable"}, "uncorrectable remapped rows", 0),
    (144, "ui", U32, "gpuwatch_remapped_rows_pending", {}, "remap pending", 0),  # bool(): row_remap_pending fired
    (144, "d", NAN, "gpuwatch_remapped_rows_pending", {}, "remap pending", 0),
    (145, "ui", U32, "gpuwatch_remapped_rows_failed", {}, "remap failure", 0),  # row_remap_failed (critical) fired
    (145, "ui", 2, "gpuwatch_remapped_rows_failed", {}, "remap failure", 0),
    (145, "d", 0.5, "gpuwatch_remapped_rows_failed", {}, "remap failure", 0),
    (94, "ui", U32, "gpuwatch_pcie_replays_total", {}, "PCIe replays", 3),
    (94, "d", NAN, "gpuwatch_pcie_replays_total", {}, "PCIe replays", 3),  # int(nan) raised: the link was lost too
    (94, "d", 2.5, "gpuwatch_pcie_replays_total", {}, "PCIe replays", 3),
])
def test_an_implausible_count_or_flag_is_left_out_alone_and_comes_back(inproc, field, kind, value, family, labels,
                                                                       reading, sane):
    node = fakenvml.FakeNode.h200(2)
    g = node.gpus[0]
    g.set_field(field, value, kind)
    d = inproc(node)
    d.advance(3)
    families, group = (PCIE, "pcie") if family in PCIE else (ECC, "ecc")
    check_left_out(d, node, families, {key(family, **labels)}, {reading}, "slow", group)
    g.set_field(field, sane, "ui")
    d.write(node)
    d.advance(2)
    assert series(d, g.uuid, families) == {**series(d, node.gpus[1].uuid, families), key(family, **labels): sane}
    assert d.value("gpuwatch_collector_success", group=group) == 1
    assert sum(implausible(d).values()) == 1
    assert onsets(d) == []


def test_pcie_link_sentinels_are_left_out_each_on_its_own(inproc):
    node = fakenvml.FakeNode.h200(2)
    g = node.gpus[0]
    g.pcie_gen, g.pcie_max_width = U32, 65  # 0xFFFFFFFF, and more lanes than any link has
    g.pcie_replay = 5
    d = inproc(node)
    d.advance(3)
    check_left_out(d, node, PCIE, {key("gpuwatch_pcie_link_generation", link="current"),
                                   key("gpuwatch_pcie_link_width", link="max")},
                   {"PCIe current link generation", "PCIe max link width"}, "slow", "pcie")
    kept = series(d, g.uuid, PCIE)
    assert kept == {key("gpuwatch_pcie_link_generation", link="max"): 5,
                    key("gpuwatch_pcie_link_width", link="current"): 16, key("gpuwatch_pcie_replays_total"): 5}
    g.pcie_gen, g.pcie_max_width = 4, 16
    d.write(node)
    d.advance(2)
    assert series(d, g.uuid, PCIE) == {**kept, key("gpuwatch_pcie_link_generation", link="current"): 4,
                                       key("gpuwatch_pcie_link_width", link="max"): 16}
    assert d.value("gpuwatch_collector_success", group="pcie") == 1
