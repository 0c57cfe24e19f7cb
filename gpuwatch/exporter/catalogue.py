"""Every metric gpuwatch exports: name, type, labels and help (unit, NVML source, nvidia-smi name).

The names and labels are the public contract (shared/metrics.md, docs/metrics.md). This table is
the one place they are spelled; the collector refuses to emit a name that is not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

G = ("gpu", "uuid")


@dataclass(frozen=True)
class Spec:
    name: str
    type: str  # gauge | counter
    labels: tuple[str, ...]
    help: str


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
    Spec("gpuwatch_gpu_info", "gauge",
         G + ("name", "pci_bus_id", "serial", "minor_number", "vbios_version", "architecture"),
         "Static GPU facts, value 1 (nvidia-smi -q 'Product Name', 'Bus Id', 'Serial Number', 'VBIOS Version')."),
    Spec("gpuwatch_gpu_up", "gauge", G,
         "1 while the GPU answers; 0 when it is lost (GPU_IS_LOST, e.g. fell off the bus) or the backend is down."),
    Spec("gpuwatch_gpu_feature_supported", "gauge", G + ("feature",),
         "1 if the GPU supports the reading, 0 if NVML reports it NOT_SUPPORTED (probed once at discovery)."),
    # temperature
    Spec("gpuwatch_temperature_celsius", "gauge", G + ("sensor",),
         "Current temperature in degrees Celsius; sensor gpu (nvmlDeviceGetTemperatureV; 'GPU Current Temp') "
         "or memory (field NVML_FI_DEV_MEMORY_TEMP; 'Memory Current Temp')."),
    Spec("gpuwatch_temperature_threshold_celsius", "gauge", G + ("threshold",),
         "Driver temperature thresholds in degrees Celsius (nvmlDeviceGetTemperatureThreshold; 'GPU Slowdown Temp'), "
         "derived from the T.Limit margin where the driver only gives T.Limit thresholds."),
    Spec("gpuwatch_temperature_margin_celsius", "gauge", G,
         "Degrees Celsius left before the maximum operating temperature (nvmlDeviceGetMarginTemperature; "
         "'GPU T.Limit Temp')."),
    Spec("gpuwatch_temperature_margin_threshold_celsius", "gauge", G + ("threshold",),
         "Temperature thresholds on the T.Limit scale in degrees Celsius (fields NVML_FI_DEV_TEMPERATURE_*_TLIMIT; "
         "'GPU Slowdown T.Limit Temp')."),
    # fans
    Spec("gpuwatch_fan_speed_ratio", "gauge", G + ("fan",),
         "Reported fan speed, 1.0 = 100 % of the maximum noise-tolerance speed, can exceed 1 "
         "(nvmlDeviceGetFanSpeed_v2; 'Fan Speed')."),
    Spec("gpuwatch_fan_target_speed_ratio", "gauge", G + ("fan",),
         "Speed the driver drives the fan toward, 1.0 = 100 % (nvmlDeviceGetTargetFanSpeed)."),
    Spec("gpuwatch_fan_speed_rpm", "gauge", G + ("fan",),
         "Measured fan speed in revolutions per minute (nvmlDeviceGetFanSpeedRPM)."),
    # power
    Spec("gpuwatch_power_watts", "gauge", G,
         "Power draw in watts, a 1 s average on Ampere and newer (nvmlDeviceGetPowerUsage; 'Average Power Draw')."),
    Spec("gpuwatch_power_limit_watts", "gauge", G + ("limit",),
         "Power limits in watts: enforced (nvmlDeviceGetEnforcedPowerLimit; 'Current Power Limit'), default, "
         "min and max (nvmlDeviceGetPowerManagementLimitConstraints)."),
    Spec("gpuwatch_energy_joules_total", "counter", G,
         "Energy consumed since the driver was loaded, in joules; resets on driver reload "
         "(field NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION)."),
    Spec("gpuwatch_performance_state", "gauge", G,
         "Performance state 0-15, 0 = maximum performance (nvmlDeviceGetPerformanceState; 'Performance State')."),
    # utilization and memory
    Spec("gpuwatch_utilization_ratio", "gauge", G + ("engine",),
         "Fraction of the last sample period the engine was busy (nvmlDeviceGetUtilizationRates, "
         "nvmlDeviceGetEncoder/DecoderUtilization; 'Utilization')."),
    Spec("gpuwatch_memory_total_bytes", "gauge", G, "Frame buffer size in bytes (nvmlDeviceGetMemoryInfo_v2; 'FB Memory Usage Total')."),
    Spec("gpuwatch_memory_used_bytes", "gauge", G,
         "Frame buffer in use in bytes, excluding driver-reserved memory where v2 memory info exists ('Used')."),
    Spec("gpuwatch_memory_free_bytes", "gauge", G, "Free frame buffer in bytes ('Free')."),
    Spec("gpuwatch_memory_reserved_bytes", "gauge", G, "Frame buffer reserved by the driver in bytes ('Reserved')."),
    # clocks and throttling
    Spec("gpuwatch_clock_hertz", "gauge", G + ("clock",), "Current clock in hertz (nvmlDeviceGetClockInfo; 'Clocks')."),
    Spec("gpuwatch_clock_max_hertz", "gauge", G + ("clock",), "Maximum clock in hertz (nvmlDeviceGetMaxClockInfo; 'Max Clocks')."),
    Spec("gpuwatch_clocks_event_active", "gauge", G + ("reason",),
         "1 while the clock-event (throttle) reason is active, 0 otherwise; one series per reason the GPU supports "
         "(nvmlDeviceGetCurrentClocksEventReasons; 'Clocks Event Reasons')."),
    Spec("gpuwatch_clocks_event_seconds_total", "counter", G + ("reason",),
         "Cumulative seconds clocks were held down for the reason (NVML violation counters, fields "
         "NVML_FI_DEV_PERF_POLICY_* and NVML_FI_DEV_CLOCKS_EVENT_REASON_*; 'Clocks Event Reasons Counters')."),
    # health
    Spec("gpuwatch_xid_events_total", "counter", G,
         "XID error events received from NVML (nvmlEventSetWait), any code; at 0 from the start on GPUs "
         "that deliver XID events."),
    Spec("gpuwatch_xid_errors_total", "counter", G + ("xid",),
         "XID error events per XID code; a code's series appears with its first event "
         "(alert on gpuwatch_xid_events_total, look here for the codes)."),
    Spec("gpuwatch_xid_last_timestamp_seconds", "gauge", G + ("xid",), "Unix time of the last XID event of that code."),
    Spec("gpuwatch_ecc_errors_total", "counter", G + ("error", "counter"),
         "ECC error counts: corrected/uncorrected, volatile (since driver load) or aggregate (lifetime) "
         "(fields NVML_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL; 'ECC Errors')."),
    Spec("gpuwatch_remapped_rows_total", "counter", G + ("error",),
         "Memory rows remapped because of correctable/uncorrectable errors (fields NVML_FI_DEV_REMAPPED_*; 'Remapped Rows')."),
    Spec("gpuwatch_remapped_rows_pending", "gauge", G, "1 when a row remap waits for a GPU reset ('Pending')."),
    Spec("gpuwatch_remapped_rows_failed", "gauge", G, "1 when a row remap failed: the GPU needs service ('Remapping Failure Occurred')."),
    Spec("gpuwatch_retired_pages_pending", "gauge", G,
         "1 when page retirement waits for a reboot (field NVML_FI_DEV_RETIRED_PENDING; 'Pending Page Blacklist')."),
    Spec("gpuwatch_pcie_link_generation", "gauge", G + ("link",),
         "PCIe link generation, current or max (nvmlDeviceGetCurr/MaxPcieLinkGeneration; 'PCIe Generation'). "
         "Idle GPUs downshift on purpose."),
    Spec("gpuwatch_pcie_link_width", "gauge", G + ("link",), "PCIe link width in lanes, current or max ('Link Width')."),
    Spec("gpuwatch_pcie_replays_total", "counter", G, "PCIe replay counter (field NVML_FI_DEV_PCIE_REPLAY_COUNTER; 'Replays Since Reset')."),
    # workloads (who is using the GPU; slow tier; docs/slurm.md)
    Spec("gpuwatch_gpu_job_info", "gauge", G + ("scheduler", "job_id", "user"),
         "1 while a workload holds the GPU: scheduler slurm (job_id = Slurm job id), kubernetes (pod UID), "
         "systemd (unit), none (a plain process) or unknown (PID not visible); from NVML's process list "
         "and /proc/PID/cgroup."),
    Spec("gpuwatch_workload_memory_used_bytes", "gauge", G + ("scheduler", "job_id"),
         "Frame buffer used by the workload's processes on the GPU in bytes (nvmlDeviceGetComputeRunningProcesses)."),
    Spec("gpuwatch_process_memory_used_bytes", "gauge", G + ("pid", "scheduler", "job_id", "user"),
         "Frame buffer used by one process in bytes; only with --collector.processes, at most "
         "--collector.processes-max series per node; never command lines."),
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
    Spec("gpuwatch_poll_duration_seconds", "gauge", ("tier",), "Duration of the last completed poll of the tier in seconds."),
    Spec("gpuwatch_last_poll_timestamp_seconds", "gauge", ("tier",), "Unix time of the last completed poll of the tier."),
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
)

CATALOGUE: dict[str, Spec] = {spec.name: spec for spec in _SPECS}
