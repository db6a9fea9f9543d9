"""Shared by the gpu-marked tests: a real NVML session."""

from __future__ import annotations

import importlib.util

import pytest

from jupyter_gpushare.reclaim.driver import driver_support
from jupyter_gpushare.telemetry.nvml import NVMLTelemetry


@pytest.fixture
def nvml():
    t = NVMLTelemetry()
    st = t.open()
    assert st.available, st.reason
    yield t
    t.close()


@pytest.fixture
def supported():
    """PyTorch and the driver checkpoint API, else the test is skipped."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch")
    s = driver_support()
    if not s.ok:
        pytest.skip(s.reason)
