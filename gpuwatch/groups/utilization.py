"""utilization: how busy the GPU, its memory interface and its video engines were.

Fast tier: nvmlDeviceGetUtilizationRates (gpu and memory). Slow tier, with
``--collector.utilization.video``: the encoder and decoder (nvmlDeviceGetEncoderUtilization,
GetDecoderUtilization), which a monitor of compute nodes rarely needs: off by default, to keep a
data-center GPU within the contract's series budget (2 series and 2 calls per GPU less).
A percentage beyond 0..100 (0xFFFFFFFF, 255) is left out and counted (Query.plausible), the other
engines' kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.frozen import quick
from gpuwatch.groups.base import Device, Emit, G, Group, Query, Spec

ENGINES: tuple[str, ...] = ("gpu", "memory", "encoder", "decoder")


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class Utilization:
    utilization_ratio: Mapping[str, float] = field(default_factory=dict)  # engine -> 0..1


class Nvml:
    def __init__(self, dev: Device) -> None:
        rates = dev.call("nvmlDeviceGetUtilizationRates")
        self.rates = rates if dev.supported(rates) else None
        self.engines = tuple((engine, call, f"utilization_ratio{{engine={engine}}}") for engine, call in (
            ("encoder", dev.call("nvmlDeviceGetEncoderUtilization")),
            ("decoder", dev.call("nvmlDeviceGetDecoderUtilization"))) if dev.supported(call)) \
            if dev.option("video") else ()
        dev.feature("utilization", self.rates is not None)

    def read_fast(self, q: Query) -> Utilization:
        rates = q(self.rates) if self.rates is not None else None
        if rates is None:
            return Utilization()
        plausible = q.plausible
        gpu = plausible(rates.gpu, 0, 100, "utilization_ratio{engine=gpu}")
        memory = plausible(rates.memory, 0, 100, "utilization_ratio{engine=memory}")
        ratios = {}
        if gpu is not None:
            ratios["gpu"] = gpu / 100.0
        if memory is not None:
            ratios["memory"] = memory / 100.0
        return Utilization(ratios)

    def read_slow(self, q: Query) -> Utilization:
        plausible = q.plausible
        ratios = {}
        for engine, call, what in self.engines:
            value = q(call)  # (utilization %, sampling period µs)
            if value is not None and (percent := plausible(value[0], 0, 100, what)) is not None:
                ratios[engine] = percent / 100.0
        return Utilization(ratios)


def render(emit: Emit, fast: Utilization | None, slow: Utilization | None) -> None:
    for reading in (fast, slow):
        if reading is not None:
            for engine, ratio in reading.utilization_ratio.items():
                emit("gpuwatch_utilization_ratio", (engine,), ratio)


GROUP = Group(
    name="utilization",
    help="GPU, memory, encoder and decoder utilization",
    features=("utilization",),
    fast="utilization",
    slow="utilization",
    nvml=Nvml,
    render=render,
    options={"video": (False, "also the encoder and decoder utilization, read in the slow tier (2 series per GPU)")},
    specs=(
        Spec("gpuwatch_utilization_ratio", "gauge", G + ("engine",),
             "Fraction of the last sample period the engine was busy (nvmlDeviceGetUtilizationRates; "
             "encoder and decoder from nvmlDeviceGetEncoder/DecoderUtilization, read in the slow tier with "
             "--collector.utilization.video; 'Utilization')."),
    ),
)
