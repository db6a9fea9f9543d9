"""Helpers of the gpu-marked tests."""

from __future__ import annotations

import select
import subprocess
from typing import Any

import pytest


def readline(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The child's next line, or a failure after ``timeout`` seconds (never a hang)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "child did not answer"
    return proc.stdout.readline().strip()


def torch_cuda() -> Any:
    """PyTorch with a CUDA device, else the test is skipped."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return torch


def cupy_cuda() -> Any:
    """CuPy with a CUDA device, else the test is skipped."""
    cupy = pytest.importorskip("cupy")
    try:  # without a driver CuPy raises rather than counting 0
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count == 0:
        pytest.skip("no CUDA device visible to cupy")
    return cupy
