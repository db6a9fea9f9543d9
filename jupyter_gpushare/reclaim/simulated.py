"""The simulated method: the driver's checkpoint state machine, run by the simulated GPU
inside the kernel (lock -> checkpoint on release; resume = restore -> unlock on the way back).

``sim_resume`` brings the kernel's simulated GPU back to running from whatever state it is in
(locked, checkpointed or running), so it is both the restore and the undo of a failed release.
A restore with ``KernelTarget.gpu_mapping`` passes it on as ``gpu_mapping`` = [[from, to], ...]
(JSON keys cannot be integers); the undo never moves.
"""

from __future__ import annotations

import time

from ..protocol import RemoteError
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
    supports_lazy = True
    simulated = True
    auto_rank = 1

    def __init__(self, lock_timeout: float = 10.0, op_timeout: float = 600.0,
                 undo_timeout: float = 10.0):
        self.lock_timeout = lock_timeout
        self.op_timeout = op_timeout
        self.undo_timeout = undo_timeout

    @classmethod
    def create(cls, context: MethodContext) -> SimulatedMethod:
        return cls(lock_timeout=context.lock_timeout)

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
        return ReclaimResult(moved, time.monotonic() - started, f"{reply.get('arrays', 0)} arrays")

    async def _undo(self, agent: AgentLink, why: str) -> ReclaimError:
        """Bring the kernel back to running; say whether that is confirmed."""
        try:
            await agent.request("sim_resume", timeout=self.undo_timeout)
        except AGENT_ERRORS as e:
            return ReclaimError(f"{why}; undo not confirmed ({agent_failure(e)}): the state stays held "
                                "until a restore brings it back")
        return ReclaimError(f"{why}; the kernel runs as before", resident=True)

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        moves = gpu_moves(target, self.move_refusal())
        agent = require_agent(target, "the kernel's agent is not connected (was it started by this server?)")
        args = {"gpu_mapping": [[src, dst] for src, dst in sorted(moves.items())]} if moves else {}
        started = time.monotonic()
        try:
            reply = await agent.request("sim_resume", timeout=self.op_timeout, **args)
        except AGENT_ERRORS as e:
            raise ReclaimError(agent_failure(e)) from None
        return ReclaimResult(reply_int(reply, "bytes"), time.monotonic() - started,
                             f"{reply.get('arrays', 0)} arrays")
