"""kubernetes: which pod and container the kubelet allocated each GPU and MIG device to (host side).

No NVML: the kubelet's PodResources API (v1 ``List``) over its unix socket, on the host job's
thread every slow interval (gpuwatch/hostside/kubelet.py), with a deadline. It needs the optional
extra ``gpuwatch[kubernetes]`` (grpcio); without it, or without the socket, the group is off with one
log line. Device ids are GPU UUIDs or MIG device UUIDs (mapped to their parent GPU and GPU
instance); a device plugin's sharing suffix ``::N`` is dropped. Series go with the pod.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatch.groups.base import Emit, G, Group, Spec


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """A GPU (or a MIG instance of it) the kubelet allocated to a container."""

    uuid: str
    namespace: str
    pod: str
    container: str
    gpu_instance: int | None = None  # the MIG GPU instance, for a MIG device


def select(state: Any, fast: Any, slow: Any, host: Any) -> tuple[Any, Any]:
    return None, (None if host is None else host.kubernetes)


def render(emit: Emit, _: None, pods: tuple[PodAllocation, ...] | None) -> None:
    seen = set()
    for p in pods or ():
        key = (p.namespace, p.pod, p.container)
        if key not in seen:  # several MIG devices of one GPU in one container: one series
            seen.add(key)
            emit("gpuwatch_gpu_pod_info", key, 1)
        if p.gpu_instance is not None:
            emit("gpuwatch_mig_pod_info", (str(p.gpu_instance),) + key, 1)


GROUP: Group[None, None] = Group(
    name="kubernetes",
    help="pods per GPU from the kubelet's PodResources API (needs gpuwatch[kubernetes] and the socket)",
    host="kubernetes",
    select=select,
    render=render,
    options={
        "socket": ("/var/lib/kubelet/pod-resources/kubelet.sock", "the kubelet's pod-resources socket"),
        "timeout": (5, "seconds one List call may take"),
    },
    specs=(
        Spec("gpuwatch_gpu_pod_info", "gauge", G + ("namespace", "pod", "container"),
             "1 per container the kubelet allocated the GPU (or a MIG device of it) to, from the PodResources "
             "API (List); gone with the pod."),
        Spec("gpuwatch_mig_pod_info", "gauge", G + ("gpu_instance", "namespace", "pod", "container"),
             "1 per container the kubelet allocated a MIG device of the GPU to, by its GPU instance (the MIG "
             "device's UUID mapped to its parent GPU); gone with the pod."),
    ),
)
