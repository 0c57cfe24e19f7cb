"""Exception hierarchy. Every error a user can see carries a message that says what to do."""

from __future__ import annotations


class GpuwatchError(Exception):
    """Base class of gpuwatch's own errors."""


class ConfigError(GpuwatchError):
    """Invalid configuration: reported at start-up, process exits with EX_CONFIG (78)."""


class BackendUnavailable(GpuwatchError):
    """The backend as a whole cannot be used right now (library missing, driver not loaded, ...).

    ``reason`` is a stable snake_case cause (``driver_not_loaded``), ``hint`` tells the operator
    what to do. The poller retries with capped backoff; the process keeps serving.
    """

    def __init__(self, reason: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.hint = hint


class DeviceLost(GpuwatchError):
    """One GPU stopped answering (NVML GPU_IS_LOST): it is reported down, the others go on."""

    def __init__(self, uuid: str, message: str = "GPU is lost") -> None:
        super().__init__(message)
        self.uuid = uuid


class ReplayFormatError(GpuwatchError):
    """A recorded trace cannot be read."""
