"""Helpers of the gpu-marked tests."""

from __future__ import annotations

import select
import subprocess


def readline(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The child's next line, or a failure after ``timeout`` seconds (never a hang)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "child did not answer"
    return proc.stdout.readline().strip()
