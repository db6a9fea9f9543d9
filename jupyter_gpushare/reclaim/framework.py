"""The framework method: the in-kernel agent moves tensors/arrays to host memory in place
(PyTorch, CuPy, JAX adapters in ``kernel/offload``) and empties allocator caches.

Frees all but the CUDA context. For old drivers and MIG, where the driver checkpoint
API is not available. ``reload`` moves back whatever is offloaded (nothing when nothing
is), so it is both the restore and the undo of a failed or half-done offload.
"""

from __future__ import annotations

import asyncio
import time

from ..protocol import RemoteError
from .base import (
    AgentLink,
    KernelTarget,
    Progress,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
    reply_int,
)

_AGENT_ERRORS = (RemoteError, ConnectionError, TimeoutError, asyncio.TimeoutError)  # 3.10: two classes


def _why(e: BaseException) -> str:
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "the kernel did not answer in time"
    return str(e) or type(e).__name__


class FrameworkMethod(ReclaimMethod):
    name = "framework"
    needs_agent = True
    supports_lazy = False  # offloaded tensors are host tensors: a cell would compute on the CPU
    auto_rank = 1  # works on old drivers and under MIG, but leaves the CUDA context

    def __init__(self, op_timeout: float = 600.0):
        self.op_timeout = op_timeout

    def support(self) -> Support:
        return Support(True, "needs the kernel agent and PyTorch, CuPy or JAX in the kernel")

    @staticmethod
    def _agent(target: KernelTarget) -> AgentLink:
        if target.agent is None:
            raise ReclaimError("the framework method needs the kernel agent, which is not connected",
                               resident=True)
        return target.agent

    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = self._agent(target)
        started = time.monotonic()
        try:
            reply = await agent.request("offload", timeout=self.op_timeout)
            moved = reply_int(reply, "bytes")
        except (*_AGENT_ERRORS, ReclaimError) as e:
            why = f"offload failed: {_why(e)}"
            try:  # the agent's reload moves back whatever did leave the GPU
                await agent.request("reload", timeout=self.op_timeout)
            except _AGENT_ERRORS as undo:
                raise ReclaimError(f"{why}; moving back not confirmed ({_why(undo)}): the state "
                                   "stays held until a restore brings it back") from None
            if getattr(e, "kind", "") == "UndoIncomplete":  # objects the adapter left changed
                raise ReclaimError(f"{why}; some objects could not be put back as they were",
                                   retryable=False) from None
            raise ReclaimError(f"{why}; the kernel runs as before", resident=True) from None
        left = reply.get("skipped_count")
        if not isinstance(left, int) or isinstance(left, bool):
            left = len(reply["skipped"]) if isinstance(reply.get("skipped"), list) else 0
        return ReclaimResult(moved, time.monotonic() - started,
                             f"{left} objects left on the GPU" if left else "")

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = self._agent(target)
        started = time.monotonic()
        try:
            reply = await agent.request("reload", timeout=self.op_timeout)
        except _AGENT_ERRORS as e:
            raise ReclaimError(f"reload failed: {_why(e)}") from None
        return ReclaimResult(reply_int(reply, "bytes"), time.monotonic() - started)
