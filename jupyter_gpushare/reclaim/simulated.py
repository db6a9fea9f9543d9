"""The simulated method: the driver's checkpoint state machine, run by the simulated GPU
inside the kernel (lock -> checkpoint on release; restore -> unlock on the way back)."""

from __future__ import annotations

import time

from ..protocol import RemoteError
from .base import KernelTarget, Progress, ReclaimError, ReclaimMethod, ReclaimResult, Support


async def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        result = progress(text)
        if result is not None:
            await result


class SimulatedMethod(ReclaimMethod):
    name = "simulated"

    def __init__(self, lock_timeout: float = 10.0, op_timeout: float = 600.0):
        self.lock_timeout = lock_timeout
        self.op_timeout = op_timeout

    def support(self) -> Support:
        return Support(True, "the simulated GPU node runs the checkpoint state machine in the kernel")

    def _agent(self, target: KernelTarget):
        if target.agent is None:
            raise ReclaimError("the kernel's agent is not connected (was it started by this server?)")
        return target.agent

    async def release(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = self._agent(target)
        started = time.monotonic()
        try:
            await agent.request("sim_lock", timeout=self.lock_timeout + 5, lock_timeout=self.lock_timeout)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            raise ReclaimError(f"lock failed: {e}") from None
        await _say(progress, "checkpointing the simulated GPU state")
        try:
            reply = await agent.request("sim_checkpoint", timeout=self.op_timeout)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            try:  # leave the kernel running as it was
                await agent.request("sim_unlock", timeout=30)
            except Exception as unlock_error:
                raise ReclaimError(f"checkpoint failed: {e}; unlock failed too: {unlock_error}") from None
            raise ReclaimError(f"checkpoint failed: {e}") from None
        return ReclaimResult(int(reply.get("bytes", 0)), time.monotonic() - started,
                             f"{reply.get('arrays', 0)} arrays")

    async def restore(self, target: KernelTarget, progress: Progress | None = None) -> ReclaimResult:
        agent = self._agent(target)
        started = time.monotonic()
        try:
            reply = await agent.request("sim_restore", timeout=self.op_timeout)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            raise ReclaimError(str(e)) from None
        try:
            await agent.request("sim_unlock", timeout=30)
        except (RemoteError, ConnectionError, TimeoutError) as e:
            raise ReclaimError(f"unlock failed: {e}") from None
        return ReclaimResult(int(reply.get("bytes", 0)), time.monotonic() - started,
                             f"{reply.get('arrays', 0)} arrays")
