"""slurm: which Slurm job holds which GPU, whether or not a process runs on it (host side, slow tier).

No NVML: read on the host (gpuwatch/hostside/slurm_allocations.py) on the host job's own thread every slow
interval, so a slow or hung slurmctld never delays a poll. Per job found in this node's cgroup tree,
the first source that can tell:

1. cgroup v1's devices controller: ``devices.list`` of ``…/devices/slurm/uid_<uid>/job_<id>``
   lists ``c 195:N`` for each GPU the job may open (N: the GPU's minor number; 255 is nvidiactl);
2. ``scontrol show job --details --oneliner <id>``: the ``GRES=gpu…(IDX:…)`` of this node's part
   (docs/slurm.md: a GRES index is the place of the GPU in gres.conf's order, by minor number),
   with a timeout, asked once per job (an allocation does not change), failures counted and logged once;
3. the prolog-written mapping directory (``--attribution.hpc-job-mapping-dir``), per GPU index.

``gpuwatch_gpu_allocated`` (rendered from this group and the kubernetes group together) is 1 on a
GPU a scheduler allocated, 0 on a free one, absent when no source can be read.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.groups.base import Group


@dataclass(frozen=True, slots=True)
class JobAllocation:
    """A GPU a Slurm job holds on this node."""

    uuid: str
    job_id: str
    user: str = ""  # user name, the numeric uid, or "" when no source says
    source: str = "devices"  # which told: devices (cgroup v1), scontrol, mapping (the prolog's directory)


GROUP: Group[None, None] = Group(
    name="slurm",
    help="Slurm allocations per GPU: cgroup v1 devices.list, else scontrol show job, else the mapping directory",
    host="slurm",
    options={
        "scontrol": ("scontrol", "the scontrol command (a name on PATH or a path); empty: never run it"),
        "scontrol-timeout": (5, "seconds one scontrol call may take before it is killed"),
        "scontrol-backoff": (60, "seconds before a job scontrol could not answer for is asked again"),
        "node-name": ("", "this node's Slurm NodeName (default: the short host name)"),
    },
    specs=(),  # its families are joint ones (groups/joint.py): gpuwatch_gpu_allocated, gpuwatch_gpu_job_info
)
