"""The framework method: the in-kernel agent moves tensors/arrays to host memory in place
(PyTorch, CuPy, JAX adapters in ``kernel/offload``) and empties allocator caches.

Frees all but the CUDA context. For old drivers and MIG, where the driver checkpoint
API is not available. ``reload`` moves back whatever is offloaded (nothing when nothing
is), so it is both the restore and the undo of a failed or half-done offload.

A reload is all or nothing across frameworks: when one runs out of GPU memory (another
process took the room between the controller's grant and the reload: this method has no room
check of its own), the agent offloads again what had come back and says so (``NO_ROOM_KIND``),
and the restore refuses with ``ReclaimError.no_room``, so the controller waits for room again
as it does for the driver's check.
"""

from __future__ import annotations

import time
from typing import Any

from ..protocol import RemoteError
from ..units import format_bytes
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

#: the share of what the frameworks held on the GPU before a release (their own count:
#: allocated plus cached, JAX's pool) that it must free to count as released; one that frees
#: less is undone and fails, and ``auto`` picks the driver for that kernel from then on
MIN_FREED_SHARE = 0.5
SHOWN_LEFT = 5  # what was left on the GPU, named in the error (the rest counted)
#: the kind of the agent's error reply when a reload ran out of GPU memory and everything
#: went back to host memory (``kernel/reload.py``'s ``NoRoomToReload``; its text: why)
NO_ROOM_KIND = "NoRoomToReload"


def _int(reply: dict[str, Any], key: str) -> int | None:
    value = reply.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def freed_too_little(reply: dict[str, Any], moved: int, left: int) -> tuple[str, str] | None:
    """(in a few words, the error) when an offload left most of the frameworks' GPU memory
    where it was, by the agent's count before and after it (``device_before``,
    ``device_after``); from an agent that does not count: when it moved nothing and left
    objects alone. None: it freed enough."""
    before, after = _int(reply, "device_before"), _int(reply, "device_after")
    if before is not None and after is not None:
        if not before:
            return ("PyTorch, CuPy and JAX held nothing on the GPU",
                    "not released: PyTorch, CuPy and JAX hold nothing on the GPU, so the "
                    "framework method has nothing to free")
        freed = max(0, before - after)
        if freed >= before * MIN_FREED_SHARE:
            return None
        short = f"its release freed {format_bytes(freed)} of {format_bytes(before)}"
        figures = (f"{format_bytes(freed)} of the {format_bytes(before)} PyTorch, CuPy and JAX "
                   f"held on the GPU (a release must free at least {MIN_FREED_SHARE:.0%})")
    elif moved == 0 and left:
        short = "its release left every object on the GPU"
        figures = "nothing"
    else:
        return None
    named = [e for e in reply.get("skipped") or []
             if isinstance(e, str) and not e.startswith("... and ")][:SHOWN_LEFT]
    if named:
        more = left - len(named)
        stayed = "left on the GPU: " + "; ".join(named) + (f"; and {more} more" if more > 0 else "")
    else:
        stayed = (f"{format_bytes(moved)} moved to host memory, but the allocator kept its "
                  "memory reserved (JAX's pool does unless XLA_PYTHON_CLIENT_ALLOCATOR=platform)")
    return short, f"not released: the framework method freed {figures}; {stayed}"


class FrameworkMethod(ReclaimMethod):
    name = "framework"
    needs_agent = True
    uses_kept_copies = True
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
        too_little = freed_too_little(reply, moved, left)
        if too_little is not None:  # never "released" when the memory stayed: undo, say why
            unfit, why = too_little
            try:
                await agent.request("reload", timeout=self.op_timeout)
            except AGENT_ERRORS as undo:
                raise ReclaimError(f"{why}; moving back not confirmed ({agent_failure(undo)}): "
                                   "the state stays held until a restore brings it back") from None
            raise ReclaimError(f"{why}; moved back: the kernel runs as before", resident=True,
                               unfit=unfit) from None
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
            if isinstance(e, RemoteError) and e.kind == NO_ROOM_KIND:
                # another process took the room since the grant, and the agent put back
                # in host memory whatever had moved: the controller waits for room again
                short = str(e)[:300]
                raise ReclaimError(f"reload failed: {short}; nothing stayed on the GPU, the "
                                   "state is held in host memory as released",
                                   no_room=short) from None
            raise ReclaimError(f"reload failed: {agent_failure(e)}") from None
        return ReclaimResult(reply_int(reply, "bytes"), time.monotonic() - started)
