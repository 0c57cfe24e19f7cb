"""Query.plausible: what NVML answers that no GPU can have is left out, counted and logged once."""

from __future__ import annotations

import math

import pytest
from structlog.testing import capture_logs

from gpuwatch.backends.nvml.funnel import IMPLAUSIBLE, Query


@pytest.mark.parametrize("value", [0, 1, 99.5, 100, -5, 2**31])
def test_a_value_within_its_bounds_is_itself(value):
    q = Query("GPU-1")
    assert q.plausible(value, -5, 2**31, "x") == value and q.errors == []


@pytest.mark.parametrize("value", [0xFFFFFFFF, 2**64 - 1, -6, math.nan, math.inf, -math.inf, 1e300, True, "12"])
def test_a_value_beyond_its_bounds_is_left_out_counted_and_logged_once_per_gpu_and_reading(value):
    implausible: set[str] = set()
    with capture_logs() as logs:
        for _ in range(3):
            q = Query("GPU-1", implausible, "3")  # a new Query each poll, the GPU's set kept
            assert q.plausible(value, -5, 2**31, "temperature") is None
            assert q.errors == [IMPLAUSIBLE]
        assert Query("GPU-1", implausible).plausible(0xFFFFFFFF, 0, 1, "fan_speed") is None
    lines = [(e["event"], e["reading"], e["uuid"]) for e in logs]
    assert lines == [("nvml_reading_implausible", "temperature", "GPU-1"),
                     ("nvml_reading_implausible", "fan_speed", "GPU-1")]
    assert logs[0]["value"] == repr(value) and logs[0]["gpu"] == "3" and "hint" in logs[0]


def test_none_stays_none_without_an_error():
    q = Query("GPU-1")
    assert q.plausible(None, 0, 1, "x") is None and q.errors == []


@pytest.mark.parametrize("value,kept", [(3, 3), (3.0, 3.0), (1.5, None), (math.nan, None), (2**40, None)])
def test_a_whole_reading_is_whole_never_truncated(value, kept):
    q = Query("GPU-1")
    assert q.plausible(value, 0, 2**32, "count", whole=True) == kept
    assert q.errors == ([] if kept is not None else [IMPLAUSIBLE])
