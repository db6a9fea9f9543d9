"""Shared by the gpu-marked tests: a real NVML session."""

from __future__ import annotations

import pytest

from jupyter_gpushare.telemetry.nvml import NVMLTelemetry


@pytest.fixture
def nvml():
    t = NVMLTelemetry()
    st = t.open()
    assert st.available, st.reason
    yield t
    t.close()
