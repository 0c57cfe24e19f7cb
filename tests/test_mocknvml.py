"""gpuwatch over NVIDIA's mock NVML (../shared/mocknvml), every profile it ships.

An NVML this project did not write: what `gpuwatch once` shows and a short run per profile must export
every GPU up, every group collected, the values of the profile's YAML and every reading the profile
serves (the agent in-process on simulated time, the mock in a child process: inproc.InProc; `gpuwatch run`
where the mock's own clock drives the fault); the mock's injected faults must fire exactly their rule on exactly the faulted GPU. What gpuwatch
must export is computed from the YAML (tests/mocknvml.py Profile), never written down per profile, so a
new profile in configs/ is covered as it is. Where the mock differs from NVML's header (its README,
"Where it is NOT the truth"), gpuwatch follows the header and the test says which way.

Skips, saying where it looked, only when the mock is absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import mocknvml
import pytest
from daemon import Daemon, wait_for
from inproc import InProc

from gpuwatch.rules import all_rules
from gpuwatch.testing import ChildBackend, load_config

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]

PROFILES = ([pytest.param(p, id=p.stem.removeprefix("mock-nvml-config-")) for p in mocknvml.profile_paths()]
            or [pytest.param(None, id="absent", marks=pytest.mark.skip(reason=str(mocknvml.missing())))])


def profile_named(name: str) -> mocknvml.Profile:
    reason = mocknvml.missing()
    if reason is not None:
        pytest.skip(reason)
    path = mocknvml.location() / "configs" / f"mock-nvml-config-{name}.yaml"
    if not path.exists():
        pytest.skip(f"the mock at {mocknvml.location()} has no {name} profile")
    return mocknvml.Profile.load(path)


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    reason = mocknvml.missing()
    if reason is not None:
        pytest.skip(reason)
    return mocknvml.library_dir(tmp_path_factory.mktemp("mocknvml"))


@pytest.fixture(scope="module")
def children(lib, tmp_path_factory) -> Callable[[mocknvml.Profile], ChildBackend]:
    """children(profile): a process that has loaded the mock serving the profile, one per profile in this
    module (the mock takes its profile when its process starts: a second one costs a Python start-up);
    each agent builds its own backend in it (ChildBackend.configure), as a new configuration would."""
    made: dict[str, tuple[ChildBackend, IO[str]]] = {}

    def child(profile: mocknvml.Profile) -> ChildBackend:
        key = json.dumps(profile.doc, sort_keys=True, default=str)
        if key not in made:
            workdir = tmp_path_factory.mktemp(profile.name)
            env = mocknvml.env(lib, profile.write(workdir))
            log = open(workdir / "backend.log", "w")
            made[key] = ChildBackend(load_config((), env), env, stderr=log), log
        return made[key][0]

    yield child
    for process, log in made.values():
        process.stop()
        log.close()


@pytest.fixture(scope="module")
def once(children, tmp_path_factory) -> Callable[..., Metrics]:
    """once(profile, *args): the metrics of `gpuwatch once` over the profile (the backend up asserted: its
    exit 0), the agent in-process (inproc.InProc: the first fast poll, its slow poll, the host groups); run
    once per profile and arguments in this module."""
    cache: dict[tuple[Path, str, tuple[str, ...]], Metrics] = {}

    def run(profile: mocknvml.Profile, *args: str) -> Metrics:
        key = (profile.path, json.dumps(profile.doc, sort_keys=True, default=str), args)
        if key not in cache:
            d = InProc(tmp_path_factory.mktemp(profile.name), args=["--log.level", "info", *args],
                       child=children(profile))
            try:
                assert d.h.poller.backend_up  # `gpuwatch once` exits 0
                cache[key] = d.metrics()
            finally:
                d.stop()
        return cache[key]

    return run


# ------------------------------------------------------------------------------------ helpers


def series(m: Metrics, family: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``family`` whose labels include ``labels``."""
    want = set(labels.items())
    return {k: v for (n, k), v in m.items() if n == family and want <= set(k)}


def value(m: Metrics, family: str, **labels: str) -> float | None:
    return m.get((family, tuple(sorted(labels.items()))))


def gpu(profile: mocknvml.Profile, index: int, **extra: str) -> dict[str, str]:
    return dict(gpu=str(index), uuid=profile.device(index)["uuid"], **extra)


def firing(m: Metrics) -> set[tuple[str, str | None]]:
    """(rule, gpu) of every anomaly firing now, node-level ones with gpu None."""
    out: set[tuple[str, str | None]] = set()
    for (name, labels), v in m.items():
        if v == 1 and name in ("gpuwatch_anomaly", "gpuwatch_node_anomaly"):
            d = dict(labels)
            out.add((d["rule"], d.get("gpu")))
    return out


def pci_bus_id(yaml_bdf: str) -> str:
    """NVML's busId for the YAML's "0000:0A:00.0": an 8-digit domain, upper case."""
    domain, bus, devfn = yaml_bdf.split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{devfn.upper()}"


#: the mock's architecture names (engine/device.go parseArchitecture) -> gpuwatch's (NVML's DEVICE_ARCH_*)
ARCHITECTURE = {"ada_lovelace": "ada"}
HOPPER_AND_LATER = {"hopper", "blackwell"}
#: the YAML's clocks_throttle_reasons -> gpuwatch_clocks_event_active{reason}
THROTTLE_REASONS = {"display_clocks_setting": "display_clock_setting"}
CLOCKS = ("graphics", "sm", "memory", "video")
#: the causes whose time the mock counts (engine/throttle_counters.go: fields 74, 76, 251-253), in the
#: names of gpuwatch_clocks_event_seconds_total{reason}; the YAML's baselines are <reason>_us
THROTTLE_COUNTERS = ("sw_power_cap", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
                     "hw_power_brake_slowdown")


def fabric_state(state: str) -> str:
    # "auto" couples the registration to the mock's fake fabric manager, "completed" without one
    # (engine/fabric.go); the suite runs none
    return "completed" if state == "auto" else state


# ------------------------------------------------------------------------------------ the YAML's values


def check_profile(m: Metrics, profile: mocknvml.Profile) -> None:
    """Every GPU up with the YAML's identity and values; every group collected."""
    failed = {dict(k)["group"]: v for (n, k), v in m.items() if n == "gpuwatch_collector_success" and v != 1}
    assert not failed, f"groups not collected: {failed}"
    assert value(m, "gpuwatch_gpus") == profile.count
    assert value(m, "gpuwatch_backend_up", backend="nvml") == 1
    assert dict(next(iter(series(m, "gpuwatch_driver_info")))).get("driver_version") == profile.driver_version
    for i in range(profile.count):
        check_gpu(m, profile, i)


def check_gpu(m: Metrics, profile: mocknvml.Profile, i: int) -> None:
    d = profile.device(i)
    g = gpu(profile, i)
    where = f"{profile.name} GPU {i}"

    def eq(family: str, expected: float, **labels: str) -> None:
        got = value(m, family, **g, **labels)
        assert got == pytest.approx(expected), f"{where}: {family}{labels} is {got}, the YAML says {expected}"

    def lacks(*families: str) -> None:
        """A class of hardware the GPU does not have (which has no feature series: its own series say it)."""
        got = [n for (n, k) in m if n in families and set(g.items()) <= set(k)]
        assert not got, f"{where}: {sorted(set(got))}, and the YAML has no such hardware"

    eq("gpuwatch_gpu_up", 1)
    arch = ARCHITECTURE.get(d["architecture"], d["architecture"])
    # the mock falls back to 8 "Mock A100"s when it cannot read its profile: the name says it read this one
    eq("gpuwatch_gpu_info", 1, name=d["name"], pci_bus_id=pci_bus_id(d["pci"]["bus_id"]), serial=str(d["serial"]),
       vbios_version=d["vbios_version"], architecture=arch, minor_number=str(d["minor_number"]))

    thermal = d["thermal"]
    eq("gpuwatch_temperature_celsius", thermal["temperature_gpu_c"], sensor="gpu")
    eq("gpuwatch_temperature_celsius", thermal["temperature_memory_c"], sensor="memory")
    eq("gpuwatch_temperature_threshold_celsius", thermal["shutdown_threshold_c"], threshold="shutdown")
    eq("gpuwatch_temperature_threshold_celsius", thermal["slowdown_threshold_c"], threshold="slowdown")
    eq("gpuwatch_temperature_threshold_celsius", thermal["max_operating_c"], threshold="gpu_max")

    power = d["power"]
    eq("gpuwatch_power_watts", power["current_draw_mw"] / 1000)
    eq("gpuwatch_power_limit_watts", power["enforced_limit_mw"] / 1000, limit="enforced")
    eq("gpuwatch_power_limit_watts", power["default_limit_mw"] / 1000, limit="default")
    eq("gpuwatch_power_limit_watts", power["min_limit_mw"] / 1000, limit="min")
    eq("gpuwatch_power_limit_watts", power["max_limit_mw"] / 1000, limit="max")
    # the mock's energy counter never grows: the profile's value (0 where it has none) in J
    eq("gpuwatch_energy_joules_total", power.get("total_energy_consumption_mj", 0) / 1000)
    eq("gpuwatch_performance_state", int(str(d["performance_state"]).removeprefix("P")))

    memory = d["memory"]
    eq("gpuwatch_memory_total_bytes", memory["total_bytes"])
    eq("gpuwatch_memory_used_bytes", memory["used_bytes"])
    eq("gpuwatch_memory_free_bytes", memory["free_bytes"])
    eq("gpuwatch_memory_reserved_bytes", memory["reserved_bytes"])

    util = d["utilization"]
    eq("gpuwatch_utilization_ratio", util["gpu"] / 100, engine="gpu")
    eq("gpuwatch_utilization_ratio", util["memory"] / 100, engine="memory")

    clocks = d["clocks"]
    for clock in CLOCKS:
        eq("gpuwatch_clock_hertz", clocks[f"{clock}_current"] * 1e6, clock=clock)
        eq("gpuwatch_clock_max_hertz", clocks[f"{clock}_max"] * 1e6, clock=clock)
    for reason, active in d["clocks_throttle_reasons"].items():
        if isinstance(active, bool):
            eq("gpuwatch_clocks_event_active", int(active), reason=THROTTLE_REASONS.get(reason, reason))

    # the throttle-time counters stand at the profile's baselines (0 where it has none): no cause is active
    baselines = d["clocks_throttle_reasons"].get("counters") or {}
    for labels in series(m, "gpuwatch_clocks_event_seconds_total", **g):
        reason = dict(labels)["reason"]
        if reason in THROTTLE_COUNTERS and not d["clocks_throttle_reasons"].get(reason):
            eq("gpuwatch_clocks_event_seconds_total", baselines.get(f"{reason}_us", 0) / 1e6, reason=reason)

    pcie = d["pcie"]
    for link in ("current", "max"):
        eq("gpuwatch_pcie_link_generation", pcie[f"{link}_link_gen"], link=link)
        eq("gpuwatch_pcie_link_width", pcie[f"{link}_link_width"], link=link)
    eq("gpuwatch_pcie_replays_total", pcie["replay_counter"])

    errors = d["ecc"]["errors"]
    for counter in ("volatile", "aggregate"):
        eq("gpuwatch_ecc_errors_total", errors[counter]["single_bit"]["total"], counter=counter, error="corrected")
        eq("gpuwatch_ecc_errors_total", errors[counter]["double_bit"]["total"], counter=counter, error="uncorrected")
    rows = d["remapped_rows"]
    eq("gpuwatch_remapped_rows_total", rows["correctable"], error="correctable")
    eq("gpuwatch_remapped_rows_total", rows["uncorrectable"], error="uncorrectable")
    eq("gpuwatch_remapped_rows_pending", int(rows["pending"]))
    eq("gpuwatch_remapped_rows_failed", int(rows["failure_occurred"]))

    links, active = profile.links(i)
    if links:
        assert value(m, "gpuwatch_gpu_feature_supported", **g, feature="nvlink") is None  # its series say it
        eq("gpuwatch_nvlink_links", active, state="active")
        eq("gpuwatch_nvlink_links", links - active, state="inactive")
    else:
        # no link in the profile (L40S, T4; the B200 profile declares no switch, so no link): no NVLink at all
        lacks("gpuwatch_nvlink_links", "gpuwatch_nvlink_errors_total")
        assert not [n for (n, k) in m if n.startswith("gpuwatch_nvlink_") and ("gpu", str(i)) in k], where

    fabric = d.get("fabric")
    if fabric:
        info = {"state": fabric_state(fabric["state"]), "clique_id": str(fabric.get("clique_id", 0))}
        if fabric.get("cluster_uuid"):
            info["cluster_uuid"] = fabric["cluster_uuid"]
        found = series(m, "gpuwatch_fabric_state", **g, **info)  # one series: the state, the cluster, the clique
        assert list(found.values()) == [1], f"{where}: gpuwatch_fabric_state{info}: {found}"
    else:
        lacks("gpuwatch_fabric_state", "gpuwatch_fabric_health_summary")

    gpm = d.get("gpm") or {}
    if gpm.get("supported", d["architecture"] in HOPPER_AND_LATER):
        # the mock's GPM (engine/gpm.go) derives its metrics from the utilization of the profile
        assert value(m, "gpuwatch_gpu_feature_supported", **g, feature="gpm") is None  # its series say it
        eq("gpuwatch_sm_active_ratio", util["gpu"] / 100)
        eq("gpuwatch_pipe_active_ratio", util["gpu"] * 0.5 / 100, pipe="tensor")
        eq("gpuwatch_dram_bandwidth_ratio", util["memory"] / 100)
    else:
        lacks("gpuwatch_sm_active_ratio", "gpuwatch_pipe_active_ratio", "gpuwatch_dram_bandwidth_ratio")


# ------------------------------------------------------------------------------------ served -> exported

# What the profile serves for a GPU -> the families (with labels) gpuwatch must then export for it.
# A reading the mock serves and gpuwatch drops is a gap this table catches.
Served = Callable[[mocknvml.Profile, int], bool]


def _has(section: str) -> Served:
    return lambda p, i: bool(p.device(i).get(section))


def _links(p: mocknvml.Profile, i: int) -> bool:
    return p.links(i)[0] > 0


def _nvlink5(p: mocknvml.Profile, i: int) -> bool:
    return p.nvlink_version >= 5 and p.links(i)[0] > 0


def _throttle_251(p: mocknvml.Profile, i: int) -> bool:
    """The driver numbers the SW-thermal, HW-thermal and HW-power-brake throttle counters 251-253: R575 and
    R580 before 580.126 (docs: nvml-generations §2.2). The mock serves 251-253 on every profile; on the
    other branches gpuwatch must not read them (R570: 251 is PWR_SMOOTHING_ENABLED; older: no such counter)."""
    major, minor = (int(x) for x in p.driver_version.split(".")[:2])
    return major == 575 or (major == 580 and minor < 126)


def _gpm(p: mocknvml.Profile, i: int) -> bool:
    d = p.device(i)
    return bool((d.get("gpm") or {}).get("supported", d["architecture"] in HOPPER_AND_LATER))


WANT: list[tuple[str, Served, list[tuple[str, dict[str, str]]]]] = [
    ("thermal", _has("thermal"), [("gpuwatch_temperature_celsius", {"sensor": "gpu"}),
                                  ("gpuwatch_temperature_celsius", {"sensor": "memory"}),
                                  ("gpuwatch_temperature_threshold_celsius", {"threshold": "slowdown"})]),
    ("power", _has("power"), [("gpuwatch_power_watts", {}), ("gpuwatch_energy_joules_total", {}),
                              ("gpuwatch_power_limit_watts", {"limit": "enforced"})]),
    ("memory", _has("memory"), [("gpuwatch_memory_total_bytes", {}), ("gpuwatch_memory_reserved_bytes", {})]),
    ("clocks", _has("clocks"), [("gpuwatch_clock_hertz", {"clock": c}) for c in CLOCKS]),
    ("clocks_throttle_reasons", _has("clocks_throttle_reasons"), [("gpuwatch_clocks_event_active", {})]),
    # fields 74 and 76 (SW power cap, sync boost time), served on every profile
    ("throttle counters 74/76", _has("clocks_throttle_reasons"),
     [("gpuwatch_clocks_event_seconds_total", {"reason": "sw_power_cap"}),
      ("gpuwatch_clocks_event_seconds_total", {"reason": "sync_boost"})]),
    ("ecc", _has("ecc"), [("gpuwatch_ecc_errors_total", {"counter": "volatile", "error": "uncorrected"})]),
    ("remapped_rows", _has("remapped_rows"), [("gpuwatch_remapped_rows_total", {"error": "uncorrectable"}),
                                              ("gpuwatch_remapped_rows_failed", {})]),
    ("pcie", _has("pcie"), [("gpuwatch_pcie_link_generation", {"link": "current"}),
                            ("gpuwatch_pcie_replays_total", {})]),
    ("utilization", _has("utilization"), [("gpuwatch_utilization_ratio", {"engine": "gpu"})]),
    ("nvlink links", _links, [("gpuwatch_nvlink_links", {"state": "active"}),
                              ("gpuwatch_nvlink_traffic_bytes_total", {"direction": "tx"})]),
    ("fabric", _has("fabric"), [("gpuwatch_fabric_state", {})]),
    ("gpm", _gpm, [("gpuwatch_sm_active_ratio", {}), ("gpuwatch_dram_bandwidth_ratio", {}),
                   ("gpuwatch_pipe_active_ratio", {"pipe": "tensor"})]),
    # -- issue 18's done-when, landing from the branches working on them in parallel (they fail until merged):
    # the throttle-time counters under the R575/R580.65 numbering (fields 251-253): the GB200 profile
    # (driver 580.65.06) alone; clocks.py's field-id resolver by driver branch
    ("throttle counters 251-253", _throttle_251,
     [("gpuwatch_clocks_event_seconds_total", {"reason": r})
      for r in ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")]),
    # the NVLink5 error and recovery counters (fields 213-215, 219, 221, per link) on Blackwell links
    # (GB200, GB300); the NVLink group's NVLink5 work
    ("NVLink5 counters", _nvlink5,
     [("gpuwatch_nvlink_errors_total", {"error": e})
      for e in ("recovery_successful", "recovery_failed", "effective", "symbol", "recovery", "malformed_packet",
                "buffer_overrun", "receive", "remote", "general", "local_link_integrity", "transmit_discards")]
     + [("gpuwatch_nvlink_bit_error_ratio", {"kind": k}) for k in ("effective", "symbol")]),
    # NVLink-C2C to the Grace CPU: the mock serves C2C mode alone (nvmlDeviceGetC2cModeInfoV isC2cEnabled 1), not
    # the link fields 170-172, 231-234 the links are read from: the hardware is there and cannot be read, the c2c
    # feature 0 (test_c2c_mode_without_its_link_fields_is_said_once)
    ("c2c", lambda p, i: p.c2c, [("gpuwatch_gpu_feature_supported", {"feature": "c2c"})]),
]


def missing_families(m: Metrics, profile: mocknvml.Profile) -> list[str]:
    """"what: family{labels} on GPUs [...]" for each expectation of WANT some GPU misses."""
    out: dict[str, list[int]] = {}
    for i in range(profile.count):
        g = gpu(profile, i)
        for what, served, families in WANT:
            if not served(profile, i):
                continue
            for family, labels in families:
                if family.endswith("*"):
                    found = any(n.startswith(family[:-1]) and set(g.items()) <= set(k) for (n, k) in m)
                else:
                    found = bool(series(m, family, **g, **labels))
                if not found:
                    out.setdefault(f"{what}: {family}{labels or ''}", []).append(i)
    return [f"{text} on GPUs {gpus}" for text, gpus in out.items()]


# ------------------------------------------------------------------------------------ once


@pytest.mark.parametrize("path", PROFILES)
def test_once_exports_the_profiles_values(once, path):
    profile = mocknvml.Profile.load(path)
    check_profile(once(profile), profile)


@pytest.mark.parametrize("path", PROFILES)
def test_once_exports_every_reading_the_profile_serves(once, path):
    """With the detail options of readings the mock serves (NVLink5's symbol and packet error counters and
    symbol BER: `--collector.nvlink.packet-errors`; at defaults NVLink5 exports recoveries, effective errors
    and the effective BER, tests/test_golden.py pins the defaults)."""
    profile = mocknvml.Profile.load(path)
    missing = missing_families(once(profile, "--collector.nvlink.packet-errors"), profile)
    assert not missing, f"{profile.name}: served but not exported:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["gb200", "gb300"])
def test_throttle_counters_are_read_under_the_drivers_numbering(once, name):
    """The mock serves the SW-thermal, HW-thermal and HW-power-brake throttle times as fields 251-253
    whatever driver version its profile claims; only R575 and R580.65 number them so (R570 and R580.126+:
    269-271, and 251 is PWR_SMOOTHING_ENABLED there). With the time counted so far set in the profile
    (microseconds in the YAML, nanoseconds in NVML): the GB200 profile (580.65.06) shows them in seconds,
    the GB300 profile (570.124.06) must not show what 251-253 hold. SW power cap (field 74) alike on both."""
    base = profile_named(name)
    reasons = dict(base.device(0)["clocks_throttle_reasons"])
    reasons["counters"] = {"sw_power_cap_us": 1_500_000, "sw_thermal_slowdown_us": 2_500_000,
                           "hw_thermal_slowdown_us": 3_500_000, "hw_power_brake_slowdown_us": 4_500_000}
    profile = base.with_devices({1: {"clocks_throttle_reasons": reasons}})
    m = once(profile)
    check_profile(m, profile)
    g = gpu(profile, 1)
    assert value(m, "gpuwatch_clocks_event_seconds_total", **g, reason="sw_power_cap") == pytest.approx(1.5)
    new = {r: value(m, "gpuwatch_clocks_event_seconds_total", **g, reason=r)
           for r in ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")}
    if _throttle_251(profile, 1):
        assert new == pytest.approx({"sw_thermal_slowdown": 2.5, "hw_thermal_slowdown": 3.5,
                                     "hw_power_brake_slowdown": 4.5})
    else:
        assert new == dict.fromkeys(new), f"{name} ({profile.driver_version}) read fields 251-253: {new}"


# ------------------------------------------------------------------------------------ run

# every rule at hold 0 and evaluated at every poll: on a healthy profile none may fire, not even once
EAGER = {"rules": {r.id: {"hold": 0, "every": 0} for r in all_rules()}}


def start(lib: Path, workdir: Path, profile: mocknvml.Profile, config: dict[str, Any] | None = None,
          args: tuple[str, ...] = (), daemon: bool = False, child: ChildBackend | None = None) -> Daemon | InProc:
    """The agent over the profile, fast polls every 0.25 s, slow every 1 s: in-process on simulated time
    (inproc.InProc; over a backend in ``child`` if given), or ``daemon``: `gpuwatch run` (tests/daemon.py),
    where the mock's own clock matters."""
    workdir.mkdir(parents=True, exist_ok=True)
    extra = list(args)
    if config is not None:
        (workdir / "gpuwatch.yml").write_text(json.dumps(config))
        extra += ["--config", str(workdir / "gpuwatch.yml")]
    if child is not None:
        return InProc(workdir / "agent", args=extra, child=child)
    env = mocknvml.env(lib, profile.write(workdir / "profile"))
    if daemon:
        return Daemon(workdir, env, extra)
    return InProc(workdir / "agent", args=extra, nvml_env=env)


def waiter(d: Daemon | InProc) -> Callable[..., Any]:
    """wait_for on the agent's time: simulated in-process, real for a daemon."""
    return d.wait_for if isinstance(d, InProc) else wait_for


def poll_errors(m: Metrics) -> dict[tuple[tuple[str, str], ...], float]:
    return series(m, "gpuwatch_poll_errors_total")


@pytest.mark.parametrize("path", PROFILES)
def test_run_exports_the_profiles_values_and_polls_cleanly(lib, children, tmp_path, path):
    profile = mocknvml.Profile.load(path)
    d = start(lib, tmp_path, profile, EAGER, child=children(profile))
    try:
        def polled(count: int) -> Metrics | None:
            m = d.metrics()
            done = value(m, "gpuwatch_poll_success", tier="slow") == 1 and \
                value(m, "gpuwatch_poll_success", tier="fast") == 1
            return m if done and len(series(m, "gpuwatch_gpu_up")) == count else None

        first = d.wait_for(lambda: polled(profile.count), what=f"{profile.name}: the first slow poll")
        check_profile(first, profile)
        stamp = value(first, "gpuwatch_last_poll_timestamp_seconds", tier="slow")

        def next_slow_poll() -> Metrics | None:
            m = d.metrics()
            return m if value(m, "gpuwatch_last_poll_timestamp_seconds", tier="slow") != stamp else None

        later = d.wait_for(next_slow_poll, what=f"{profile.name}: another slow poll")
        assert value(later, "gpuwatch_poll_success", tier="fast") == 1
        assert value(later, "gpuwatch_poll_success", tier="slow") == 1
        assert poll_errors(later) == poll_errors(first), "poll errors on a healthy profile"
        check_profile(later, profile)
        assert firing(later) == set(), f"{profile.name} is healthy: {firing(later)} fire"
    finally:
        d.stop()


# ------------------------------------------------------------------------------------ faults


def fault_run(lib: Path, tmp_path: Path, profile: mocknvml.Profile, index: int, fault: dict[str, Any],
              expected: set[str], config: dict[str, Any] | None = None, timeout: float = 20.0,
              needs: tuple[tuple[str, dict[str, str]], ...] = (), daemon: bool = False) -> tuple[Metrics, list[dict]]:
    """Inject ``fault`` into GPU ``index`` of the profile; wait until exactly ``expected`` rules fire on that
    GPU; then nothing may fire anywhere else. The metrics of that moment and the log. ``needs``: the
    families (with labels) the rule reads, which the first slow poll must have exported for that GPU."""
    faulty = profile.with_devices({index: fault})
    rules = {r.id: {"hold": 0, "every": 0} for r in all_rules()}
    for rule, settings in ((config or {}).get("rules") or {}).items():
        rules[rule] = {**rules.get(rule, {}), **settings}
    d = start(lib, tmp_path, faulty, {"rules": rules}, daemon=daemon)
    wait = waiter(d)
    try:
        want = {(rule, str(index)) for rule in expected}
        if needs:
            def slow_polled() -> Metrics | None:
                m = d.metrics()
                return m if value(m, "gpuwatch_poll_success", tier="slow") == 1 else None

            first = wait(slow_polled, what="the first slow poll")
            absent = [f"{f}{labels}" for f, labels in needs if not series(first, f, **gpu(profile, index), **labels)]
            assert not absent, f"GPU {index} does not export what {sorted(expected)} reads: {absent}"

        def fired() -> Metrics | None:
            m = d.metrics()
            return m if want <= firing(m) else None

        m = wait(fired, timeout, f"{sorted(expected)} firing on GPU {index}")
        assert firing(m) == want, f"beyond {sorted(want)}: {sorted(firing(m) - want, key=str)}"
        status = json.loads(d.get("/api/v1/status")[1])
        assert {(a["rule"], a["gpu"]) for a in status["anomalies"]} == want
        for i in range(profile.count):
            if i != index:
                assert value(m, "gpuwatch_gpu_up", **gpu(profile, i)) == 1
        return m, d.events()
    finally:
        d.stop()


def test_fallen_off_bus_while_polled_is_gpu_lost_on_that_gpu_alone(lib, tmp_path):
    """H100 GPU 3 falls off the bus after 60 guarded calls (a second or so of polling; the mock counts the
    calls that read the GPU, engine/failure_injector.go) and reports Xid 79 once: gpu_lost and xid_critical
    (79 is on the critical list) on GPU 3, nothing else anywhere."""
    profile = profile_named("h100")
    fault = {"failure": {"mode": "fallen_off_bus", "after_calls": 60, "xid": {"code": 79}}}
    m, log = fault_run(lib, tmp_path, profile, 3, fault, {"gpu_lost", "xid_critical"})
    assert value(m, "gpuwatch_gpu_up", **gpu(profile, 3)) == 0
    assert value(m, "gpuwatch_xid_events_total", **gpu(profile, 3)) == 1
    lost = [e for e in log if e["event"] == "gpu_lost"]
    assert [e["gpu"] for e in lost] == ["3"], lost
    assert "probed" not in lost[0]["error"], "lost at discovery: after_calls is too low for this gpuwatch"


def test_fallen_off_bus_at_discovery_is_gpu_lost_not_a_gpu_without_readings(lib, tmp_path):
    """Without after_calls the mock trips on the GPU's first guarded call: while gpuwatch probes it at
    discovery, after its identity answered. It is listed and down (it used to be up with no reading)."""
    profile = profile_named("h100")
    m, log = fault_run(lib, tmp_path, profile, 5, {"failure": {"mode": "fallen_off_bus"}}, {"gpu_lost"})
    assert value(m, "gpuwatch_gpu_up", **gpu(profile, 5)) == 0
    assert value(m, "gpuwatch_gpus") == profile.count
    assert [e["gpu"] for e in log if e["event"] == "gpu_lost"] == ["5"]


def test_ecc_uncorrectable_fires_on_that_gpu_alone(lib, tmp_path):
    """The mock's ecc_uncorrectable adds its call count to the GPU's uncorrected ECC counts and reports a
    failed row remapping (engine/device.go GetTotalEccErrors, GetRemappedRows): ecc_uncorrectable and
    row_remap_failed on that GPU, nothing else anywhere."""
    profile = profile_named("h100")
    m, _ = fault_run(lib, tmp_path, profile, 2, {"failure": {"mode": "ecc_uncorrectable"}},
                  {"ecc_uncorrectable", "row_remap_failed"})
    assert value(m, "gpuwatch_ecc_errors_total", **gpu(profile, 2, counter="volatile", error="uncorrected")) >= 1
    assert value(m, "gpuwatch_remapped_rows_failed", **gpu(profile, 2)) == 1
    assert value(m, "gpuwatch_gpu_up", **gpu(profile, 2)) == 1


@pytest.mark.daemon  # the mock's error rate runs on its real clock: the rule's rate must too
def test_nvlink_error_on_blackwell_is_nvlink_errors_rising_on_that_gpu_alone(lib, tmp_path):
    """The mock's nvlink_error (200 errors/s on every link of GB200 GPU 2) raises, per link, the NVLink5
    counters 206-215, 219 and 221 and the DL counters 161-163 (engine/nvlink_fields.go). On Blackwell
    gpuwatch reads the NVLink5 counters (161-163 are NOT_SUPPORTED on real Blackwell drivers), so this
    needs the NVLink group's NVLink5 work. The mock answers those fields per link only: scopeId UINT_MAX
    (the all-links total DCGM asks for) is NOT_SUPPORTED there."""
    profile = profile_named("gb200")
    fault_run(lib, tmp_path, profile, 2, {"nvlink_error": {"rate": 200.0}}, {"nvlink_errors_rising"},
              {"rules": {"nvlink_errors_rising": {"lookback_seconds": 5}}},
              needs=(("gpuwatch_nvlink_errors_total", {}),), daemon=True)


# ------------------------------------------------------------------------------------ where the mock is not NVML


def blackwell_with_links() -> list[Any]:
    out = []
    for p in PROFILES:
        path = p.values[0]
        if path is None:
            return [p]
        profile = mocknvml.Profile.load(path)
        if profile.device(0)["architecture"] == "blackwell" and profile.links(0)[0]:
            out.append(pytest.param(path, id=p.id))
    return out


def grace_profiles() -> list[Any]:
    out = []
    for p in PROFILES:
        path = p.values[0]
        if path is None:
            return [p]
        if mocknvml.Profile.load(path).c2c:
            out.append(pytest.param(path, id=p.id))
    return out


@pytest.mark.parametrize("path", grace_profiles())
def test_c2c_mode_without_its_link_fields_is_said_once(lib, tmp_path, path):
    """The Grace profiles serve C2C mode (isC2cEnabled 1) but not the C2C link fields (170-172, 231-234) a driver
    answers beside it: gpuwatch says so once per GPU (c2c_links_unreadable), exports no C2C series rather than
    zeros but the c2c feature 0 (the hardware is there, its readings are not), and its c2c group succeeds."""
    profile = mocknvml.Profile.load(path)
    d = InProc(tmp_path / "agent", args=["--log.level", "info"], nvml_env=mocknvml.env(lib, profile.write(tmp_path)))
    try:
        assert d.h.poller.backend_up, d.events()  # what `gpuwatch once` shows, exit 0
        events, stdout = d.events(), d.scrape()
    finally:
        d.stop()
    assert [e["event"] for e in events].count("c2c_links_unreadable") == profile.count
    assert "gpuwatch_c2c_" not in stdout
    assert stdout.count('feature="c2c"') == profile.count and 'feature="c2c",gpu="0"' in stdout
    assert not [line for line in stdout.splitlines() if 'feature="c2c"' in line and not line.endswith(" 0.0")]
    assert 'gpuwatch_collector_success{group="c2c"} 1.0' in stdout


@pytest.mark.parametrize("path", blackwell_with_links())
def test_blackwell_does_not_read_the_dl_error_counters_the_mock_serves(once, path):
    """The mock serves the NVLink DL error fields 161-163 on Blackwell; real Blackwell drivers answer
    NOT_SUPPORTED (the header: use the NVLink5 recovery counters 213-215). gpuwatch must not read them on
    Blackwell, so neither the totals nor the per-link series have their replay / crc_flit errors, which
    NVLink5 does not count."""
    profile = mocknvml.Profile.load(path)
    m = once(profile, "--collector.nvlink.per-link")
    dl = [k for (n, k) in m if n in ("gpuwatch_nvlink_errors_total", "gpuwatch_nvlink_link_errors_total")
          and dict(k)["error"] in ("replay", "crc_flit")]
    assert not dl, f"{profile.name}: DL error counters read on Blackwell: {dl[:3]}"


@pytest.mark.parametrize("path", PROFILES)
def test_what_the_mock_does_not_model_is_unsupported_not_zero(once, path):
    """The mock's other differences from NVML, and what gpuwatch does about each:

    - MIG enumeration answers NOT_FOUND (the profiles have MIG disabled): no MIG series and no mig feature
      series (MIG is a class of hardware: 1 where enabled, else absent), the mig group collected
      (check_profile asserts every group).
    - Module and memory power scopes (fields 185-192 with scopeId 1/2) are NOT_SUPPORTED: gpuwatch exports
      the GPU scope alone; a module or memory scope feature, where gpuwatch has one, is 0.
    - The BER fields 220/222 come as a double where NVML packs mantissa (bits 8-11) and exponent (bits
      0-7) in an unsigned: the mock only ever answers 0.0, which both read as a BER of 0, so the test
      cannot tell the decodings apart; it pins that a BER, where exported, is 0 and costs no poll error.
    - GPUs without NVLink answer the NVLink functions with SUCCESS and zeros, but the NVLink link count
      (field 91) with 0: gpuwatch shows no NVLink on the L40S and T4 (check_gpu asserts it per GPU).
    - The all-links scope of the throughput fields 138/139 (scopeId UINT_MAX, which the header defines
      as the sum over the links) answers SUCCESS with 0: gpuwatch exports the traffic the driver reports,
      0 here; per link the mock counts.
    """
    profile = mocknvml.Profile.load(path)
    m = once(profile)
    for i in range(profile.count):
        g = gpu(profile, i)
        assert value(m, "gpuwatch_gpu_feature_supported", **g, feature="mig") is None
        assert not [n for (n, k) in m if n.startswith("gpuwatch_mig_") and set(g.items()) <= set(k)]
        scopes = {dict(k)["feature"]: v for k, v in series(m, "gpuwatch_gpu_feature_supported", **g).items()
                  if "module" in dict(k)["feature"] or "memory_power" in dict(k)["feature"]}
        assert all(v == 0 for v in scopes.values()), scopes
        assert not [k for k in series(m, "gpuwatch_power_watts", **g) if dict(k).get("scope") not in (None, "gpu")]
        ber = [v for (n, k), v in m.items() if "ber" in n.removeprefix("gpuwatch_").split("_")
               and set(g.items()) <= set(k)]
        assert all(v == 0 for v in ber), ber
        if profile.links(i)[0]:
            for direction in ("tx", "rx"):
                assert value(m, "gpuwatch_nvlink_traffic_bytes_total", **g, direction=direction) == 0
