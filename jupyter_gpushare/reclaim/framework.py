"""The framework method: the in-kernel agent moves tensors/arrays to host memory in place
(PyTorch, CuPy, JAX adapters in ``kernel/offload``) and empties allocator caches.

Frees all but the CUDA context. For old drivers and MIG, where the driver checkpoint
API is not available. ``reload`` moves back whatever is offloaded (nothing when nothing
is), so it is both the restore and the undo of a failed or half-done offload.
"""

from __future__ import annotations

import time

from .base import (
    AGENT_ERRORS,
    KernelTarget,
    Progress,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
    agent_failure,
    gpu_moves,
    reply_int,
    require_agent,
)
from .simulated import copied_note


class FrameworkMethod(ReclaimMethod):
    name = "framework"
    needs_agent = True
    supports_lazy = False  # offloaded tensors are host tensors: a cell would compute on the CPU
    auto_rank = 1  # works on old drivers and under MIG, but leaves the CUDA context

    def __init__(self, op_timeout: float = 600.0):
        self.op_timeout = op_timeout

    def move_refusal(self) -> str | None:
        return ("the framework method cannot restore onto another GPU: the kernel process's "
                "device list is fixed")

    def support(self) -> Support:
        return Support(True, "needs the kernel agent and PyTorch, CuPy or JAX in the kernel")

    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = require_agent(target, "the framework method needs the kernel agent, which is not connected")
        started = time.monotonic()
        try:
            reply = await agent.request("offload", timeout=self.op_timeout)
            moved = reply_int(reply, "bytes")
        except (*AGENT_ERRORS, ReclaimError) as e:
            why = f"offload failed: {agent_failure(e)}"
            try:  # the agent's reload moves back whatever did leave the GPU
                await agent.request("reload", timeout=self.op_timeout)
            except AGENT_ERRORS as undo:
                raise ReclaimError(f"{why}; moving back not confirmed ({agent_failure(undo)}): the state "
                                   "stays held until a restore brings it back") from None
            if getattr(e, "kind", "") == "UndoIncomplete":  # objects the adapter left changed
                raise ReclaimError(f"{why}; some objects could not be put back as they were",
                                   retryable=False) from None
            raise ReclaimError(f"{why}; the kernel runs as before", resident=True) from None
        left = reply.get("skipped_count")
        if not isinstance(left, int) or isinstance(left, bool):
            left = len(reply["skipped"]) if isinstance(reply.get("skipped"), list) else 0
        note = copied_note(reply, moved).removeprefix("; ")
        detail = "; ".join(part for part in (f"{left} objects left on the GPU" if left else "",
                                             note) if part)
        return ReclaimResult(moved, time.monotonic() - started, detail)

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        gpu_moves(target, self.move_refusal())  # refuses any move, before anything happens
        agent = require_agent(target, "the framework method needs the kernel agent, which is not connected")
        started = time.monotonic()
        try:
            reply = await agent.request("reload", timeout=self.op_timeout)
        except AGENT_ERRORS as e:
            raise ReclaimError(f"reload failed: {agent_failure(e)}") from None
        return ReclaimResult(reply_int(reply, "bytes"), time.monotonic() - started)
