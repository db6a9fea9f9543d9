"""Restores ahead of a person's next cell (trigger ``activity``).

The lab extension asks for one when a person works in a notebook whose kernel is released
(``POST kernels/{id}/restore`` with ``{"trigger": "activity"}``), so that the state is back
before the cell is run. Such a restore is a hint, never owed to anyone:

- it takes room only as make-room does (no kernel of a person working is released for it);
- it yields to restores for cells: while one waits for a GPU it needs, it takes no turn and
  no room, it never moves onto a GPU one waits for, and a cell of its own kernel that
  arrives while it waits for room or a turn restores by itself (with its progress line)
  instead of waiting behind it;
- like any restore, it goes home unless home's SMs are contended and a quieter GPU has room
  (where the method can move it);
- the server stops it when it finds no room within ``room_wait`` seconds;
- one that fails or is stopped leaves the kernel ``released`` (never ``failed``), the
  reason in ``error``;
- a kernel it brought back that runs no cell within ``ahead_grace`` seconds may be released
  again (as an automatic release: not pinned, quiet, not opted out), without waiting for
  the whole idle timeout.

Requests for a kernel already on its way back, or resident, cost nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from .. import clock, policy
from . import metrics
from .errors import ControllerError

if TYPE_CHECKING:
    from .controller import Controller
    from .lifecycle import Lifecycle
    from .operations import Operation

log = logging.getLogger(__name__)

AHEAD = "activity"
#: what status says (``waiting``) while an ahead restore is on its way
AHEAD_TEXT = "restoring ahead of your next cell"
#: seconds an ahead restore may wait for room (memory, a GPU's restore turn) before the
#: server stops it; the kernel stays released and a cell restores it as without one
ROOM_WAIT = 5.0


def _gpus(controller: Controller, st: Lifecycle) -> set[int]:
    return set(controller.need(st.held)) if st.held is not None else set()


def cells_wait_for(controller: Controller, st: Lifecycle) -> set[int]:
    """The GPUs other kernels' restores for cells (any trigger but ``activity``) wait for:
    an ahead restore lets them go first, and does not move onto them."""
    out: set[int] = set()
    for other in controller.lifecycles():
        op = other.op
        if other is st or op is None or op.kind != "restore" or op.trigger == AHEAD:
            continue
        if op.phase == "waiting":
            out |= _gpus(controller, other)
    return out


def cells_waiting(controller: Controller, st: Lifecycle, gpus: set[int]) -> bool:
    """Another kernel's restore for a cell waits for one of ``gpus``: an ahead restore lets
    it go first."""
    return bool(cells_wait_for(controller, st) & gpus)


def yields(controller: Controller, st: Lifecycle, op: Operation, need: dict[int, int]) -> bool:
    """An ahead restore that must not take a turn or room now (a cell's restore waits)."""
    return op.trigger == AHEAD and cells_waiting(controller, st, set(need))


def superseded(controller: Controller, st: Lifecycle, op: Operation, trigger: str) -> bool:
    """A cell (``trigger``) arrives while ``op``, an ahead restore, still waits for room or a
    turn: the cell's own restore takes over (it shows its progress, and waits as long as it
    takes). An ahead restore checking room, or moving bytes, is simply joined."""
    if trigger == AHEAD or op.kind != "restore" or op.trigger != AHEAD or op.phase != "waiting":
        return False
    return bool(st.waiting) or cells_waiting(controller, st, _gpus(controller, st))


def failed_restore_error(trigger: str, why: str) -> str:
    return f"restore ahead of your next cell failed: {why}" if trigger == AHEAD else f"restore failed: {why}"


def view_waiting(st: Lifecycle, waiting: str | None) -> str | None:
    """Status's ``waiting`` for a kernel: says so while an ahead restore is on its way."""
    op = st.op
    if op is None or op.kind != "restore" or op.trigger != AHEAD:
        return waiting
    return f"{AHEAD_TEXT}; {waiting}" if waiting else AHEAD_TEXT


class AheadRestores:
    """The ahead restores of one server: at most one request in flight per kernel, and the
    kernels they brought back that no cell has used yet."""

    def __init__(self, controller: Controller, grace: float, room_wait: float = ROOM_WAIT):
        self.controller = controller
        self.grace = grace  # s; 0 = a kernel restored ahead is kept as any other
        self.room_wait = room_wait
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: kernel -> (clock.now() when restored ahead, the server's activity stamp then)
        self.unused: dict[str, tuple[float, float]] = {}

    def request(self, kernel_id: str) -> str:
        """Start an ahead restore, or do nothing when one is on its way or nothing is
        released: "started", "joined" or "resident". 404 for an unknown kernel."""
        c = self.controller
        st = c.get(kernel_id)
        if c.closing:
            raise ControllerError(409, "the server is shutting down")
        task = self._tasks.get(kernel_id)
        if task is not None and not task.done():
            metrics.AHEAD_RESTORES.labels("joined").inc()
            return "joined"
        if not st.is_held:
            if kernel_id in self.unused:  # the person is still there: the grace starts again
                self.unused[kernel_id] = (clock.now(), self.unused[kernel_id][1])
            metrics.AHEAD_RESTORES.labels("resident").inc()
            return "resident"
        if st.op is not None and st.op.kind == "restore":  # a cell's restore is on its way
            metrics.AHEAD_RESTORES.labels("joined").inc()
            return "joined"
        # started here, so that the answer already shows it; after a release in flight, later
        op = c.start_restore(kernel_id, trigger=AHEAD) if st.op is None else None
        task = self._tasks[kernel_id] = asyncio.ensure_future(self._restore(kernel_id, op))
        c._tasks.add(task)  # the server's shutdown stops it with the others
        task.add_done_callback(c._tasks.discard)
        task.add_done_callback(functools.partial(self._done, kernel_id))
        return "started"

    def _done(self, kernel_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(kernel_id) is task:
            del self._tasks[kernel_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("gpushare: ahead restore of kernel %s: %r", kernel_id, task.exception())

    async def _restore(self, kernel_id: str, op: Operation | None) -> None:
        c = self.controller
        st = c.find(kernel_id)
        if st is None:  # gone meanwhile
            return
        if op is None:
            while st.op is not None and st.op.kind == "release":  # released as the person came back
                await c.wait(st.op)
            if st.held is None or st.op is not None or c.closing:
                return
            op = c.start_restore(kernel_id, trigger=AHEAD)
        done, _ = await asyncio.wait({op.task}, timeout=self.room_wait)
        if not done and op.phase == "waiting" and not op.stopped:
            why = st.waiting or "restores for cells go first"
            op.stop(f"no room within {self.room_wait:g} s ({why})")
            metrics.AHEAD_RESTORES.labels("no_room").inc()
            c.announce(kernel_id, "restore_failed", method=st.method, count=False,
                       reason=op.stop_reason, trigger=AHEAD)
        outcome = await c.wait(op)
        rec = c.tracker.kernels.get(kernel_id)
        if outcome.ok:
            metrics.AHEAD_RESTORES.labels("restored").inc()
            self.unused[kernel_id] = (clock.now(), rec.server_activity if rec is not None else 0.0)
            return
        if st.op is not None or st.held is None:
            if st.op is not None and st.op.trigger != AHEAD:
                metrics.AHEAD_RESTORES.labels("superseded").inc()
            return  # a cell's restore took over, or the state is gone (a restart)
        if op.stopped:  # no room soon, an interrupt, the server closing: nothing moved
            st.note_error(f"not restored ahead of your next cell: {outcome.message}")
        else:  # the method failed: the controller kept the kernel released, the reason in error
            metrics.AHEAD_RESTORES.labels("failed").inc()
        log.info("gpushare: kernel %s not restored ahead: %s", kernel_id, outcome.message)

    def tick(self, now: float | None = None) -> None:
        """After each poll: forget kernels a cell used; release again those unused for
        ``grace`` seconds that an automatic release may take."""
        c = self.controller
        now = clock.now() if now is None else now
        for kid, (at, activity) in list(self.unused.items()):
            st, rec = c.find(kid), c.tracker.kernels.get(kid)
            if st is None or rec is None or st.held is not None:
                del self.unused[kid]
                continue
            if rec.busy or rec.server_activity > activity or c.kernels.live_state(kid) == "busy":
                metrics.AHEAD_RESTORES.labels("used").inc()
                del self.unused[kid]
                continue
            if self.grace <= 0:
                del self.unused[kid]
                continue
            if st.op is not None or now - at < self.grace:
                continue
            del self.unused[kid]
            candidate = c.candidate(st, rec, now)
            if not policy.eligible(candidate, c.config) or c.closing:
                continue  # pinned, opted out, computing on the GPU...: kept, as any other
            try:
                c.release_automatically(kid, f"restored ahead of a cell that did not come within "
                                             f"ahead_grace {self.grace:g} s")
            except ControllerError as e:
                log.debug("gpushare: kernel %s restored ahead stays: %s", kid, e.message)
                continue
            metrics.AHEAD_RESTORES.labels("released_unused").inc()

    def forget(self, kernel_id: str) -> None:
        self.unused.pop(kernel_id, None)


__all__ = [
    "AHEAD",
    "AHEAD_TEXT",
    "ROOM_WAIT",
    "AheadRestores",
    "cells_wait_for",
    "cells_waiting",
    "failed_restore_error",
    "superseded",
    "view_waiting",
    "yields",
]

