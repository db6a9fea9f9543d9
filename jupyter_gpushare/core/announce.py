"""Everything said about a kernel's operation, said once per action, in one place.

Each action (``released``, ``release_failed``, ``restored``, ``restore_failed``,
``restore_waiting``, ``pinned``, ``unpinned``, ``moved``) goes out through :meth:`Announcer.__call__`:
its event (``events/kernel-v1.yaml``, which the lab's toasts and the hub read), its
Prometheus counters and timing, and the kernel agent's state; the way jupyter_server emits
every kernel action's event from one decorator rather than at each call site.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import metrics

log = logging.getLogger(__name__)

#: action -> (counter, its ``result`` label, the timing histogram or None)
_COUNTED = {
    "released": (metrics.RELEASES, "ok", metrics.RELEASE_SECONDS),
    "release_failed": (metrics.RELEASES, "failed", None),
    "restored": (metrics.RESTORES, "ok", metrics.RESTORE_SECONDS),
    "restore_failed": (metrics.RESTORES, "failed", None),
    "moved": (metrics.KERNEL_MOVES, "ok", None),
}
#: actions whose event gives the move's rate (``bytes_per_second``)
_RATED = ("released", "restored")


class Announcer:
    """``emit(payload)``: the server's event logger; ``agent(kernel_id)``: the kernel's agent
    link (None without one); ``path(kernel_id)``: its notebook's path ("" unknown);
    ``restore_mode()``: told to the agent with every state."""

    def __init__(self, emit: Callable[[dict[str, Any]], None], agent: Callable[[str], Any],
                 path: Callable[[str], str], restore_mode: Callable[[], str]):
        self.emit = emit
        self.agent = agent
        self.path = path
        self.restore_mode = restore_mode

    def __call__(self, kernel_id: str, action: str, *, method: str | None = None,
                 state: str | None = None, count: bool = True, **data: Any) -> None:
        """Say that ``action`` happened. ``state``: the kernel's state now, told to its agent
        (the magics and lazy mode read it); ``count``: False for an event only (a restore
        ahead stopped before it moved anything did not fail); ``data``: the event's other
        fields (None: left out)."""
        counted = _COUNTED.get(action) if count else None
        if counted is not None and method:
            counter, result, timing = counted
            counter.labels(method, result).inc()
            if timing is not None and data.get("seconds") is not None:
                timing.observe(data["seconds"])
        if state is not None:
            self.tell_agent(kernel_id, state)
        payload: dict[str, Any] = {"kernel_id": kernel_id, "action": action}
        if method:
            payload["method"] = method
        path = self.path(kernel_id)
        if path:
            payload["path"] = path
        for k, v in data.items():
            if v is not None:
                payload[k] = int(v) if k == "bytes" else v
        if action in _RATED and payload.get("bytes") and data.get("seconds"):
            payload["bytes_per_second"] = round(payload["bytes"] / data["seconds"], 1)
        try:
            self.emit(payload)
        except Exception:
            log.exception("gpushare: could not emit event %s", action)

    def tell_agent(self, kernel_id: str, state: str) -> None:
        agent = self.agent(kernel_id)
        if agent is not None:
            try:
                agent.notify("state", state=state, restore_mode=self.restore_mode())
            except Exception as e:  # the agent learns its state again when it reconnects
                log.debug("gpushare: could not tell kernel %s its state: %s", kernel_id, e)


__all__ = ["Announcer"]
