"""The poll loop: one step (a sample and a policy pass) every ``interval`` seconds.

Polls never overlap: the loop, an agent's release and the refresh after an operation all go
through :meth:`Poller.poll_once`. What one step does is the caller's (the app wires it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Poller:
    def __init__(self, step: Callable[[], Awaitable[None]], interval: float) -> None:
        self.step = step
        self.interval = interval
        self.running = False
        #: set after the first poll (status never answers with no GPUs yet), or at stop
        self.started = asyncio.Event()
        self._lock = asyncio.Lock()
        self._next: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.running = True
        self.task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while self.running:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad poll must not stop tracking
                log.exception("gpushare: poll failed")
            self.started.set()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        async with self._lock:
            if self._next is not None and self._next is asyncio.current_task():
                self._next = None  # started: later callers need a poll after this one
            await self.step()

    async def refresh(self) -> None:
        """A poll that starts after this call: what status shows after an operation is of one
        moment. Operations that end while no such poll has started yet share one (under load
        a poll per operation was most of a release's latency)."""
        pending = self._next
        if pending is None or pending.done():
            pending = self._next = asyncio.ensure_future(self.poll_once())
        await asyncio.shield(pending)

    async def stop(self) -> None:
        """End the loop and wait until it has ended. A cancel can be lost (Python 3.11's
        wait_for returns a result that arrived with it), so cancel until it ends; the loop
        also ends by itself once ``running`` is false."""
        self.running = False
        task, self.task = self.task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("gpushare: the poll loop ended with %r", task.exception())
        self.started.set()  # nobody waits for a first poll that will not come

    def stop_now(self) -> None:
        """End the loop without waiting (no event loop to wait on)."""
        self.running = False
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.started.set()
