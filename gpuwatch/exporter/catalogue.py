"""Every metric gpuwatch exports: name, type, labels and help (unit, NVML source, nvidia-smi name).

The names and labels are the public contract (shared/metrics.md, docs/metrics.md). A reading group's
families are declared in its module; the rest here. The collector refuses to emit a name that is in
neither.
"""

from __future__ import annotations

from gpuwatch.groups import SPECS as GROUP_SPECS
from gpuwatch.groups.base import G, Spec

# The families that are no reading group's: identity and state, anomalies, the exporter itself.
# Each group's are in its module (gpuwatch/groups/).
_SPECS = (
    # identity and state
    Spec("gpuwatch_build_info", "gauge", ("version", "python_version", "nvml_binding_version"),
         "gpuwatch build information, value 1."),
    Spec("gpuwatch_driver_info", "gauge", ("driver_version", "nvml_version", "cuda_driver_version"),
         "NVIDIA driver, NVML and CUDA driver versions, value 1; absent while NVML is down "
         "(nvmlSystemGetDriverVersion; nvidia-smi 'Driver Version')."),
    Spec("gpuwatch_backend_up", "gauge", ("backend",),
         "1 when the backend is initialised and sees at least one GPU, else 0."),
    Spec("gpuwatch_gpus", "gauge", (), "GPUs visible in the last discovery (nvmlDeviceGetCount)."),
    Spec("gpuwatch_node_info", "gauge", ("rack", "row", "room", "pdu"),
         "Always 1: where the node stands, from gpuwatch's configuration (--node.rack, --node.row, --node.room, "
         "--node.pdu; empty when not set), for sites whose Prometheus targets carry no such labels."),
    Spec("gpuwatch_node_power_budget_watts", "gauge", (),
         "What the node's supplies can deliver to its GPUs after redundancy (--node.power-budget-watts); "
         "absent when not declared."),
    Spec("gpuwatch_gpu_info", "gauge",
         G + ("name", "pci_bus_id", "serial", "minor_number", "vbios_version", "architecture"),
         "Static GPU facts, value 1 (nvidia-smi -q 'Product Name', 'Bus Id', 'Serial Number', 'VBIOS Version')."),
    Spec("gpuwatch_gpu_up", "gauge", G,
         "1 while the GPU answers; 0 when it is lost (GPU_IS_LOST, e.g. fell off the bus) or the backend is down."),
    Spec("gpuwatch_gpu_allocated", "gauge", G,
         "1 while a scheduler has the GPU allocated to a job or pod (the slurm and kubernetes groups: cgroup "
         "devices, scontrol, the mapping directory, the kubelet), 0 while it is free; absent when none can be read."),
    Spec("gpuwatch_gpu_feature_supported", "gauge", G + ("feature",),
         "1 if the GPU supports the reading, 0 if NVML reports it NOT_SUPPORTED (probed once at discovery)."),
    # anomalies (rule evaluators, docs/rules.md)
    Spec("gpuwatch_anomaly", "gauge", G + ("rule", "severity"),
         "1 while the rule fires on the GPU; absent otherwise, like Prometheus' ALERTS series "
         "(docs/rules.md; /api/v1/status lists every evaluated rule)."),
    Spec("gpuwatch_anomaly_onsets_total", "counter", ("rule",),
         "Times the rule started firing, on any GPU or the node; one series per enabled rule, at 0 from the start."),
    Spec("gpuwatch_anomaly_since_timestamp_seconds", "gauge", G + ("rule",),
         "Unix time the current episode of the rule began firing; only while firing."),
    Spec("gpuwatch_node_anomaly", "gauge", ("rule", "severity"),
         "1 while the node-level rule fires (backend_down, collection_stalled, gpu_missing); absent otherwise."),
    Spec("gpuwatch_rule_evaluation_errors_total", "counter", ("rule",),
         "Evaluations of the rule that raised (a bug in the rule): its state on that GPU stays as it was, every "
         "other rule and GPU is still evaluated; one series per enabled rule, at 0 from the start."),
    # the exporter itself
    Spec("gpuwatch_poll_success", "gauge", ("tier",),
         "1 if the last poll of the tier completed for every visible GPU and is not older than the staleness bound."),
    Spec("gpuwatch_poll_duration_seconds", "gauge", ("tier",),
         "Duration of the last completed poll of the tier in seconds."),
    Spec("gpuwatch_last_poll_timestamp_seconds", "gauge", ("tier",),
         "Unix time of the last completed poll of the tier."),
    Spec("gpuwatch_poll_errors_total", "counter", ("tier", "error"),
         "Failed NVML queries by NVML error name (lowercase), e.g. gpu_is_lost, timeout, unknown."),
    Spec("gpuwatch_log_dropped_total", "counter", (),
         "Log lines gpuwatch could not write (the reader of stderr is gone, the disk is full) or make; "
         "everything else goes on."),
    Spec("gpuwatch_collector_success", "gauge", ("group",),
         "1 if the reading group's last read succeeded on every GPU it applies to, else 0; only enabled groups "
         "(node_exporter's node_scrape_collector_success)."),
    Spec("gpuwatch_collector_duration_seconds", "gauge", ("group",),
         "Seconds the reading group's last read took, all GPUs together."),
    Spec("gpuwatch_collector_errors_total", "counter", ("group", "error"),
         "Failures of a host group's sources (slurm, kubernetes, jobs) by kind, e.g. scontrol_timeout, "
         "scontrol_failed, kubelet_unavailable; each kind is logged once until it recovers."),
)

CATALOGUE: dict[str, Spec] = {spec.name: spec for spec in _SPECS + GROUP_SPECS}
assert len(CATALOGUE) == len(_SPECS) + len(GROUP_SPECS), "a metric family is declared twice"
