"""Slurm allocations: which job holds which GPU on this node (the slurm group, gpuwatch/groups/slurm.py).

Per job of the cgroup scan, the first source that can tell: cgroup v1's devices.list (GPU minor
numbers), then ``scontrol show job --details --oneliner <id>`` (this node's ``GRES=…(IDX:…)``),
then the prolog-written mapping directory. scontrol runs with a timeout, without a shell, and is
asked once per job (an allocation does not change while the job runs); after a failure it is not
run again for ``scontrol-backoff`` seconds (a hung slurmctld costs one timeout per backoff, not
one per job). Each kind of failure is logged once and counted, until scontrol answers again.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuwatch.groups.slurm import JobAllocation
from gpuwatch.hostside.cgroups import JobCgroup, Scan
from gpuwatch.logs import get_logger
from gpuwatch.model import GpuState

_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^(,]*)*\(IDX:([0-9,\-]+)\)")
_USER = re.compile(r"^([^()]*)\((\d+)\)$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax: "gpu[01-03,07],login1" -> gpu01 gpu02 gpu03 gpu07 login1."""
    names: list[str] = []
    depth, start = 0, 0
    parts: list[str] = []
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for part in parts:
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            if part:
                names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, sep, hi = item.partition("-")
            if not sep:
                names.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) - int(lo) > 100_000:
                continue
            width = len(lo)
            names.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return names


def _indices(text: str) -> list[int]:
    found: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.partition("-")
        if lo.isdigit() and (not sep or hi.isdigit()):
            found.extend(range(int(lo), int(hi if sep else lo) + 1))
    return found


def parse_scontrol_job(text: str, node: str) -> tuple[str, list[int]] | None:
    """(user, GRES GPU indices on ``node``) from ``scontrol show job --details --oneliner``; None
    when the output is not one job's record. A job without GPUs on this node has no indices."""
    user = ""
    indices: list[int] = []
    current: list[str] = []
    seen_job = False
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep:
            continue
        if key == "JobId":
            seen_job = True
        elif key == "UserId":
            match = _USER.match(value)
            user = match.group(1) if match else value
        elif key == "Nodes":
            current = expand_hostlist(value)
        elif key in ("GRES", "Gres") and node in current:
            for match in _GRES_GPU.finditer(value):
                indices.extend(_indices(match.group(1)))
    return (user, sorted(set(indices))) if seen_job else None


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
        self._log = get_logger(component="slurm")

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

    def available(self) -> bool:
        return self._monotonic() >= self._resume_at and self._resolve() is not None

    def show_job(self, job_id: str) -> str | None:
        path = self._resolve()
        if path is None or self._monotonic() < self._resume_at:
            return None
        env = dict(os.environ, LC_ALL="C")
        try:
            done = subprocess.run([path, "show", "job", "--details", "--oneliner", job_id], capture_output=True,
                                  timeout=self._timeout, env=env, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            self.fail("scontrol_timeout", f"scontrol show job {job_id} took more than {self._timeout:g} s",
                       "slurmctld is slow or unreachable; gpuwatch asks again after the backoff")
            return None
        except OSError as exc:
            self._path = None
            self.fail("scontrol_failed", f"cannot run {path}: {exc}", "check --collector.slurm.scontrol")
            return None
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip()[:200]
            if "Invalid job id" in message:  # the job ended between the scan and the call: not a failure
                return None
            self.fail("scontrol_failed", f"scontrol show job {job_id} exited with {done.returncode}: {message}",
                       "check that this node may talk to slurmctld (scontrol ping)")
            return None
        if self._failing is not None:
            self._log.info("scontrol_recovered", failed=self._failing)
            self._failing = None
        return done.stdout.decode(errors="replace")

    def fail(self, error: str, message: str, hint: str) -> None:
        self._errors.append(("slurm", error))
        self._resume_at = self._monotonic() + self._backoff
        if self._failing != error:
            self._failing = error
            self._log.warning(error, error_detail=message, hint=hint, retry_in_seconds=self._backoff)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_mapping_dir(directory: Path) -> dict[tuple[int, int | None], list[str]]:
    """dcgm-exporter's job-mapping directory: a file per GPU index (``0``) or MIG instance
    (``0.3``), a job id per line ("0" or empty: no job). Missing or unreadable: nothing."""
    found: dict[tuple[int, int | None], list[str]] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return found
    for entry in entries:
        match = re.fullmatch(r"(\d+)(?:\.(\d+))?", entry.name)
        if not match:
            continue
        try:
            text = entry.read_text(errors="replace")
        except OSError:
            continue
        jobs = [line.strip() for line in text.splitlines() if line.strip() and line.strip() != "0"]
        if jobs:
            key = (int(match.group(1)), None if match.group(2) is None else int(match.group(2)))
            found[key] = jobs
    return found


class SlurmAllocations:
    """The slurm group's reader: allocations of this node's jobs, cached per job id."""

    def __init__(self, options: dict[str, Any], mapping_dir: str | None, monotonic: Callable[[], float],
                 errors: list[tuple[str, str]], user_name: Callable[[int], str] = _user) -> None:
        self._node = str(options.get("node-name") or "") or socket.gethostname().split(".")[0]
        self._scontrol = Scontrol(str(options.get("scontrol", "scontrol")), float(options.get("scontrol-timeout", 5)),
                                  float(options.get("scontrol-backoff", 60)), monotonic, errors)
        self._mapping = None if mapping_dir is None else Path(mapping_dir)
        self._user_name = user_name
        self._cache: dict[str, tuple[str, list[int]]] = {}  # job id -> scontrol's (user, GRES indices)

    def read(self, found: Scan, gpus: Sequence[GpuState]) -> tuple[JobAllocation, ...] | None:
        if not found.slurm_hierarchy and self._mapping is None:
            return None  # no Slurm here that gpuwatch can see: absent, not "free"
        by_minor = {g.identity.minor_number: g.identity.uuid for g in gpus if g.identity.minor_number is not None}
        by_gres = [g.identity.uuid for g in sorted(gpus, key=_gres_order)]
        by_index = {g.identity.index: g.identity.uuid for g in gpus}
        allocations: list[JobAllocation] = []
        resolved: set[str] = set()
        live = set()
        for job in (j for j in found.jobs if j.scheduler == "slurm"):
            live.add(job.job_id)
            user = self._user_name(job.uid) if job.uid is not None else ""
            minors = job.devices()
            if minors is not None:
                allocations.extend(JobAllocation(by_minor[m], job.job_id, user, "devices") for m in minors
                                   if m in by_minor)
                resolved.add(job.job_id)
                continue
            answer = self._cache.get(job.job_id)
            if answer is None:
                answer = self._ask(job)
            if answer is not None:
                scontrol_user, indices = answer
                allocations.extend(JobAllocation(by_gres[i], job.job_id, user or scontrol_user, "scontrol")
                                   for i in indices if i < len(by_gres))
                resolved.add(job.job_id)
        for gone in [j for j in self._cache if j not in live]:
            del self._cache[gone]
        if self._mapping is not None:
            for (index, _instance), jobs in sorted(read_mapping_dir(self._mapping).items(), key=_mapping_order):
                uuid = by_index.get(index)
                for job_id in jobs:
                    if uuid is not None and job_id not in resolved:
                        allocations.append(JobAllocation(uuid, job_id, "", "mapping"))
        return tuple(dict.fromkeys(allocations))  # one per (GPU, job): MIG files of one GPU say it again

    def _ask(self, job: JobCgroup) -> tuple[str, list[int]] | None:
        text = self._scontrol.show_job(job.job_id)
        if text is None:
            return None
        answer = parse_scontrol_job(text, self._node)
        if answer is None:
            self._scontrol.fail("scontrol_unparsable", f"unexpected output of scontrol show job {job.job_id}: "
                                 f"{text.strip()[:120]!r}", "please report it with your Slurm version")
            return None
        self._cache[job.job_id] = answer
        return answer


def _gres_order(state: GpuState) -> tuple[int, int]:
    """Slurm's GRES index order: gres.conf's File=/dev/nvidia[0-N] and AutoDetect list GPUs by minor number."""
    ident = state.identity
    return (ident.minor_number if ident.minor_number is not None else ident.index, ident.index)


def _mapping_order(item: tuple[tuple[int, int | None], list[str]]) -> tuple[int, int]:
    (index, instance), _ = item
    return index, -1 if instance is None else instance

