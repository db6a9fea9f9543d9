"""A release or a restore as a task the server owns: who waits for it cannot stop its bytes.

Callers (the gate, REST, the agent, make-room) only wait for an operation, shielded: a closed
tab, a network blip or an interrupt stops their waiting, never the bytes in flight. Only the
*waiting* phase of an operation can be stopped (:meth:`Operation.stop`); once it moves bytes,
it runs to its end (:func:`to_the_end`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How an operation ended, for whoever waited for it."""

    ok: bool
    message: str = ""
    retryable: bool = True
    dropped: bool = False  # the held state is gone (restart, death): nothing left to restore


@dataclass
class Operation:
    kind: str  # "release" | "restore"
    trigger: str
    # ends with the operation; never cancelled
    task: asyncio.Task[Outcome] = field(init=False, repr=False, compare=False)
    # the work; only its waiting is stopped
    body: asyncio.Task[Outcome] = field(init=False, repr=False, compare=False)
    phase: str = "waiting"  # "waiting" (may be stopped) | "moving" (runs to its end)
    stop_reason: str = ""
    stopped: bool = False  # stop() was called: the waiting loop ends even if its cancel was lost
    on_end: Callable[[], None] | None = None  # gives back what the work claimed, however it ends

    def stop(self, why: str) -> None:
        """Stop the work, not the task waiters await: that one still ends in an Outcome,
        even when the work is stopped before it began."""
        self.stop_reason, self.stopped = why, True
        self.body.cancel()

    @property
    def stoppable(self) -> bool:
        """A restore that still waits for its turn or for memory (nothing moves yet)."""
        return self.kind == "restore" and self.phase == "waiting"


async def to_the_end(aw: Awaitable[Any]) -> Any:
    """Await ``aw`` to its end even if our task is cancelled meanwhile: bytes in flight
    finish, so the state that follows is true."""
    inner = asyncio.ensure_future(aw)
    while True:
        try:
            return await asyncio.shield(inner)
        except asyncio.CancelledError:
            if inner.done():
                return inner.result()
            log.warning("gpushare: an operation that moves bytes was asked to stop; it finishes first")


async def wait_for(op: Operation) -> Outcome:
    """Wait for an operation without being able to stop it (our cancellation stays ours)."""
    return await asyncio.shield(op.task)
