"""The simulated method: the driver's checkpoint state machine, run by the simulated GPU
inside the kernel (lock -> checkpoint on release; resume = restore -> unlock on the way back).

``sim_resume`` brings the kernel's simulated GPU back to running from whatever state it is in
(locked, checkpointed or running), so it is both the restore and the undo of a failed release.
A restore with ``KernelTarget.gpu_mapping`` passes it on as ``gpu_mapping`` = [[from, to], ...]
(JSON keys cannot be integers); the undo never moves.

The kernel runs the resume on a thread of its own and answers ``sim_resume`` once it is done
or after half a second, whichever is first; ``done: false`` says how far each GPU's copy is,
and the method asks again (the same request joins the resume that runs) until it is done. A
kernel with memory on several GPUs restores them in parallel, and the cell's progress line
says so per GPU while they move ("restoring 2 GPUs in parallel: GPU 0 1.2/4.0 GiB, GPU 1
0.8/4.0 GiB"), then how long each took and the rate. A restore that ends within the first
answer shows nothing more than the controller's two lines (what it restores, how long it
took). An answer without ``done`` is a whole answer (an agent that waits to the end).

Like the driver's, a restore reads free memory on the GPUs its state lands on right before it
asks the kernel, and refuses with ``ReclaimError.no_room`` when another process took the room
the controller granted (nothing moved: the controller waits for room again). It asks the
kernel's agent first whether its arrays are off the device (a kernel whose release stopped
before its checkpoint needs no room). Free memory that cannot be read skips the check: the
simulated device's restore allocates all or nothing, so it cannot wedge as a real one can.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..policy import room
from ..protocol import RemoteError
from ..units import GiB, KiB, MiB, format_bytes
from .base import (
    AGENT_ERRORS,
    AgentLink,
    KernelTarget,
    MethodContext,
    Progress,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
    agent_failure,
    gpu_moves,
    reply_int,
    require_agent,
    say,
)


class SimulatedMethod(ReclaimMethod):
    name = "simulated"
    needs_agent = True
    uses_kept_copies = True
    supports_lazy = True
    simulated = True
    auto_rank = 1

    def __init__(self, lock_timeout: float = 10.0, op_timeout: float = 600.0,
                 undo_timeout: float = 10.0,
                 free_bytes: Callable[[int], int | None] | None = None):
        """free_bytes: free memory of a simulated GPU, read now (blocking; None = unknown),
        checked right before a restore asks the kernel; None: no check."""
        self.lock_timeout = lock_timeout
        self.op_timeout = op_timeout
        self.undo_timeout = undo_timeout
        self.free_bytes = free_bytes

    @classmethod
    def create(cls, context: MethodContext) -> SimulatedMethod:
        return cls(lock_timeout=context.lock_timeout, free_bytes=context.free_bytes)

    def move_refusal(self) -> str | None:
        return None

    def support(self) -> Support:
        return Support(True, "the simulated GPU node runs the checkpoint state machine in the kernel")

    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = require_agent(target, "the kernel's agent is not connected (was it started by this server?)")
        started = time.monotonic()
        step = "lock"
        try:
            await agent.request("sim_lock", timeout=self.lock_timeout + 5, lock_timeout=self.lock_timeout)
            step = "checkpoint"
            await say(progress, "checkpointing the simulated GPU state")
            reply = await agent.request("sim_checkpoint", timeout=self.op_timeout)
            moved = reply_int(reply, "bytes")
        except (*AGENT_ERRORS, ReclaimError) as e:
            why = f"{step} failed: {agent_failure(e)}"
            if step == "lock" and isinstance(e, RemoteError) and "still running" in str(e):
                why += f" (waited {self.lock_timeout:g} s: is the kernel busy on the GPU?)"
            raise await self._undo(agent, why) from None
        return ReclaimResult(moved, time.monotonic() - started,
                             f"{reply.get('arrays', 0)} arrays{copied_note(reply, moved)}")

    async def _undo(self, agent: AgentLink, why: str) -> ReclaimError:
        """Bring the kernel back to running; say whether that is confirmed."""
        try:
            await self._resume(agent, {}, time.monotonic() + self.undo_timeout)
        except AGENT_ERRORS as e:
            return ReclaimError(f"{why}; undo not confirmed ({agent_failure(e)}): the state stays held "
                                "until a restore brings it back")
        return ReclaimError(f"{why}; the kernel runs as before", resident=True)

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        moves = gpu_moves(target, self.move_refusal())
        agent = require_agent(target, "the kernel's agent is not connected (was it started by this server?)")
        args = {"gpu_mapping": [[src, dst] for src, dst in sorted(moves.items())]} if moves else {}
        started = time.monotonic()
        short = await self._short(agent, target, moves)
        if short:
            raise ReclaimError(f"not restoring: {short}; the state stays held in host memory",
                               no_room=short)
        try:
            reply = await self._resume(agent, args, started + self.op_timeout, progress)
        except AGENT_ERRORS as e:
            raise ReclaimError(agent_failure(e)) from None
        moved = reply_int(reply, "bytes")
        seconds = time.monotonic() - started
        copies = _copies(reply.get("transfers"))
        parallel = reply.get("parallel") is True
        if len(copies) > 1:
            await say(progress, done_line(copies, moved, seconds, parallel))
        return ReclaimResult(moved, seconds, f"{reply.get('arrays', 0)} arrays"
                             + (f" from {len(copies)} GPUs in parallel" if parallel else ""))

    async def _short(self, agent: AgentLink, target: KernelTarget,
                     moves: dict[int, int]) -> str | None:
        """Why the GPUs the state lands on lack room for it now ("GPU 0 has 512 MiB free,
        1.0 GiB needed"), as the driver's check says it; None when they have it, when
        nothing is off the device, or when it cannot be told (see the module's docs)."""
        if self.free_bytes is None:
            return None
        try:
            report = await agent.request("report", timeout=self.undo_timeout)
        except AGENT_ERRORS:
            return None  # the resume that follows says what is wrong with the kernel
        on_device = report.get("simulated_bytes")
        if isinstance(on_device, bool) or not isinstance(on_device, int) or on_device > 0:
            return None  # its arrays never left (a release stopped before its checkpoint)
        landing: dict[int, int] = {}
        for gpu, n in target.gpu_bytes.items():
            if gpu >= 0 and n > 0:
                landing[moves.get(gpu, gpu)] = landing.get(moves.get(gpu, gpu), 0) + n
        for gpu, n in sorted(landing.items()):
            try:  # a shared node's file that does not answer: unknown, as for the driver
                free = await asyncio.wait_for(asyncio.to_thread(self.free_bytes, gpu), 30)
            except asyncio.TimeoutError:
                free = None
            if free is not None and room.lacking({gpu: n}, {gpu: free}):
                return (f"GPU {gpu} has {format_bytes(free, whole_below_gib=True)} free, "
                        f"{format_bytes(n, whole_below_gib=True)} needed")
        return None

    async def _resume(self, agent: AgentLink, args: dict[str, Any], deadline: float,
                      progress: Progress | None = None) -> dict[str, Any]:
        """``sim_resume`` asked until it is done (or ``deadline``, a TimeoutError); each
        answer that it still runs goes to ``progress`` as a per-GPU line, when it changed."""
        shown = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the resume did not end in time")
            reply = await agent.request("sim_resume", timeout=left, **args)
            done = reply.get("done", True)
            if not isinstance(done, bool):
                raise ReclaimError(f"the kernel agent answered done={done!r}, not true or false")
            if done:
                return reply
            plan = _per_gpu(reply.get("plan"))
            gpus = reply.get("progress", {}).get("gpus") if isinstance(reply.get("progress"), dict) else None
            line = moving_line(plan, _per_gpu(gpus, pairs=True), reply.get("parallel") is True)
            if plan and line != shown:
                shown = line
                await say(progress, line)


def copied_note(reply: dict[str, Any], moved: int) -> str:
    """``; copied 0 B of 1.0 GiB (the rest had a current host copy)`` when the kernel kept a
    host copy of part of its state; nothing when it copied everything (or did not say)."""
    copied = reply.get("copied")
    if isinstance(copied, bool) or not isinstance(copied, int) or not 0 <= copied < moved:
        return ""
    return (f"; copied {format_bytes(copied)} of {format_bytes(moved)} "
            "(the rest had a current host copy)")


def _per_gpu(value: Any, pairs: bool = False) -> dict[int, Any]:
    """The agent's {"gpu": bytes} (or {"gpu": [moved, total]} with ``pairs``), keys as GPU
    indices; entries of another shape are left out (progress is a courtesy, never an error)."""
    out: dict[int, Any] = {}
    if not isinstance(value, dict):
        return out
    for key, item in value.items():
        if not isinstance(key, str) or not key.isdigit():
            continue
        numbers = item if pairs else [item]
        if (not isinstance(numbers, list) or len(numbers) != (2 if pairs else 1)
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers)):
            continue
        out[int(key)] = numbers[0] if pairs else item
    return out


def _copies(value: Any) -> list[tuple[int, int, float]]:
    """(GPU, bytes, seconds) of each GPU's copy in the agent's ``transfers``, by GPU."""
    out = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        gpu, nbytes, start, end = (item.get(k) for k in ("gpu", "bytes", "start", "end"))
        if (isinstance(gpu, int) and isinstance(nbytes, int) and not isinstance(gpu, bool)
                and isinstance(start, (int, float)) and isinstance(end, (int, float))):
            out.append((gpu, nbytes, max(0.0, float(end) - float(start))))
    return sorted(out)


def fraction(moved: int, total: int) -> str:
    """``1.2/4.0 GiB``: ``moved`` in the unit ``total`` reads in."""
    whole = format_bytes(total)
    unit = whole.rsplit(" ", 1)[-1]
    size = {"GiB": GiB, "MiB": MiB, "KiB": KiB}.get(unit)
    part = str(int(moved)) if size is None else f"{min(moved, total) / size:.1f}"
    return f"{part}/{whole}"


def moving_line(plan: dict[int, int], moved: dict[int, int], parallel: bool) -> str:
    """What a restore moves now, per GPU: ``restoring 2 GPUs in parallel: GPU 0 1.2/4.0 GiB,
    GPU 1 0.8/4.0 GiB`` (one GPU: ``restoring GPU 0: 1.2/4.0 GiB``)."""
    if len(plan) == 1:
        [(gpu, nbytes)] = plan.items()
        return f"restoring GPU {gpu}: {fraction(moved.get(gpu, 0), nbytes)}"
    per_gpu = ", ".join(f"GPU {g} {fraction(moved.get(g, 0), n)}" for g, n in sorted(plan.items()))
    how = "in parallel" if parallel else "one after another"
    return f"restoring {len(plan)} GPUs {how}: {per_gpu}"


def done_line(copies: list[tuple[int, int, float]], moved: int, seconds: float,
              parallel: bool) -> str:
    """How long a restore of several GPUs took, its rate, and each GPU's copy."""
    rate = f", {format_bytes(moved / seconds)}/s" if seconds > 0 else ""
    how = "in parallel" if parallel else "one after another"
    per_gpu = ", ".join(f"GPU {g} {format_bytes(n)} in {s:.2f} s" for g, n, s in copies)
    return (f"restored {len(copies)} GPUs {how}: {format_bytes(moved)} in {seconds:.2f} s"
            f"{rate} ({per_gpu})")
