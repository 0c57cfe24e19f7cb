"""memory: the frame buffer, with nvidia-smi's semantics.

Fast tier: nvmlDeviceGetMemoryInfo_v2 (used excludes the driver's reserved memory, which is its
own reading), else v1 on older drivers. A total beyond 0..2**50 bytes, or a used, free or reserved
amount beyond 0..total (0..2**50 where the total was left out), is left out and counted (Query.plausible).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.frozen import quick
from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Memory:
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None


_NO_MEMORY = Memory()
_MAX_BYTES = 2**50  # 1 PiB: more frame buffer than any GPU has (Query.plausible); 0xFF..FF is NVML's "not available"


def history(memory: Memory) -> Memory:
    """No rule looks back at the frame buffer (the latest sample has it)."""
    return _NO_MEMORY


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.info = dev.first(dev.call("nvmlDeviceGetMemoryInfo_v2"), dev.call("nvmlDeviceGetMemoryInfo"))

    def read_fast(self, q: Query) -> Memory:
        info = q(self.info) if self.info is not None else None
        if info is None:
            return Memory()
        plausible = q.plausible
        total = plausible(info.total, 0, _MAX_BYTES, "memory_total_bytes")
        most = _MAX_BYTES if total is None else total  # a part is at most the whole
        used = plausible(info.used, 0, most, "memory_used_bytes")
        free = plausible(info.free, 0, most, "memory_free_bytes")
        reserved = getattr(info, "reserved", None)  # v2 only
        if reserved is not None:
            reserved = plausible(reserved, 0, most, "memory_reserved_bytes")
        return Memory(None if total is None else int(total), None if used is None else int(used),
                      None if free is None else int(free), None if reserved is None else int(reserved))

    def read_slow(self, q: Query) -> None:
        return None


def render(emit: Emit, fast: Memory | None, slow: None) -> None:
    if fast is not None:
        emit("gpuwatch_memory_total_bytes", (), fast.memory_total_bytes)
        emit("gpuwatch_memory_used_bytes", (), fast.memory_used_bytes)
        emit("gpuwatch_memory_free_bytes", (), fast.memory_free_bytes)
        emit("gpuwatch_memory_reserved_bytes", (), fast.memory_reserved_bytes)


GROUP = Group(
    name="memory",
    history=history,
    help="frame buffer total, used, free and reserved",
    fast="memory",
    nvml=Nvml,
    render=render,
    specs=(
        Spec("gpuwatch_memory_total_bytes", "gauge", G,
             "Frame buffer size in bytes (nvmlDeviceGetMemoryInfo_v2; 'FB Memory Usage Total')."),
        Spec("gpuwatch_memory_used_bytes", "gauge", G,
             "Frame buffer in use in bytes, excluding driver-reserved memory where v2 memory info exists ('Used')."),
        Spec("gpuwatch_memory_free_bytes", "gauge", G, "Free frame buffer in bytes ('Free')."),
        Spec("gpuwatch_memory_reserved_bytes", "gauge", G,
             "Frame buffer reserved by the driver in bytes ('Reserved')."),
    ),
)
