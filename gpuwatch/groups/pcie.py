"""pcie: the PCIe link's generation and width (current and maximum) and its replay counter.

Slow tier: nvmlDeviceGetCurr/MaxPcieLinkGeneration and Width (the maximums kept once answered:
Device.constant); the replay counter from field 94.
Idle GPUs downshift their link on purpose: the rules only look at a link that is slow while busy.
Each value passes ``Query.plausible`` on its own: a generation outside 0..16, a width outside 0..64 lanes or a
replay count outside 0..MAX_COUNTER32 (0xFFFFFFFF is NVML's "not available"), NaN or a fraction is left out,
counted (implausible_value) and logged once; the other readings stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import MAX_COUNTER32, Device, Emit, G, Group, Query, Spec, counted, within

_REPLAYS = 94  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
_HIGH = {"generation": 16, "width": 64}  # the largest plausible link generation and width (lanes)


@dataclass(frozen=True, slots=True)
class Pcie:
    pcie_link_generation: Mapping[str, int] = field(default_factory=dict)  # current | max
    pcie_link_width: Mapping[str, int] = field(default_factory=dict)
    pcie_replays: int | None = None


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.link = dev.supported(dev.call("nvmlDeviceGetCurrPcieLinkGeneration"))
        links = (("generation", "current", "nvmlDeviceGetCurrPcieLinkGeneration"),
                 ("width", "current", "nvmlDeviceGetCurrPcieLinkWidth"),
                 ("generation", "max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                 ("width", "max", "nvmlDeviceGetMaxPcieLinkWidth")) if self.link else ()
        # (generation | width, current | max, the call, its bound, the reading's name for Query.plausible)
        # the maximum generation and width are the GPU's and its slot's: asked once (Device.constant)
        self.calls = tuple((target, link, dev.constant(dev.call(function), within(0, _HIGH[target])) if link == "max"
                            else dev.call(function), _HIGH[target], f"PCIe {link} link {target}")
                           for target, link, function in links)
        self.replays = dev.field(_REPLAYS, "slow")
        dev.feature("pcie", self.link)

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> Pcie:
        generation: dict[str, int] = {}
        width: dict[str, int] = {}
        for target, link, call, high, what in self.calls:
            value = counted(q, q(call), high, what)
            if value is not None:
                (generation if target == "generation" else width)[link] = value
        replays = counted(q, q.field(_REPLAYS), MAX_COUNTER32, "PCIe replays") if self.replays else None
        return Pcie(generation, width, replays)


def render(emit: Emit, fast: None, slow: Pcie | None) -> None:
    if slow is None:
        return
    for link, gen in slow.pcie_link_generation.items():
        emit("gpuwatch_pcie_link_generation", (link,), gen)
    for link, width in slow.pcie_link_width.items():
        emit("gpuwatch_pcie_link_width", (link,), width)
    emit("gpuwatch_pcie_replays_total", (), slow.pcie_replays)


GROUP = Group(
    name="pcie",
    help="PCIe link generation and width, replay counter",
    features=("pcie",),
    slow="pcie",
    nvml=Nvml,
    fields={_REPLAYS: "PCIe replays"},
    render=render,
    specs=(
        Spec("gpuwatch_pcie_link_generation", "gauge", G + ("link",),
             "PCIe link generation, current or max (nvmlDeviceGetCurr/MaxPcieLinkGeneration; 'PCIe Generation'). "
             "Idle GPUs downshift on purpose."),
        Spec("gpuwatch_pcie_link_width", "gauge", G + ("link",),
             "PCIe link width in lanes, current or max ('Link Width')."),
        Spec("gpuwatch_pcie_replays_total", "counter", G,
             "PCIe replay counter (field NVML_FI_DEV_PCIE_REPLAY_COUNTER; 'Replays Since Reset')."),
    ),
)
