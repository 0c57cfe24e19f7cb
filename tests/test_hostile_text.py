"""Host text split as the kernel writes it (ASCII whitespace, newlines), and directory names read whole.

``str.split()`` and ``str.splitlines()`` also split at \\x1c-\\x1f, \\x85 and Unicode spaces and line separators,
and ``re.search`` with ``$`` finds a job id at the end of any name (or before a trailing newline): each made
hostile text count as valid (tests/test_hostile_input.py has the property tests of the same parsers).
"""

from __future__ import annotations

import string
from pathlib import Path

from fakehost import slurm_v2_job
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.hostside import cgroups
from gpuwatch.hostside.cgroups import JobCgroup, parse_devices_list
from gpuwatch.hostside.hostile import SPACE, lines, words

# what str.split()/splitlines() take for a separator and the kernel never writes
UNICODE_BREAKS = "\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2003\u2028\u2029\u202f\u3000"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list(SPACE + UNICODE_BREAKS) + list("ab1:*")), max_size=40))
def test_words_split_at_ascii_whitespace_only(text):
    found = words(text)
    assert all(w and not set(w) & set(SPACE) for w in found)
    assert "".join(found) == "".join(c for c in text if c not in SPACE)
    assert lines(text) == text.split("\n")


def test_a_devices_list_line_with_unicode_spaces_or_separators_is_bad():
    hostile = ["c\u3000195:3\xa0rwm", "c\x1c195:4\x1crwm", "c 195:5 rwm\x85c 195:6 rwm", "c 195:7 rwm\u2028a *:* rwm"]
    bad: list[str] = []
    minors = parse_devices_list("\n".join(["c 195:0 rwm", *hostile, "c\t195:2  rwm\r"]), bad)
    assert minors == (0, 2)  # "a *:* rwm" after U+2028 does not open every device
    assert bad == hostile


def test_cgroup_procs_entries_joined_by_unicode_spaces_are_bad_the_others_kept(tmp_path):
    (tmp_path / "cgroup.procs").write_text("100\n1\x1f200\n300\u2003400\n 500\t\n")
    reports: list[tuple[str, str]] = []
    pids, hidden = JobCgroup("slurm", "1", dirs={"": tmp_path}).pids(lambda s, r: reports.append((s, r)))
    assert pids == {100, 500} and hidden == 0
    assert reports == [(str(tmp_path / "cgroup.procs"), "2 entries that are no PID skipped")]


def test_cgroup_accounting_fields_joined_by_unicode_spaces_are_bad(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 9\nuser_usec\u2003100\nuser_usec 5000000\nsystem_usec 2000000\n")
    (tmp_path / "io.stat").write_text("8:0 rbytes=10\u3000wbytes=20\n8:16 rbytes=1000 wbytes=2000\n")
    reports: list[str] = []
    cpu, io = JobCgroup("slurm", "1", dirs={"": tmp_path}).accounting(lambda s, r: reports.append(s))
    assert cpu == (5.0, 2.0) and io == (1000, 2000)
    assert sorted(Path(s).name for s in reports) == ["cpu.stat", "io.stat"]


def test_only_whole_directory_names_are_jobs(tmp_path):
    """"job_evil_job_42" took the place of job_42's directory (its PIDs counted as job 42's)."""
    real = slurm_v2_job(tmp_path, 42, [100])
    for hostile in ("job_evil_job_42", "job_42\n", "job_1e3job_7", "xjob_9", "job_42 "):
        slurm_v2_job(tmp_path, 0, [666]).rename(real.parent / hostile)
    v1 = tmp_path / "freezer" / "slurm" / "uid_1000x" / "job_5"
    v1.mkdir(parents=True)
    found = cgroups.scan(tmp_path)
    assert [(j.job_id, j.dirs) for j in found.jobs] == [("5", {"freezer": str(v1)}), ("42", {"": str(real)})]
    assert found.jobs[0].uid is None  # "uid_1000x" names no user
    assert found.jobs[1].pids()[0] == {100}


def test_pod_directories_are_read_whole(tmp_path):
    uid = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
    other = "1" + uid[1:]
    systemd, cgroupfs = tmp_path / "systemd", tmp_path / "cgroupfs"
    root = systemd / "kubepods.slice"
    good = root / "kubepods-besteffort.slice" / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    good.mkdir(parents=True)
    for hostile in (f"kubepods-pod{other}.slice.bak", f"kubepods-evilpod{other}.slice"):
        (root / hostile).mkdir()
    plain = cgroupfs / "kubepods" / ("pod" + uid)
    plain.mkdir(parents=True)
    (cgroupfs / "kubepods" / f"xpod{other}").mkdir()
    (cgroupfs / "kubepods" / f"pod{other}.slice\n").mkdir()
    for tree, directory in ((systemd, good), (cgroupfs, plain)):
        assert [(j.job_id, j.dirs) for j in cgroups.scan(tree).jobs] == [(uid, {"": str(directory)})]


def test_the_printable_ascii_job_names_of_the_fakes_still_parse():
    # the kernel's own names: nothing above changes them
    assert words(" ".join(string.ascii_letters)) == list(string.ascii_letters)


def test_a_cpu_list_file_with_a_control_character_at_its_end_counts_nothing(tmp_path):
    """The file reader stripped with str.strip(), which takes \\x1c-\\x1f: "0\\x1f" read as the CPU list "0"."""
    (tmp_path / "cpuset.cpus.effective").write_text("0\x1f\n")
    reports: list[str] = []
    assert JobCgroup("slurm", "1", dirs={"": tmp_path}).cpus(lambda s, r: reports.append(s)) is None
    assert reports == [str(tmp_path / "cpuset.cpus.effective")]


def test_a_fifo_where_a_cgroup_file_is_is_not_read(tmp_path):
    import os

    os.mkfifo(tmp_path / "cgroup.procs")  # nobody writes it: a read would block for good
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cgroup.procs").write_text("7\n")
    assert JobCgroup("slurm", "1", dirs={"": tmp_path}).pids() == ({7}, 0)


def _stat_line(pid: int, name: str, utime: str, stime: str = "100", start: str = "5000", blkio: str = "0") -> str:
    fields = [str(pid), f"({name})", "S"] + ["0"] * 10 + [utime, stime] + ["0"] * 6 + [start] + ["0"] * 19 + [blkio]
    return " ".join(fields) + "\n"


def test_proc_pid_stat_numbers_are_read_as_the_kernel_writes_them(tmp_path):
    """psutil read /proc/PID/stat's times with float(): "1_000" ticks was 10 s, "١٠٠" 1 s. Now such a stat is
    the process skipped, one report naming the file; the job's other processes count; a command name with
    ") " and spaces in it does not shift the fields."""
    from fakehost import fake_process, proc_stat

    from gpuwatch.clock import FakeClock
    from gpuwatch.hostside.jobs import JobsReader

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc_stat(proc)
    fake_process(proc, 100, user=2.0, system=1.0)
    pids = [100]
    for pid, utime in ((101, "1_000"), (102, "\u0661\u0660\u0660"), (103, "100\u3000"), (104, "-5"), (105, "nan")):
        fake_process(proc, pid)
        (proc / str(pid) / "stat").write_text(_stat_line(pid, "x", utime))
        pids.append(pid)
    fake_process(proc, 106)
    (proc / "106" / "stat").write_text(_stat_line(106, "evil) 1 2 (x", "300", blkio="50"))
    pids.append(106)
    slurm_v2_job(root, 42, pids)
    from structlog.testing import capture_logs

    errors: list[tuple[str, str]] = []
    with capture_logs() as logs:
        usage = JobsReader(str(proc), FakeClock().monotonic, 8.0, errors).read(cgroups.scan(root))
    reports = [e["source"] for e in logs if e["event"] == "host_input_skipped"]
    ticks = __import__("os").sysconf("SC_CLK_TCK")
    assert [u.job_id for u in usage] == ["42"]
    user, system, iowait = usage[0].cpu_seconds
    assert (user, system) == (2.0 + 300 / ticks, 1.0 + 100 / ticks) and iowait == 50 / ticks
    assert sorted(reports) == [str(proc / str(pid) / "stat") for pid in (101, 102, 103, 104, 105)]
