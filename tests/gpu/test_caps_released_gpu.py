"""A memory cap that reaches a PyTorch process the driver has checkpointed: it makes no CUDA
call (every one would block until the restore), answers at once that it applies when the
state is back, and holds once the process is restored.

Run with ``pytest -m gpu`` on a machine with driver >= 570, torch and cuda-core installed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest

from jupyter_gpushare.reclaim.base import KernelTarget
from jupyter_gpushare.reclaim.driver import DriverMethod

from .helpers import readline

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

GiB = 1 << 30

# a PyTorch process using CUDA, capped at half its GPU; it answers one line per command
CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    from jupyter_gpushare.kernel import caps
    x = torch.ones(1 << 20, device="cuda:0")
    c = caps.get()
    total = torch.cuda.get_device_properties(0).total_memory
    c.set(total // 2, total)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hold":
            c.hold()
            print("held", flush=True)
        elif cmd == "cap":
            started = time.monotonic()
            lines = c.set(1 << 30)
            print(json.dumps({"lines": lines, "seconds": time.monotonic() - started}), flush=True)
        elif cmd == "resume":
            lines = c.resume()
            try:
                y = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
                past = "allocated"
            except torch.cuda.OutOfMemoryError:
                past = "out of memory"
            print(json.dumps({"lines": lines, "past": past}), flush=True)
    """
)


def test_a_cap_reaching_a_checkpointed_pytorch_process_waits_and_holds_after_restore(
    nvml, supported
):
    free_before = nvml.free_bytes(0)
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert readline(proc) == "ready"
        held = max(1, free_before - nvml.free_bytes(0))
        method = DriverMethod(nvml.free_bytes)
        target = KernelTarget("gpu-cap-test", pids=[proc.pid], gpu_bytes={0: held})

        proc.stdin.write("hold\n")  # as the agent does at the release's first step
        assert readline(proc) == "held"
        asyncio.run(method.release(target))
        proc.stdin.write("cap\n")  # a CUDA call now would block until the restore
        said = json.loads(readline(proc, timeout=30))
        assert any(line.startswith("PyTorch: capped at 1.0 GiB per GPU; the cap applies when "
                                   "the kernel's state is back on the GPU") for line in said["lines"]), said

        asyncio.run(method.restore(target))
        proc.stdin.write("resume\n")
        back = json.loads(readline(proc))
        assert any(line.startswith("PyTorch: already using the GPU; capped at 1.0 GiB")
                   for line in back["lines"]), back
        assert back["past"] == "out of memory", back
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in a CUDA call under the checkpoint
            proc.kill()
            proc.wait()
