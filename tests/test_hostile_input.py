"""Hostile input from the host is data: every parser of text gpuwatch does not write, fed random bytes,
5000-digit numbers, NaN and infinities, negatives, very long lines and truncated files mixed into valid
lines, raises nothing, keeps every valid line and returns sane values (Hypothesis generates the inputs;
each property is kept to 100 examples, 40 where each one writes a tree of files, so the file runs in
seconds).

The end-to-end case is the issue's: a devices.list with a 5000-digit minor for one job used to fail
the whole slurm group as an internal error and hide every allocation of the node.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
from fakehost import fake_process, proc_stat, slurm_v1_job
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuwatch import drain
from gpuwatch.attribution import Attributor, parse_cgroup
from gpuwatch.clock import FakeClock
from gpuwatch.errors import ConfigError
from gpuwatch.groups import Selection
from gpuwatch.hostside import HostReader, cgroups
from gpuwatch.hostside.cgroups import JobCgroup, count_cpu_list, parse_devices_list
from gpuwatch.hostside.grace import GraceHwmon
from gpuwatch.hostside.hostile import Malformed, finite, natural
from gpuwatch.hostside.slurm_allocations import hostlist_contains, parse_scontrol_job, read_mapping_dir
from gpuwatch.model import GpuProcess, GpuState
from gpuwatch.testing import identity
from gpuwatch.yamlfile import parse_yaml

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- hostile pieces ------------------------------------------------------------------------------------

HUGE = "9" * 5000  # int() raises on more than 4300 digits
NUMBERS = st.sampled_from([HUGE, "1" + "0" * 4400, "-1", "-0", "nan", "NaN", "inf", "-inf", "1e400", "1e-400",
                           "0x10", "1_000", "+5", "٣", "²", "", " ", "18446744073709551616", "4294967296", "1.5"])
SINGLE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60).filter(lambda s: len(s.splitlines()) <= 1)
BINARY = st.binary(max_size=60).map(lambda b: b.decode(errors="replace")).filter(lambda s: len(s.splitlines()) <= 1)
LONG = st.integers(1000, 100_000).map(lambda n: "x" * n)


def hostile_line(template: str) -> st.SearchStrategy[str]:
    """A line that is not valid: a template with a hostile number, random text, random bytes, a long line."""
    return st.one_of(NUMBERS.map(template.format), SINGLE, BINARY, LONG, NUMBERS)


def interleave(valid: list[str], hostile: list[str], data: st.DataObject) -> list[str]:
    lines = valid + hostile
    return data.draw(st.permutations(lines)) if lines else []


def truncated(line: str, data: st.DataObject) -> str:
    """A file that ends mid-line (read while it was written): a prefix of ``line``, maybe empty."""
    return line[: data.draw(st.integers(0, len(line) - 1))]


# -- the number helpers ----------------------------------------------------------------------------------

@FAST
@given(st.one_of(NUMBERS, st.text(max_size=30), st.integers(-10**30, 10**30).map(str)), st.integers(0, 2**64))
def test_natural_is_a_bounded_whole_number_or_none(text, maximum):
    value = natural(text, maximum)
    assert value is None or (isinstance(value, int) and 0 <= value <= maximum)
    if text.isascii() and text.isdigit() and len(text) <= 20 and int(text) <= maximum:
        assert value == int(text)


@FAST
@given(st.one_of(NUMBERS, st.text(max_size=30), st.floats(allow_nan=True).map(repr)))
@example("\u0661\u0662")
@example("1_000")
@example("3\xa0")
@example("1\x1f")
def test_finite_is_a_bounded_finite_number_or_none(text):
    value = finite(text, 1e19)
    assert value is None or (math.isfinite(value) and 0 <= value <= 1e19)
    if value is not None:  # what the kernel writes: ASCII, its own whitespace around, no underscore
        assert text.isascii() and "_" not in text and not any("\x1c" <= c <= "\x1f" for c in text)
    if re.fullmatch(r"[0-9]{1,15}(\.[0-9]{1,6})?", text):
        assert value == float(text)


# -- devices.list -----------------------------------------------------------------------------------------

GPU_LINE = st.integers(0, 253).map(lambda m: (m, f"c 195:{m} {'rwm'[: 1 + m % 3]}"))
OTHER_DEVICE = st.sampled_from(["c 195:255 rwm", "c 195:254 rwm", "c 510:0 rwm", "c 1:3 rw", "b 8:0 r", "c 136:* rwm"])
_VALID_DEVICE = re.compile(r"\s*[abc]\s+(\d+|\*):(\d+|\*)\s+[rwm]+\s*", re.ASCII)
HOSTILE_DEVICE = st.one_of(hostile_line("c 195:{} rwm"), hostile_line("c {}:0 rwm"), hostile_line("{} 195:0 rwm"),
                           st.sampled_from(["c 195:0", "c 195:0 rwx", "c 195 rwm", "a", "a *:*", "c 195:0 rwm extra",
                                            "\x00\x01\x02", "c\t195:" + HUGE + "\trwm"])
                           ).filter(lambda s: s.strip() and not _VALID_DEVICE.fullmatch(s))


@FAST
@given(st.lists(GPU_LINE, max_size=8), st.lists(OTHER_DEVICE, max_size=4), st.lists(HOSTILE_DEVICE, max_size=6),
       st.data())
@example([(0, "c 195:0 rwm"), (3, "c 195:3 rw")], [], ["c 195:" + HUGE + " rwm", "\x7fELF\x00\x01", "garbage"], None)
def test_devices_list_keeps_every_valid_gpu_and_reports_each_bad_line(gpus, others, hostile, data):
    lines = [line for _, line in gpus] + others + hostile
    tail = ""
    if data is not None:
        lines = data.draw(st.permutations(lines))
        tail = truncated("c 195:7 rwm", data)[:6]  # the file ends mid-line, before the minor's digits
    bad: list[str] = []
    minors = parse_devices_list("\n".join(lines + [tail]), bad)
    assert minors == tuple(sorted({m for m, _ in gpus}))
    assert len(bad) == len(hostile) + bool(tail.strip())


@FAST
@given(st.lists(GPU_LINE, min_size=1, max_size=4), st.lists(HOSTILE_DEVICE, max_size=4), st.data())
def test_devices_list_allow_all_still_wins_among_garbage(gpus, hostile, data):
    lines = data.draw(st.permutations([line for _, line in gpus] + hostile + ["a *:* rwm"]))
    assert parse_devices_list("\n".join(lines)) is None


@FAST
@given(st.binary(max_size=400))
def test_devices_list_of_random_bytes(raw):
    minors = parse_devices_list(raw.decode(errors="replace"), [])
    assert minors is None or all(0 <= m <= 253 for m in minors)


# -- cgroup files of one job --------------------------------------------------------------------------------

def _job_dir(root: Path, files: dict[str, str]) -> JobCgroup:
    job = root / "job"
    job.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (job / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    return JobCgroup("slurm", "1", dirs={"": job})


@FAST
@given(st.lists(st.integers(1, cgroups.MAX_PID), max_size=10), st.integers(0, 3),
       st.lists(hostile_line("{}").filter(lambda s: s.strip() and not (s.strip().isascii() and s.strip().isdigit())),
                max_size=6), st.data())
def test_cgroup_procs_keeps_every_pid(pids, zeros, hostile, data):
    tokens = [str(p) for p in pids] + ["0"] * zeros
    text = " \n".join(interleave(tokens, [h.replace("\n", " ") for h in hostile], data))
    text += "\n" + truncated("4194304", data)  # ends mid-number: a prefix of a PID is a PID or nothing
    reports: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        found, hidden = _job_dir(Path(tmp), {"cgroup.procs": text}).pids(lambda s, r: reports.append((s, r)))
    assert set(pids) <= found and hidden >= zeros
    assert all(0 < p <= cgroups.MAX_PID for p in found)
    assert len(reports) <= 1 and all(s.endswith("cgroup.procs") for s, _ in reports)


CPU_PART = st.one_of(st.integers(0, 4095).map(lambda c: ([c], str(c))),
                     st.tuples(st.integers(0, 4095), st.integers(0, 64)).map(
                         lambda t: (list(range(t[0], t[0] + t[1] + 1)), f"{t[0]}-{t[0] + t[1]}")))


_VALID_CPU_PART = re.compile(r"\s*[0-9]+(-[0-9]+)?\s*", re.ASCII)


@FAST
@given(st.lists(CPU_PART, max_size=6),
       st.lists(hostile_line("{}").filter(lambda s: "," not in s and not _VALID_CPU_PART.fullmatch(s)), max_size=4),
       st.data())
@example([([0, 1, 2, 3], "0-3")], ["0-" + HUGE, HUGE, "-1", "nan", "3-" + "9" * 30], None)
@example([], ["0\x1f", "\x1c1-2", "3\xa0"], None)  # not the kernel's whitespace: str.strip() took them
def test_cpu_list_counts_the_valid_ranges(parts, hostile, data):
    texts = [t for _, t in parts] + hostile
    if data is not None:
        texts = data.draw(st.permutations(texts))
    assert count_cpu_list(",".join(texts)) == sum(len(cpus) for cpus, _ in parts)


@FAST
@given(st.fixed_dictionaries({}, optional={
    "cpu.stat": st.one_of(NUMBERS.map("user_usec {}\nsystem_usec 5\n".format), SINGLE, BINARY),
    "io.stat": st.one_of(NUMBERS.map("8:0 rbytes={} wbytes=2 rios=1\n8:16 rbytes=10 wbytes=20\n".format), SINGLE,
                         BINARY, LONG),
    "cpu.max": st.one_of(st.tuples(NUMBERS, NUMBERS).map(" ".join), SINGLE, st.just("max 100000")),
    "cpuset.cpus.effective": st.one_of(NUMBERS, NUMBERS.map("0-{}".format), SINGLE, BINARY),
}))
def test_accounting_and_cpus_are_finite_or_absent(files):
    reported: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        job = _job_dir(Path(tmp), files)
        cpu, io = job.accounting(lambda source, _reason: reported.append(Path(source).name))
        cpus = job.cpus(lambda source, _reason: reported.append(Path(source).name))
    assert set(reported) <= set(files) and len(reported) == len(set(reported))  # one report per file at most
    for value in (cpu or ()) + (io or ()):
        assert math.isfinite(value) and value >= 0
    assert io is None or all(v <= cgroups.MAX_BYTES for v in io)
    if io is not None and "rbytes=10 wbytes=20" in files.get("io.stat", ""):
        assert io[0] >= 10 and io[1] >= 20  # the valid device's line survives a hostile one
    assert cpus is None or (math.isfinite(cpus) and cpus > 0)


@pytest.mark.parametrize(("name", "text", "kept"), [
    ("cpu.max", "nan 100000", None), ("cpu.max", "200000 -1", None), ("cpu.max", HUGE + " 100000", None),
    ("cpuset.cpus.effective", "0-3,x,8-" + HUGE + ",5-4", 4.0), ("cpu.stat", "user_usec nan\nsystem_usec 1", None),
    ("io.stat", "8:0 rbytes=-5 wbytes=7\n8:16 rbytes=3 wbytes=inf", (3, 7))])
def test_each_bad_cgroup_file_is_reported_once_and_its_valid_parts_kept(tmp_path, name, text, kept):
    reported: list[tuple[str, str]] = []
    job = _job_dir(tmp_path, {name: text})
    cpu, io = job.accounting(lambda *args: reported.append(args))
    cpus = job.cpus(lambda *args: reported.append(args))
    assert [Path(source).name for source, _ in reported] == [name]
    assert cpu is None
    assert (io if name == "io.stat" else cpus) == kept



@pytest.mark.parametrize(("quota", "period", "told", "kept"), [
    ("nan", "100000", True, None), ("200000", "0", True, None), (HUGE, "100000", True, None), ("12x", "100000", True, None),
    ("-1", "100000", False, None), ("250000", "100000", False, 2.5), ("-7", "100000", True, None)])
def test_a_cgroup_v1_cpu_quota_that_does_not_parse_is_reported(tmp_path, quota, period, told, kept):
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us: garbage is told like cpu.max's (it was skipped in
    silence); -1 is no quota, said by the kernel, not garbage."""
    cpu = tmp_path / "cpu" / "job"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text(quota + "\n")
    (cpu / "cpu.cfs_period_us").write_text(period + "\n")
    reported: list[tuple[str, str]] = []
    for dirs in ({"cpu": cpu}, {"cpu,cpuacct": cpu, "cpu": cpu}):  # one mount under both names: told once
        reported.clear()
        cpus = JobCgroup("slurm", "1", dirs=dirs).cpus(lambda *args: reported.append(args))
        assert [Path(source).name for source, _ in reported] == (["cpu.cfs_quota_us"] if told else [])
        assert cpus == kept


def test_a_bad_v1_cpu_quota_is_reported_once_where_cpu_is_cpu_cpuacct_by_another_name(tmp_path):
    """systemd's cgroup v1 layout: /sys/fs/cgroup/cpu is a symlink to cpu,cpuacct, and the scan finds the job
    under both names (two text paths of one directory): its quota is read, and a bad one told, once."""
    job = tmp_path / "cpu,cpuacct" / "slurm" / "uid_1000" / "job_7"
    job.mkdir(parents=True)
    (job / "cpu.cfs_quota_us").write_text("12x\n")
    (job / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu").symlink_to("cpu,cpuacct")
    (found,) = cgroups.scan(tmp_path).jobs
    assert set(found.dirs) == {"cpu", "cpu,cpuacct"}
    reported: list[tuple[str, str]] = []
    assert found.cpus(lambda *args: reported.append(args)) is None
    assert [Path(source).name for source, _ in reported] == ["cpu.cfs_quota_us"]

def test_scan_passes_over_hostile_directory_names(tmp_path):
    v2 = tmp_path / "system.slice" / "slurmstepd.scope"
    for name in ("job_" + "9" * 200, "job_١٢", "job_-1", "job_1e3", "job_42", "job_" + "9" * 20):
        (v2 / name).mkdir(parents=True)
    (tmp_path / "devices" / "slurm" / ("uid_" + "9" * 200) / "job_43").mkdir(parents=True)
    found = cgroups.scan(tmp_path)
    ids = [j.job_id for j in found.jobs]
    assert "42" in ids and "43" in ids and "9" * 20 in ids and len(ids) == 3
    assert next(j for j in found.jobs if j.job_id == "43").uid is None


# -- scontrol ---------------------------------------------------------------------------------------------

RECORD = ("JobId=42 JobName={name} UserId=alice(1000) NodeList=gpu[06-07] NumNodes=2 "
          "Nodes=gpu06 CPU_IDs=0-7 Mem=1024 GRES=gpu:a100:2(IDX:0-1) "
          "Nodes={nodes} CPU_IDs=0-7 Mem=1024 GRES={gres} MinCPUsNode=1 Command={name}")


@FAST
@given(name=st.one_of(SINGLE, BINARY, LONG, NUMBERS).map(lambda s: "".join(s.split()) or "x"),
       hostile=st.one_of(NUMBERS, SINGLE, BINARY).map(lambda s: re.sub(r"[\s\[\](),=]", "", s)),
       indices=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True))
def test_scontrol_record_keeps_this_nodes_gpus_among_hostile_fields(name, hostile, indices):
    gres = f"gpu:a100:{len(indices)}(IDX:{','.join(map(str, indices))})"
    text = RECORD.format(name=name, nodes=f"gpu[{hostile},07]", gres=gres)
    answer = parse_scontrol_job(text, "gpu07")
    assert answer is not None and answer.on_node and answer.indices == tuple(sorted(indices))
    text = RECORD.format(name=name, nodes="gpu07", gres=f"gpu:a100:1(IDX:{hostile},{indices[0]})," + gres)
    answer = parse_scontrol_job(text, "gpu07")
    assert answer is not None and set(indices) <= set(answer.indices)
    assert all(0 <= i < 1024 for i in answer.indices)


@FAST
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode(errors="replace")), LONG,
                 NUMBERS.map("JobId=1 NodeList=x Nodes=n[0-{0}] GRES=gpu(IDX:0-{0}) MinCPUsNode=1".format)))
def test_scontrol_random_output_is_an_answer_or_none(text):
    answer = parse_scontrol_job(text, "n1")
    assert answer is None or all(0 <= i < 1024 for i in answer.indices)


@FAST
@given(st.lists(st.one_of(NUMBERS, SINGLE).map(lambda s: s.replace(",", "")), max_size=4), st.data())
@example(["[" + HUGE + "]", "n[0-" + HUGE + "]", "n" + "[1]" * 500], None)
def test_hostlist_finds_the_node_among_hostile_parts(hostile, data):
    parts = [h for h in hostile if h] + ["gpu[01-03,07]"]
    if data is not None:
        parts = data.draw(st.permutations(parts))
    assert hostlist_contains(",".join(parts), "gpu07")
    hostlist_contains(",".join(parts), HUGE)  # answers, whatever it answers


def test_hostlist_with_many_brackets_is_quick():
    started = time.perf_counter()
    assert not hostlist_contains("n" + "[0-9]" * 40, "n" + "1" * 39 + "x")
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("gres", ["gpu" + ":" * 60 + "x", "gpu" + ":a" * 5000, "gpu:(" * 5000, "gpu(IDX:" + "0-" * 5000])
def test_scontrol_gres_field_is_read_in_linear_time(gres):
    started = time.perf_counter()
    answer = parse_scontrol_job(RECORD.format(name="x", nodes="gpu07", gres=gres + ",gpu:a100:1(IDX:3)"), "gpu07")
    assert answer is not None and 3 in answer.indices
    assert time.perf_counter() - started < 1


@FAST
@given(st.one_of(st.text(max_size=300), LONG, st.just("State=IDLE\n Reason=" + " " * 30000 + "x"),
                 NUMBERS.map("NodeName=n1 State={}\n   Reason=x [root@2024-01-01T00:00:00]\n".format)))
def test_show_node_is_a_state_or_value_error(text):
    started = time.perf_counter()
    try:
        node = drain.parse_show_node(text)
    except ValueError:
        return
    assert isinstance(node.state, str) and isinstance(node.reason, str)
    assert time.perf_counter() - started < 1


# -- the mapping directory ---------------------------------------------------------------------------------

@FAST
@given(st.lists(st.integers(1, 10**12).map(str), max_size=4),
       st.lists(hostile_line("{}").filter(lambda s: s.strip() and not re.fullmatch(r"[0-9A-Za-z][\w.+-]{0,63}",
                                                                                       s.strip(), re.ASCII)),
                max_size=4), st.data())
def test_mapping_file_keeps_every_job_id(jobs, hostile, data):
    reports: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        text = "\n".join(interleave(jobs, hostile, data)) + "\n"
        (directory / "0").write_bytes(text.encode("utf-8", "surrogateescape"))
        (directory / ("9" * 200)).write_text("7\n")  # a name of 200 digits is no GPU index
        found = read_mapping_dir(directory, lambda s, r: reports.append(s))
    assert sorted(found.get((0, None), [])) == sorted(jobs)
    assert len(reports) == (1 if hostile else 0)


# -- /proc for the attribution -------------------------------------------------------------------------------

@FAST
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode(errors="replace")), LONG))
def test_proc_cgroup_of_random_text(text):
    scheduler, job, _container = parse_cgroup(text + "\n0::/system.slice/slurmstepd.scope/job_42/step_0\n")
    assert scheduler in ("slurm", "kubernetes", "systemd", "none")
    assert scheduler != "slurm" or (job.isascii() and job.isdigit())


def test_proc_cgroup_of_many_kubepods_levels_is_quick():
    started = time.perf_counter()
    assert parse_cgroup(("0::/" + "kubepods/" * 455 + "\n") * 13)[0] == "none"
    uid = "0123abcd-0123-4567-89ab-0123456789ab"
    assert parse_cgroup("0::/kubepods/" + "kubepods/" * 400 + f"pod{uid}/x\n")[:2] == ("kubernetes", uid)
    assert time.perf_counter() - started < 0.1


@FEW
@given(st.binary(max_size=200), st.one_of(NUMBERS, SINGLE))
def test_attribution_of_a_process_with_hostile_proc_files(cgroup, uid):
    with tempfile.TemporaryDirectory() as tmp:
        fake_process(Path(tmp), 100)
        (Path(tmp) / "100" / "cgroup").write_bytes(cgroup + b"\n0::/system.slice/slurmstepd.scope/job_42/x\n")
        (Path(tmp) / "100" / "status").write_text(f"Name:\tx\nUid:\t{uid}\t0\t0\t0\n".replace("\x00", ""))
        infos = Attributor(tmp, user_name=lambda u: f"u{u}").attribute(identity(0), [GpuProcess(100, 1)])
    assert len(infos) == 1 and infos[0].job_id in ("42", "") or infos[0].scheduler != "slurm"


# -- the kubelet's answer ------------------------------------------------------------------------------------

@FAST
@given(st.lists(st.tuples(st.text(max_size=40), st.lists(st.text(max_size=80), max_size=4)), max_size=5))
def test_kubelet_response_with_hostile_names_and_ids(devices):
    pytest.importorskip("grpc")
    from gpuwatch.hostside.kubelet import devices_from_response
    from gpuwatch.hostside.podresources import api_pb2

    containers = [api_pb2.ContainerResources(name="c", devices=[
        api_pb2.ContainerDevices(resource_name=resource, device_ids=ids) for resource, ids in devices])]
    valid = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-1::3"])
    containers.append(api_pb2.ContainerResources(name="ok", devices=[valid]))
    response = api_pb2.ListPodResourcesResponse(pod_resources=[
        api_pb2.PodResources(name="p\n\"", namespace="n", containers=containers)])
    rows = devices_from_response(response)
    assert all(r.resource.startswith("nvidia.com/") for r in rows)
    assert any(r.container == "ok" and r.device_id == "GPU-1" for r in rows)


# -- Grace hwmon ---------------------------------------------------------------------------------------------

@FEW
@given(st.one_of(NUMBERS.map(str.encode), st.binary(max_size=300)), st.one_of(st.binary(max_size=40), NUMBERS.map(
    lambda n: f"CPU Power Socket {n}".encode())))
def test_grace_sensor_with_hostile_files_keeps_the_valid_one(value, name):
    errors: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry, oem, reading in (("hwmon0", b"CPU Power Socket 0\n", b"123000000\n"),
                                    ("hwmon1", b"Module Power Socket 0\n", value),
                                    ("hwmon2", name, b"5\n")):
            (Path(tmp) / entry / "device").mkdir(parents=True)
            (Path(tmp) / entry / "device" / "power1_oem_info").write_bytes(oem)
            (Path(tmp) / entry / "device" / "power1_average").write_bytes(reading)
        sensors = GraceHwmon(tmp, FakeClock().monotonic, errors).read()
    assert sensors is not None and any(s.sensor == "cpu" and s.socket == "0" and s.watts == 123 for s in sensors)
    assert all(math.isfinite(s.watts) and 0 <= s.watts <= 100_000 for s in sensors)


# -- YAML (the config file, the web config), traces ---------------------------------------------------------

@FAST
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
@example(b"a: &x [1]\nb: *y\n")
@example(b"{a: 1, a: 2}")
@example(b"\xff\xfe")
@example(b"[" * 1000)
@example(b"- " * 5000)
@example(b"a: &a [*a]\n")  # a list that holds itself
def test_yaml_is_a_document_or_a_config_error(raw):
    try:
        parse_yaml(raw, "config file x")
    except ConfigError as exc:
        assert str(exc).startswith("config file x")


def _laughs() -> str:
    """A "billion laughs": ten levels of aliases, each ten of the one before (10**9 values expanded)."""
    levels = ["&l0 [" + ", ".join(["lol"] * 10) + "]"]
    levels += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 10)]
    return "[" + ", ".join(levels) + "]"


@pytest.mark.parametrize("template", ["poll: {{interval: {0}}}\n", "rules: {{gpu_hot: {0}}}\n",
                                      "log: {{level: {0}}}\n", "tls_server_config: {0}\n",
                                      "basic_auth_users: {{alice: {0}}}\n", "http_server_config: {{headers: {0}}}\n"])
def test_configs_with_a_billion_laughs_fail_quickly(tmp_path, template):
    from gpuwatch import config
    from gpuwatch.web import config as web_config

    path = tmp_path / "c.yml"
    path.write_text(template.format(_laughs()))
    started = time.perf_counter()
    for load in (lambda p: config.load(environ={"GPUWATCH_CONFIG": str(p)}), web_config.load):
        with pytest.raises(ConfigError) as caught:
            load(path)
        assert len(str(caught.value)) < 2000
    assert time.perf_counter() - started < 5


@FEW
@given(st.binary(max_size=2000), st.booleans())
def test_trace_of_random_bytes_is_a_trace_or_a_format_error(raw, with_header):
    from gpuwatch.errors import ReplayFormatError
    from gpuwatch.trace import read_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        header = _trace_header() if with_header else b""
        path.write_bytes(header + raw)
        try:
            trace = read_trace(path)
        except ReplayFormatError:
            return
    assert all(math.isfinite(r.t) for r in trace.records)


def _trace_header() -> bytes:
    return (b'{"type": "header", "format": "gpuwatch-trace", "version": 1, "created": 0, "backend": "sim", '
            b'"fast_interval": 1, "slow_interval": 10}\n')


@pytest.mark.parametrize("line", [b"[" * 100_000 + b"\n", b'{"t": ' + b"9" * 5000 + b"}\n", b'{"t": NaN}\n',
                                  b'{"t": 1e999, "type": "sample"}\n', b"\xff\xfe\n", b"x" * 100_000])
def test_trace_with_a_hostile_line_is_a_format_error(tmp_path, line):
    from gpuwatch.errors import ReplayFormatError
    from gpuwatch.trace import read_trace

    (tmp_path / "t.jsonl").write_bytes(_trace_header() + line)
    try:
        read_trace(tmp_path / "t.jsonl")
    except ReplayFormatError:
        pass


# -- end to end: the devices.list ----------------------------------------------------------------------

def test_a_hostile_devices_list_costs_its_lines_not_the_nodes_allocations(tmp_path, capsys):
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    proc_stat(proc)
    fake_process(proc, 100, user=1.0)
    slurm_v1_job(root, 41, 1000, [100], [0])
    slurm_v1_job(root, 42, 1001, [], [1, 2])
    slurm_v1_job(root, 43, 1001, [], [3])
    listing = root / "devices" / "slurm" / "uid_1001" / "job_42" / "devices.list"
    listing.write_bytes(listing.read_bytes() + b"c 195:" + HUGE.encode() + b" rwm\n\xff\xfe\x00garbage\nc 195:-1 rwm\n")
    options = {"slurm.scontrol": "", "slurm.node-name": "gpu07"}
    reader = HostReader(Selection.of({"slurm", "jobs"}, options), str(proc), str(root))
    gpus = [GpuState(identity(i, minor_number=i), {}, True) for i in range(4)]
    for _ in range(3):
        sample = reader(gpus)
        assert sorted((a.job_id, a.uuid) for a in sample.slurm) == sorted(
            [("41", identity(0).uuid), ("42", identity(1).uuid), ("42", identity(2).uuid), ("43", identity(3).uuid)])
        assert ("slurm", "internal") not in sample.errors and ("slurm", "malformed_input") in sample.errors
        assert [name for name, _, _ in sample.collected] == ["slurm", "jobs"]
        assert sample.slurm_complete
    warnings = [line for line in capsys.readouterr().err.splitlines() if "host_input_skipped" in line]
    assert len(warnings) == 1 and str(listing) in warnings[0] and "3 malformed" in warnings[0]


def test_malformed_warns_once_per_source_per_hour_and_counts_every_time():
    clock = FakeClock()
    errors: list[tuple[str, str]] = []
    lines: list[tuple[str, dict]] = []

    class Log:
        def warning(self, event, **context):
            lines.append((event, context))

    report = Malformed("slurm", errors, Log(), clock.monotonic)
    for _ in range(5):
        report("/a/devices.list", "bad")
        report("/b/devices.list", "bad")
    assert errors == [("slurm", "malformed_input")] * 10
    assert [c["source"] for _, c in lines] == ["/a/devices.list", "/b/devices.list"]
    clock.advance(3600)
    report.flush()
    assert [c.get("repeated") for _, c in lines[2:]] == [4, 4]


# -- HTTP requests -------------------------------------------------------------------------------------------

@FAST
@given(st.one_of(st.text(max_size=200), st.builds(lambda t: "Basic " + t, st.text(max_size=200)),
                 st.binary(max_size=200).map(lambda b: "Basic " + __import__("base64").b64encode(b).decode())))
def test_basic_auth_header_is_credentials_or_none(header):
    from gpuwatch.web.auth import parse_basic

    credentials = parse_basic(header)
    assert credentials is None or all(isinstance(part, str) for part in credentials)


@FAST
@given(st.one_of(st.text(max_size=300), LONG))
def test_accept_header_picks_a_known_content_type(accept):
    from gpuwatch.exporter import Exposition

    assert Exposition.content_type(accept).startswith(("text/plain", "application/openmetrics-text"))


# -- the configuration's values ------------------------------------------------------------------------------

# what os.environ and argv hold for bytes that are not UTF-8: lone surrogates (os.fsdecode)
ENVIRON_BYTES = st.binary(max_size=80).filter(lambda b: b"\x00" not in b).map(os.fsdecode)
# the options whose text reaches a label or an HTTP answer: it must be text a body can carry
SHOWN = ("node_rack", "node_row", "node_room", "node_pdu", "telemetry_path")


@FAST
@given(st.data(), st.one_of(NUMBERS, st.text(max_size=80).filter(lambda s: "\x00" not in s), LONG, ENVIRON_BYTES))
def test_every_option_takes_any_text_as_a_value_or_a_config_error(data, value):
    from gpuwatch import config

    option = data.draw(st.sampled_from([o for o in config.ALL_OPTIONS if o.field != "config"]))
    try:
        loaded = config.load(environ={option.env: value})
    except ConfigError as exc:
        assert len(str(exc)) < 200_000
    else:
        for field in SHOWN:
            getattr(loaded, field).encode("utf-8")  # a lone surrogate here failed every scrape


# -- /proc for the jobs group --------------------------------------------------------------------------------

STAT_FIELDS = st.lists(st.one_of(NUMBERS, st.integers(-10, 10**6).map(str)), max_size=50)


@FEW
@given(st.one_of(STAT_FIELDS.map(lambda f: "101 (x) S " + " ".join(f)), st.binary(max_size=200).map(
    lambda b: b.decode(errors="replace")), st.just("")), st.one_of(SINGLE, NUMBERS.map("read_bytes: {}\n".format)))
def test_a_process_with_a_hostile_proc_stat_costs_only_itself(stat, io):
    from fakehost import slurm_v2_job

    from gpuwatch.hostside.jobs import JobsReader

    errors: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, root = Path(tmp) / "proc", Path(tmp) / "cgroup"
        proc_stat(proc)
        fake_process(proc, 100, user=2.0, system=1.0)
        fake_process(proc, 101)
        (proc / "101" / "stat").write_text(stat)
        (proc / "101" / "io").write_text(io)
        slurm_v2_job(root, 42, [100, 101])
        clock = FakeClock()
        usage = JobsReader(str(proc), clock.monotonic, 8.0, errors).read(cgroups.scan(root))
    assert [u.job_id for u in usage] == ["42"]
    user, system, iowait = usage[0].cpu_seconds
    assert user >= 2.0 and system >= 1.0
    assert all(math.isfinite(v) and v >= 0 for v in (user, system, iowait or 0.0))
    assert set(errors) <= {("jobs", "malformed_input")}


@pytest.fixture(scope="module")
def http_node():
    from gpuwatch.store import Store
    from gpuwatch.testing import ScriptedBackend, registry_for
    from gpuwatch.web import App, HttpServers

    clock = FakeClock()
    store = Store(clock, ScriptedBackend(1).name)
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics", lambda tier: 6.0)
    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    yield servers.servers[0].server_address[:2]
    servers.close()


def _ask(address, raw: bytes) -> bytes:
    import socket

    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(raw)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


@FEW
@given(st.one_of(st.binary(max_size=300).filter(lambda b: b"\n" not in b),
                 st.builds(lambda m, p: m + b" " + p + b" HTTP/1.1", st.binary(min_size=1, max_size=20).filter(
                     lambda b: not any(c in b for c in b" \r\n")), st.binary(min_size=1, max_size=200).filter(
                     lambda b: not any(c in b for c in b" \r\n"))),
                 st.builds(lambda h: b"GET /metrics HTTP/1.1\r\n" + h, st.binary(max_size=300).filter(
                     lambda b: b"\r\n\r\n" not in b and b"\n\n" not in b and b"ength" not in b.lower()))))
def test_any_request_gets_an_http_answer_and_the_server_goes_on(http_node, request_bytes):
    answer = _ask(http_node, request_bytes + b"\r\n\r\n")
    assert answer == b"" or re.match(rb"HTTP/1\.[01] [1-5][0-9][0-9] ", answer), answer[:80]
    assert _ask(http_node, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.")


YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(), st.text(max_size=30), NUMBERS),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(
                                ["poll", "interval", "tls_server_config", "cert_file", "basic_auth_users", "headers",
                                 "http_server_config", "http2", "log", "level", "rules", "collector", "slurm",
                                 "Strict-Transport-Security", "client_auth_type", "min_version"]),
                                st.text(max_size=10), st.integers()), inner, max_size=4)),
    max_leaves=20)


@FAST
@given(YAML_VALUES)
def test_config_documents_of_any_shape_are_a_config_or_a_config_error(data):
    import yaml

    from gpuwatch import config
    from gpuwatch.web import config as web_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yml"
        path.write_text(yaml.safe_dump(data))
        for load in (lambda p: config.load(environ={"GPUWATCH_CONFIG": str(p)}), web_config.load):
            try:
                load(path)
            except ConfigError:
                pass


# -- /proc/PID/io: a bad one costs that process's I/O, never its CPU times ----------------------------------

PROC_IO = "rchar: 0\nwchar: 0\nsyscr: 0\nsyscw: 0\nread_bytes: {}\nwrite_bytes: 20\ncancelled_write_bytes: 0\n"


def _job_with_io(tmp: Path, io: bytes | None, fifo: bool = False):
    """Job 42: process 100 (2 s user, 1 s system, 7 and 3 bytes) and 101 (50 s, 10 s) whose /proc/101/io is
    ``io``; (its JobUsage, the errors, the io file's path)."""
    import os

    from fakehost import slurm_v2_job

    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp / "proc", tmp / "cgroup"
    proc_stat(proc)
    fake_process(proc, 100, user=2.0, system=1.0, read_bytes=7, write_bytes=3)
    fake_process(proc, 101, user=50.0, system=10.0)
    path = proc / "101" / "io"
    if fifo:
        path.unlink()
        os.mkfifo(path)
    elif io is not None:
        path.write_bytes(io)
    slurm_v2_job(root, 42, [100, 101])
    errors: list[tuple[str, str]] = []
    (usage,) = JobsReader(str(proc), FakeClock().monotonic, 8.0, errors).read(cgroups.scan(root))
    return usage, errors, path


def test_a_valid_proc_pid_io_is_read_as_psutil_read_it(tmp_path, capsys):
    usage, errors, _ = _job_with_io(tmp_path, PROC_IO.format(1000).encode())
    assert (usage.cpu_seconds, usage.read_bytes, usage.write_bytes, usage.processes) == ((52.0, 11.0, 0.0), 1007, 23, 2)
    assert errors == [] and "host_input_skipped" not in capsys.readouterr().err


@pytest.mark.parametrize("io", [
    b"read_bytes: nan\n",  # psutil's int() raised ValueError: the whole process was dropped, /proc/101/stat blamed
    PROC_IO.format("nan").encode(), PROC_IO.format(HUGE).encode(), PROC_IO.format("1" + "0" * 4400).encode(),
    PROC_IO.format("1_000").encode(),  # psutil's int() took it as 1000
    PROC_IO.format("\u0663").encode(), PROC_IO.format("\uff11").encode(), PROC_IO.format("1\u00a0").encode(),
    PROC_IO.format("+5").encode(), PROC_IO.format("-1").encode(), PROC_IO.format("0x10").encode(),
    PROC_IO.format("1.5").encode(), PROC_IO.format("").encode(), PROC_IO.format("18446744073709551616").encode(),
    PROC_IO.format(5) + "read_bytes: 6\n",  # twice: which one?
    b"rchar: 0\nread_bytes: 5\n",  # no write_bytes
    b"\xff\xfe garbage\x00\n",
], ids=["nan-alone", "nan", "5000-digits", "4401-digits", "underscore", "arabic-indic", "fullwidth", "nbsp", "plus",
        "negative", "hex", "fraction", "empty", "2**64", "twice", "no-write_bytes", "garbage"])
def test_a_hostile_proc_pid_io_costs_that_process_s_io_only(tmp_path, capsys, io):
    usage, errors, path = _job_with_io(tmp_path, io if isinstance(io, bytes) else io.encode())
    assert usage.cpu_seconds == (52.0, 11.0, 0.0) and usage.processes == 2  # 101's valid stat is kept
    assert (usage.read_bytes, usage.write_bytes) == (None, None)  # one process's I/O unknown: the job's is
    assert errors == [("jobs", "malformed_input")]
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "host_input_skipped" in line]
    assert str(path) in warning and "/101/stat" not in warning


@pytest.mark.timeout(30)
def test_a_fifo_where_proc_pid_io_should_be_is_not_read(tmp_path, capsys):
    """Bounded: the read runs in a thread; a FIFO still blocking it after 10 s is unblocked and the test fails."""
    import os
    import threading

    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(_job_with_io(tmp_path, None, fifo=True)), daemon=True)
    reader.start()
    reader.join(10)
    blocked = reader.is_alive()
    while reader.is_alive():
        try:
            os.close(os.open(tmp_path / "proc" / "101" / "io", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        reader.join(0.1)
    assert not blocked, "JobsReader.read() blocked on a FIFO"
    ((usage, errors, path),) = result
    assert usage.cpu_seconds == (52.0, 11.0, 0.0) and usage.read_bytes is None
    assert errors == [("jobs", "malformed_input")]
    assert str(path) in capsys.readouterr().err


@FEW
@given(hostile_line("read_bytes: {}"), st.booleans())
def test_any_proc_pid_io_keeps_the_process_s_cpu_times(line, keep_others):
    io = PROC_IO.replace("read_bytes: {}\n", line + "\n") if keep_others else line
    with tempfile.TemporaryDirectory() as tmp:
        usage, errors, _ = _job_with_io(Path(tmp), io.encode())
    assert usage.cpu_seconds == (52.0, 11.0, 0.0) and usage.processes == 2
    assert usage.read_bytes is None or usage.read_bytes == 7 + int(line.removeprefix("read_bytes: "))
    assert set(errors) <= {("jobs", "malformed_input")}
