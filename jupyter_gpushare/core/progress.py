"""A restore's progress, shown in the cell that triggered it."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class CellProgress:
    """Shows one transient progress line in the output of the cell that triggered a restore
    (through the kernel's agent, so it arrives in order with the cell's own messages).

    ``clear_when_done``: :meth:`done` takes the line out of the cell again; only for cells
    whose code has not run yet (the line is then all they hold), never for a magic's cell."""

    def __init__(self, agent: Any, parent: dict | None, clear_when_done: bool = False):
        self.agent = agent
        self.parent = parent
        self.clear_when_done = clear_when_done
        self.display_id = f"gpushare-{time.monotonic_ns()}"
        self.shown = False

    async def __call__(self, text: str) -> None:
        if await self._ask("show", text=text):
            self.shown = True

    async def done(self) -> None:
        """The restore succeeded: the cell keeps no gpushare output (unless configured to)."""
        if self.shown and self.clear_when_done:
            await self._ask("clear")

    async def _ask(self, op: str, **args: Any) -> bool:
        if self.agent is None or not self.parent:
            return False
        try:
            await self.agent.request(op, timeout=5, parent=self.parent,
                                     display_id=self.display_id, **args)
        except Exception as e:  # progress is a courtesy; never fail a restore over it
            log.warning("gpushare: could not %s progress: %s", op, e)
            return False
        return True
