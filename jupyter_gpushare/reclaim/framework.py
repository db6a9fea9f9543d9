"""The framework method: the in-kernel agent moves tensors/arrays to host memory in place
(PyTorch, CuPy, JAX adapters in ``kernel/offload``) and empties allocator caches.

Frees all but the CUDA context. For old drivers and MIG, where the driver checkpoint
API is not available.
"""

from __future__ import annotations

import time

from ..protocol import RemoteError
from .base import KernelTarget, Progress, ReclaimError, ReclaimMethod, ReclaimResult, Support


class FrameworkMethod(ReclaimMethod):
    name = "framework"

    def __init__(self, op_timeout: float = 600.0):
        self.op_timeout = op_timeout

    def support(self) -> Support:
        return Support(True, "needs the kernel agent and PyTorch, CuPy or JAX in the kernel")

    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        if target.agent is None:
            raise ReclaimError("the framework method needs the kernel agent, which is not connected")
        started = time.monotonic()
        try:
            reply = await target.agent.request("offload", timeout=self.op_timeout)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            # the adapters move nothing they cannot move back; ask them to undo what they did
            try:
                await target.agent.request("reload", timeout=self.op_timeout)
            except Exception:
                pass
            raise ReclaimError(f"offload failed: {e}") from None
        skipped = reply.get("skipped") or []
        return ReclaimResult(int(reply.get("bytes", 0)), time.monotonic() - started,
                             f"{len(skipped)} objects left on the GPU" if skipped else "")

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        if target.agent is None:
            raise ReclaimError("the kernel agent is not connected")
        started = time.monotonic()
        try:
            reply = await target.agent.request("reload", timeout=self.op_timeout)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            raise ReclaimError(f"reload failed: {e}") from None
        return ReclaimResult(int(reply.get("bytes", 0)), time.monotonic() - started)
