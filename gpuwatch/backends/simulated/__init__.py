"""A simulated node: GPUs whose readings come from a small, deterministic physics model.

Used by the demo (``gpuwatch --simulate``), by the contract tests and by anyone who wants to see the
exporter and the anomaly rules work without a GPU. Nothing here touches NVML.

Determinism. Each GPU's state is integrated on a fixed grid of ``STEP_SECONDS`` steps counted from
the first ``open()`` (read from the injected clock). A read advances that GPU's state up to the
last grid point at or before ``clock.monotonic()`` and reports the state there, so a reading
depends only on the seed, the profile, the faults and the elapsed time, never on how often or in
which order the GPUs were polled. Jitter comes from per-GPU random generators that are consumed a
fixed amount per step.

The model, per GPU and step:

- load: a seeded sequence of jobs (60–100 % utilization for 2.5–15 minutes, idle gaps of
  20 s–4 min; a GPU may already be busy at start). Memory used ramps up when a job starts and is
  freed when it ends; memory-engine utilization is GPU utilization times a per-job intensity.
- power = idle + utilization × (full-load demand − idle) × clock factor, capped at the enforced
  limit. At the cap the clocks are lowered so that the draw equals the limit and ``sw_power_cap``
  is active.
- temperature: first order toward ambient + power × thermal resistance; with fans the resistance
  falls linearly from its "fans stopped" value to its "fans at 100 %" value.
- fans: target from a fan curve (30 % up to 40 °C, 100 % from 85 °C); the measured speed follows
  the target with a time constant of a few seconds; RPM = speed × maximum RPM.
- thermal throttling: ``sw_thermal_slowdown`` from the max-operating temperature (clocks down to
  75 %), ``hw_thermal_slowdown`` + ``hw_slowdown`` from the slowdown threshold (clocks halved, and
  lowered further as the temperature approaches shutdown), each with hysteresis.
- counters: energy integrates power; each throttle-time counter integrates the time its reason was
  active.

Faults (``Fault``) change the inputs of that model for one GPU during a time window; each kind is
one small entry of ``FAULT_KINDS``, so a new anomaly scenario is one more entry. A few kinds act on
the backend itself rather than on a GPU's physics: ``backend_down`` (every call raises
BackendUnavailable), ``hang`` (reads block, like a wedged driver) and ``unlisted`` (a GPU gone from
the bus and from discovery).

Profiles: ``rtx6000`` (RTX 6000 Ada: one blower fan, absolute thresholds), ``h200`` (passively
cooled, T.Limit thresholds, row remapping; after the H200 capture) and ``t4`` (Tesla T4: passive,
70 W, page retirement instead of row remapping).

``scenarios()`` names one scripted situation per anomaly rule, plus a healthy node per profile, for
the demo and the scenario tests.
"""

from gpuwatch.backends.simulated.backend import SimulatedBackend
from gpuwatch.backends.simulated.conditions import Conditions, Health
from gpuwatch.backends.simulated.faults import FAULT_KINDS, Fault, FaultKind
from gpuwatch.backends.simulated.profiles import DRIVER_INFO, MAX_GPUS, PROFILES, STEP_SECONDS, Profile
from gpuwatch.backends.simulated.scenarios import Scenario, scenarios
from gpuwatch.backends.simulated.tour import DEMO_TOUR_SECONDS, demo_tour

__all__ = ["DEMO_TOUR_SECONDS", "DRIVER_INFO", "FAULT_KINDS", "MAX_GPUS", "PROFILES", "STEP_SECONDS", "Conditions",
           "Fault", "FaultKind", "Health", "Profile", "Scenario", "SimulatedBackend", "demo_tour", "scenarios"]
