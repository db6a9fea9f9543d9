"""Host copies ahead of a release: pre-copy idle kernels, and keep the copies within budget.

With the framework and simulated methods a kernel keeps a host copy of its GPU state after
a restore, and the next release copies only what changed since. Once a kernel has been idle
for ``precopy_after`` seconds with bytes left to copy, its agent is asked to copy them in
the background (it answers at once; a cell that starts stops it), so a release that someone
waits for has (almost) nothing left to copy.

The copies are host memory of the kernel's process, already counted in its cgroup and the
machine (``HostRoom``). Where that room falls below ``host_memory_reserve``, kept copies are
dropped, the longest-idle kernel's first, and within a kernel oldest first: a dropped copy
costs only the copy at the next release.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .. import clock
from ..states import ACTIVE, IDLE

log = logging.getLogger(__name__)

ASK_TIMEOUT = 2.0  # s: the agent answers at once (the copy runs on its own thread)


class Precopies:
    """Once per poll: which idle kernels to pre-copy, which kept copies to drop."""

    def __init__(self, controller: Any, precopy_after: Callable[[], float],
                 reserve: Callable[[], int]) -> None:
        self.controller = controller
        self.precopy_after = precopy_after
        self.reserve = reserve
        self.asked: dict[str, float] = {}  # kernel -> when its agent was last asked
        self.dropped = 0  # bytes of kept copies dropped for host memory (for tests, metrics)

    async def tick(self) -> None:
        now = clock.now()
        after = self.precopy_after()
        records = self.controller.tracker.kernels
        asks = []
        short: dict[str, int] = {}  # host scope -> bytes missing
        kept: list[tuple[float, str, str]] = []  # (idle seconds, kernel, scope)
        for st in self.controller.lifecycles():
            kid = st.kernel_id
            rec = records.get(kid)
            if rec is None or st.state not in (ACTIVE, IDLE) or st.op is not None:
                continue
            room = rec.host_room
            if room is not None and room.available is not None:
                missing = self.reserve() - room.available
                if missing > 0:
                    short[room.scope] = max(short.get(room.scope, 0), missing)
            if rec.host_copy_kept_bytes:
                kept.append((rec.idle_seconds(now), kid, room.scope if room is not None else ""))
            if (after > 0 and rec.to_copy_bytes and not rec.busy
                    and rec.idle_seconds(now) >= after
                    and now - self.asked.get(kid, float("-inf")) >= after):
                self.asked[kid] = now
                asks.append(self._ask(kid, "precopy"))
        for kid in list(self.asked):
            if kid not in records:
                del self.asked[kid]
        for _, kid, scope in sorted(kept, reverse=True):  # the longest idle first
            if short.get(scope, 0) > 0:
                reply = await self._ask(kid, "drop_host_copies", bytes=short[scope])
                freed = reply.get("freed", 0) if isinstance(reply, dict) else 0
                if isinstance(freed, int) and not isinstance(freed, bool) and freed > 0:
                    short[scope] -= freed
                    self.dropped += freed
                    log.info("gpushare: host memory is short: dropped %d bytes of kernel %s's "
                             "host copy (its next release copies them again)", freed, kid)
        if asks:
            await asyncio.gather(*asks)

    async def _ask(self, kernel_id: str, op: str, **fields: Any) -> dict[str, Any]:
        agent = self.controller.kernels.agent(kernel_id)
        if agent is None:
            return {}
        try:
            reply = await agent.request(op, timeout=ASK_TIMEOUT, **fields)
        except Exception as e:  # an older agent, a busy or gone one: the release copies all
            log.debug("gpushare: %s for kernel %s: %s", op, kernel_id, e)
            return {}
        return reply if isinstance(reply, dict) else {}
