"""Slurm allocations: which job holds which GPU on this node (the slurm group, gpuwatch/groups/slurm.py).

Per job of the cgroup scan, the first source that can tell: cgroup v1's devices.list (GPU minor
numbers), then ``scontrol show job --details --oneliner <id>`` (this node's ``GRES=…(IDX:…)``),
then the prolog-written mapping directory. scontrol runs with a timeout, without a shell, and is
asked once per job (an allocation does not change while the job runs); after a failure it is not
run again for ``scontrol-backoff`` seconds (a hung slurmctld costs one timeout per backoff, not
one per job). Each kind of failure is logged once and counted, until scontrol answers again. An
answer that is bad for one job (unparsable, or without a part on this node) is that job's problem,
not scontrol's: only that job waits the backoff before it is asked again, the other jobs are asked
as usual, and it is counted at each try and logged at most once per job per hour.
"""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gpuwatch import scontrol
from gpuwatch.attribution import user_name
from gpuwatch.groups.slurm import JobAllocation
from gpuwatch.hostside.cgroups import MAX_ID, JobCgroup, Scan
from gpuwatch.hostside.hostile import SPACE, WARN_EVERY, Malformed, natural, read_regular, shown, words
from gpuwatch.hostside.hostile import lines as hostile_lines
from gpuwatch.logs import Repeats, get_logger
from gpuwatch.model import GpuState
from gpuwatch.scontrol import ScontrolError

# no ":" inside a field: "(?::[^(,]*)*" backtracked exponentially over "gpu::::…" (30 colons: a minute)
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^(,:]*)*\(IDX:([0-9,\-]+)\)")
_MIG_TYPE = re.compile(r":\d+g\.\d+gb", re.IGNORECASE)  # gpu:1g.10gb:2(IDX:0-1): MIG devices, not GPUs
_USER = re.compile(r"^([^()]*)\((\d+)\)$")


_MAX_MAPPING_FILES = 4096  # files looked at in the mapping directory: a runaway one costs no more
_MAX_INDEX = 1024  # GRES indices beyond this are not GPUs of one node
_MAX_BRACKETS = 8  # bracket groups in one hostlist part ("rack[1-2]-n[01-40]" has 2)


_PART = re.compile(r"(?:[^\[\],]|\[[^\[\]]*\])+")  # a hostlist part: text and whole "[...]" groups


def _top_level(text: str) -> list[str]:
    """The comma-separated parts of a hostlist, commas inside brackets kept; a stray bracket separates
    parts like a comma (an unclosed "[" used to swallow every part after it)."""
    return _PART.findall(text)


_MAX_HOST_NUMBER = 10**18  # a number in a host name: more digits are not a node of this cluster


def _in_ranges(digits: str, ranges: str) -> bool:
    number = natural(digits, _MAX_HOST_NUMBER)
    if number is None:
        return False
    for item in ranges.split(","):
        lo_text, sep, hi_text = item.partition("-")
        lo, hi = natural(lo_text, _MAX_HOST_NUMBER), natural(hi_text, _MAX_HOST_NUMBER) if sep else None
        if lo is None or (sep and hi is None):
            continue
        padded = lo_text.startswith("0")
        width_ok = len(digits) == len(lo_text) if padded else not digits.startswith("0") or digits == "0"
        if width_ok and lo <= number <= (hi if hi is not None else lo):
            return True
    return False


def hostlist_contains(text: str, node: str) -> bool:
    """Whether Slurm's hostlist ``text`` ("gpu[01-03,07],rack[1-2]-n[01-40]") names ``node``,
    without expanding it (a hostlist of a million nodes costs what its text costs)."""
    for part in _top_level(text):
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, ranges, literal, ranges, ..., literal
        pattern = "".join(re.escape(p) if i % 2 == 0 else r"([0-9]+)" for i, p in enumerate(pieces))
        if len(pieces) > 2 * _MAX_BRACKETS + 1 or len(pattern) > len(node) * 8 + 64:
            continue  # more bracket groups or text than this node's name could ever match
        match = re.fullmatch(pattern, node)
        if match and all(_in_ranges(digits, pieces[2 * k + 1]) for k, digits in enumerate(match.groups())):
            return True
    return False


def _indices(text: str) -> list[int]:
    found: set[int] = set()
    for item in text.split(","):
        lo_text, sep, hi_text = item.partition("-")
        lo, hi = natural(lo_text, _MAX_INDEX - 1), natural(hi_text, MAX_ID) if sep else None
        if lo is not None and (not sep or hi is not None):
            found.update(range(lo, min(hi if hi is not None else lo, _MAX_INDEX - 1) + 1))
    return sorted(found)


class Answer(NamedTuple):
    """What scontrol says of one job on this node."""

    user: str
    indices: tuple[int, ...]  # GRES GPU indices on this node
    on_node: bool  # this node is in one of the job's per-node parts
    mig: bool = False  # GPUs given as MIG GRES (gpu:1g.10gb...): their indices are not GPUs


def parse_scontrol_job(text: str, node: str) -> Answer | None:
    """This node's part of ``scontrol show job --details --oneliner``; None when the output is not
    one job's record. Only the per-node parts (``Nodes=… CPU_IDs=… Mem=… GRES=…``) between
    ``NodeList=`` and ``MinCPUsNode=`` count: free-text fields a user sets (JobName, Comment, the
    command) are outside that region, so "Nodes=… GRES=…" in a job name changes nothing."""
    user = ""
    indices: list[int] = []
    current = False
    on_node = mig = seen_job = False
    region = False
    for token in words(text):  # at ASCII whitespace: "Nodes=x\x1fGRES=..." is one token, not two
        key, sep, value = token.partition("=")
        if not sep:
            continue
        if key == "JobId" and not seen_job:
            seen_job = True
        elif key == "UserId" and not user:
            match = _USER.match(value)
            user = match.group(1) if match else value
        elif key == "NodeList":
            region = True
        elif key == "MinCPUsNode":
            region = False
        elif region and key == "Nodes":
            current = hostlist_contains(value, node)
            on_node = on_node or current
        elif region and current and key in ("GRES", "Gres"):
            for match in _GRES_GPU.finditer(value):
                mig = mig or bool(_MIG_TYPE.search(match.group(0)))
                indices.extend(_indices(match.group(1)))
    if not seen_job:
        return None
    return Answer(user, tuple(sorted(set(indices))), on_node, mig)


class Scontrol:
    """Runs ``scontrol show job --details --oneliner <id>``: with a timeout, no shell, C locale."""

    def __init__(self, command: str, timeout: float, backoff: float, monotonic: Callable[[], float],
                 errors: list[tuple[str, str]]) -> None:
        self._command = command
        self._timeout = timeout
        self._backoff = backoff
        self._monotonic = monotonic
        self._errors = errors  # the reader's list for this read: (group, error)
        self._path: str | None = None
        self._resume_at = float("-inf")
        self._failing: str | None = None
        self._noted: set[str] = set()
        self._log = get_logger(component="slurm")
        # one job's bad answer: one warning per (kind, job) per hour at most, then a summary line
        self._bad_answers = Repeats(self._log, burst=1, interval=max(backoff, WARN_EVERY), monotonic=monotonic)

    def _resolve(self) -> str | None:
        if not self._command:
            return None
        if self._path is None:
            self._path = shutil.which(self._command)
            if self._path is None:
                self.fail("scontrol_missing", f"{self._command!r} is not on PATH",
                           "install the Slurm client or set --collector.slurm.scontrol to its path "
                           "(an empty value turns scontrol off)")
        return self._path

    def show_job(self, job_id: str) -> str | None:
        """The one-line record; "" when Slurm does not know the job (it ended); None on a failure
        (counted, logged once, then no call until the backoff has passed)."""
        path = self._resolve()
        if path is None or self._monotonic() < self._resume_at:
            return None
        try:
            answer = scontrol.run(path, ["show", "job", "--details", "--oneliner", job_id], self._timeout)
        except ScontrolError as exc:
            if exc.kind == scontrol.TIMEOUT:
                self.fail("scontrol_timeout", f"scontrol show job {job_id} took more than {self._timeout:g} s",
                          "slurmctld is slow or unreachable; gpuwatch asks again after the backoff")
            elif exc.kind == scontrol.EXITED:
                if "Invalid job id" in exc.said:  # the job ended between the scan and the call: not a failure
                    return ""
                self.fail("scontrol_failed", f"scontrol show job {job_id} exited with {exc.code}: {exc.said[:200]}",
                          "check that this node may talk to slurmctld (scontrol ping)")
            else:  # gone since it was found on PATH, or not runnable: looked up again next time
                self._path = None
                self.fail("scontrol_failed", f"cannot run {path}: {exc}" if exc.kind == scontrol.MISSING else str(exc),
                          "check --collector.slurm.scontrol")
            return None
        if self._failing is not None:
            self._log.info("scontrol_recovered", failed=self._failing)
            self._failing = None
        return answer

    def note(self, error: str, message: str, hint: str) -> None:
        """A problem with one answer, not with scontrol: counted, logged once per kind, no backoff."""
        self._errors.append(("slurm", error))
        if error not in self._noted:
            self._noted.add(error)
            self._log.warning(error, error_detail=message, hint=hint)

    def reject(self, job_id: str, error: str, message: str, hint: str) -> None:
        """An answer that is bad for one job, not a failure of scontrol: counted, logged at most once per
        (kind, job) per hour, and no backoff: the other jobs are asked as usual (the caller has this one wait)."""
        self._errors.append(("slurm", error))
        self._bad_answers.log("warning", error, (error, job_id), job_id=job_id, error_detail=message, hint=hint,
                              retry_in_seconds=self._backoff)

    def flush(self) -> None:
        """Summaries of the bad answers whose hour is over; their keys are forgotten (a job goes)."""
        self._bad_answers.flush()

    def fail(self, error: str, message: str, hint: str) -> None:
        self._errors.append(("slurm", error))
        self._resume_at = self._monotonic() + self._backoff
        if self._failing != error:
            self._failing = error
            self._log.warning(error, error_detail=message, hint=hint, retry_in_seconds=self._backoff)


# a GPU index or index.instance, each spelled as dcgm-exporter writes it: "0", "12", "3.2"; not "00" or "0.03",
# which would be another file of the same key (the last one listed would win)
_MAPPING_NAME = re.compile(r"(0|[1-9][0-9]{0,3})(?:\.(0|[1-9][0-9]{0,3}))?", re.ASCII)
_NUMERIC_NAME = re.compile(r"[0-9]{1,4}(?:\.[0-9]{1,4})?", re.ASCII)  # looks like one, spelled otherwise
# 42, an array task's 42_7, a het job's 42+1: one printable ASCII word, not too long for a label value
_JOB_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.+\-]{0,63}", re.ASCII)


def read_mapping_dir(directory: Path, report: Callable[[str, str], None] | None = None,
                     ) -> dict[tuple[int, int | None], list[str]]:
    """dcgm-exporter's job-mapping directory: a file per GPU index (``0``) or MIG instance
    (``0.3``), a job id per line ("0" or empty: no job). Missing or unreadable: nothing. A line that
    is no job id (garbage, binary, a 5000-digit number, a control character) is skipped, ``report(file,
    reason)`` told; so is a file named like an index but not in its one spelling ("00", "0.03")."""
    found: dict[tuple[int, int | None], list[str]] = {}
    try:
        entries = list(directory.iterdir())[:_MAX_MAPPING_FILES]
    except OSError:
        return found
    for entry in entries:
        match = _MAPPING_NAME.fullmatch(entry.name)
        if not match:
            if report is not None and _NUMERIC_NAME.fullmatch(entry.name):
                report(str(entry), "not a GPU index as dcgm-exporter writes it (a leading zero): the file is skipped")
            continue
        try:
            text = read_regular(entry, 1 << 20).decode(errors="replace")  # 1 MiB: a job id per line; no FIFO
        except OSError:
            continue
        # "\n" ends a line and only ASCII whitespace is stripped: splitlines() and strip() would make "42\x1f"
        # or "42\u3000" job 42, and "42\x1e43" two jobs
        lines = [line.strip(SPACE) for line in hostile_lines(text) if line.strip(SPACE)]
        jobs = [line for line in lines if line != "0" and _JOB_ID.fullmatch(line)]
        bad = [line for line in lines if not _JOB_ID.fullmatch(line)]
        if bad and report is not None:
            report(str(entry), f"{len(bad)} line(s) that are no job id skipped, the first: {shown(bad[0])}")
        if jobs:
            key = (int(match.group(1)), None if match.group(2) is None else int(match.group(2)))
            found[key] = jobs
    return found


class SlurmAllocations:
    """The slurm group's reader: allocations of this node's jobs, cached per job id."""

    def __init__(self, options: dict[str, Any], mapping_dir: str | None, monotonic: Callable[[], float],
                 errors: list[tuple[str, str]], user_name: Callable[[int], str] = user_name) -> None:
        self._node = str(options.get("node-name") or "") or socket.gethostname().split(".")[0]
        timeout = float(options.get("scontrol-timeout", 5))
        self._backoff = float(options.get("scontrol-backoff", 60))
        self._scontrol = Scontrol(str(options.get("scontrol", "scontrol")), timeout, self._backoff, monotonic, errors)
        self._budget = 2 * timeout  # scontrol time per read at most: later jobs wait for the next read
        self._monotonic = monotonic
        self._mapping = None if mapping_dir is None else Path(mapping_dir)
        self._user_name = user_name
        self._cache: dict[str, Answer] = {}  # job id -> what scontrol said, for the job's life
        self._retry: dict[str, float] = {}  # job id -> when to ask again, after a bad answer for that job
        self._node_known = False  # a job's answer had a part on this node: node-name is right
        self._malformed = Malformed("slurm", errors)

    def read(self, found: Scan, gpus: Sequence[GpuState]) -> tuple[tuple[JobAllocation, ...], bool] | None:
        """(allocations, complete) — complete: every job of the node was resolved, so a GPU without an
        allocation is free; None where gpuwatch sees no Slurm at all. ``gpus``: every GPU discovered
        since start (a lost one keeps its place in the GRES order)."""
        if not found.slurm_hierarchy and self._mapping is None:
            return None  # no Slurm here that gpuwatch can see: absent, not "free"
        self._malformed.flush()
        self._scontrol.flush()
        by_minor = {g.identity.minor_number: g.identity.uuid for g in gpus if g.identity.minor_number is not None}
        by_gres = [g.identity.uuid for g in sorted(gpus, key=_gres_order)]
        by_index = {g.identity.index: g.identity.uuid for g in gpus}
        allocations: list[JobAllocation] = []
        resolved: set[str] = set()
        live = []
        deadline = self._monotonic() + self._budget
        # Jobs never asked first, then those that answered badly, the longest waiting first. A bad answer holds
        # back only its job; while no job has been found on this node (a wrong node-name answers every job
        # so), at most one of them is asked again a read: one call a backoff, not one per job.
        retried = self._retry
        again = 0 if self._node_known else 1
        for job in sorted((j for j in found.jobs if j.scheduler == "slurm"),
                          key=lambda j: retried.get(j.job_id, -1.0)):
            live.append(job.job_id)
            user = self._user_name(job.uid) if job.uid is not None else ""
            minors = job.devices(self._malformed)
            if minors is not None:
                allocations.extend(JobAllocation(by_minor[m], job.job_id, user, "devices") for m in minors
                                   if m in by_minor)
                resolved.add(job.job_id)
                continue
            answer = self._cache.get(job.job_id)
            now = self._monotonic()
            due = job.job_id not in retried or now >= retried[job.job_id]
            if answer is None and now < deadline and due and (again or job.job_id not in retried
                                                              or self._node_known):
                if job.job_id in retried and not self._node_known:
                    again -= 1
                answer = self._ask(job)
            if answer is not None and not answer.mig:
                allocations.extend(JobAllocation(by_gres[i], job.job_id, user or answer.user, "scontrol")
                                   for i in answer.indices if i < len(by_gres))
                resolved.add(job.job_id)
        live_set = set(live)
        for gone in [j for j in self._cache if j not in live_set]:
            del self._cache[gone]
        for gone in [j for j in self._retry if j not in live_set]:
            del self._retry[gone]
        if self._mapping is not None:
            mapped = read_mapping_dir(self._mapping, self._malformed)
            for (index, _instance), jobs in sorted(mapped.items(), key=_mapping_order):
                uuid = by_index.get(index)
                for job_id in jobs:
                    if uuid is not None and job_id not in resolved:
                        allocations.append(JobAllocation(uuid, job_id, "", "mapping"))
            resolved.update(a.job_id for a in allocations)
        # one per (GPU, job): the MIG files of one GPU say it again
        return tuple(dict.fromkeys(allocations)), all(j in resolved for j in live)

    def _ask(self, job: JobCgroup) -> Answer | None:
        text = self._scontrol.show_job(job.job_id)
        if text is None:
            return None
        if text == "":  # "Invalid job id": the job ended, its cgroup is left over
            answer: Answer | None = Answer("", (), True)
        else:
            answer = parse_scontrol_job(text, self._node)
        # an answer bad for this job stays with it: it waits the backoff, the other jobs are asked on
        if answer is None:
            self._retry[job.job_id] = self._monotonic() + self._backoff
            self._scontrol.reject(job.job_id, "scontrol_unparsable", f"unexpected output of scontrol show job "
                                  f"{job.job_id}: {shown(text.strip(SPACE))}",
                                  "please report it with your Slurm version")
            return None
        if not answer.on_node:
            self._retry[job.job_id] = self._monotonic() + self._backoff
            self._scontrol.reject(job.job_id, "scontrol_node_unknown", f"job {job.job_id} has no part on node "
                                  f"{self._node!r} in scontrol's answer", "set --collector.slurm.node-name to this "
                                  "node's Slurm NodeName (slurmd -C prints it)")
            return None
        if text:  # a record with a part on this node ("Invalid job id" proves nothing): node-name is right
            self._node_known = True
        self._retry.pop(job.job_id, None)
        if answer.mig:
            self._scontrol.note("scontrol_mig_gres", f"job {job.job_id} holds MIG devices as GRES: their "
                                "indices are not GPUs", "use the mapping directory for MIG jobs (docs/slurm.md)")
        self._cache[job.job_id] = answer
        return answer


def _gres_order(state: GpuState) -> tuple[int, int]:
    """Slurm's GRES index order: gres.conf's File=/dev/nvidia[0-N] and AutoDetect list GPUs by minor number."""
    ident = state.identity
    return (ident.minor_number if ident.minor_number is not None else ident.index, ident.index)


def _mapping_order(item: tuple[tuple[int, int | None], list[str]]) -> tuple[int, int]:
    (index, instance), _ = item
    return index, -1 if instance is None else instance

