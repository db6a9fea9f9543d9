"""Kernels over their memory cap, as the node sees them: checked after every poll.

A framework the agent capped stays under its cap by itself (its allocation past it fails);
what the agent could not limit (raw CUDA, a kernel without the agent, a framework already
initialised) is watched here: the node's reading of the kernel on each GPU against its cap.
A kernel newly over its cap is logged and its agent told (the person sees it in the cell
that runs then, or the next one); every capped kernel's cap and whether it is over are
metrics; status and the panel show ``over_cap`` (server/views.py); the policy releases
kernels over their cap first when a GPU needs room (``Candidate.over_cap``).

The admin's cap follows its source at every poll: a kernel seen before it was known (the hub
service had not answered yet when it started) gets it at the first poll that knows it, and a
change of the hub service's ``caps`` (or of its answer for the person) reaches every running
kernel, capped or not, tighter or looser: its ceiling is the smaller of its kernelspec's cap
and the admin's now; its own cap, never above that ceiling, still holds where it is lower.
Where the cap in effect changed, its agent applies it (a framework limits what it allocates
from then on; what a kernel holds past a tighter cap stays, watched and flagged, and is
released first when a GPU needs room). A released kernel gets it too; its restore is refused
while its state is over a cap set since its release (the controller's ``cap_refusal``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..policy import caps
from . import metrics

log = logging.getLogger(__name__)


class CapWatch:
    def __init__(self, controller: Any, tell: Callable[[str, str], None],
                 retell: Callable[[str], None] = lambda kernel_id: None):
        self.controller = controller
        self.tell = tell  # (kernel id, "holds 9.1 GiB of its 8 GiB cap on GPU 0")
        self.retell = retell  # (kernel id): its cap changed; its agent applies it
        self.flagged: set[str] = set()

    def tick(self) -> None:
        seen: dict[str, tuple[int, bool]] = {}
        for kernel_id, rec in list(self.controller.tracker.kernels.items()):
            st = self.controller.find(kernel_id)
            if st is not None:
                self._follow(st)
            cap = self.controller.memory_cap(st) if st is not None else None
            if cap is None:
                continue
            text = caps.over_text(rec.gpu_bytes, cap, self.controller.context_bytes)
            seen[kernel_id] = (cap, text is not None)
            if text is None:
                self.flagged.discard(kernel_id)
            elif kernel_id not in self.flagged:
                self.flagged.add(kernel_id)
                log.warning("gpushare: kernel %s %s", kernel_id, text)
                self.tell(kernel_id, text)
        self.flagged &= set(seen)
        metrics.set_caps(seen)

    def _follow(self, st: Any) -> None:
        """The kernel's ceiling as its sources say now; its agent told when its cap changed."""
        ceiling = self.controller.cap_ceiling(st.kernel_id)
        if ceiling == st.cap_ceiling:
            return
        before = self.controller.memory_cap(st)
        st.cap_ceiling = ceiling
        after = self.controller.memory_cap(st)
        if after != before:
            log.info("gpushare: kernel %s: memory cap %s -> %s (the admin's cap changed)",
                     st.kernel_id, _said(before), _said(after))
            self.retell(st.kernel_id)


def _said(cap: int | None) -> str:
    return "none" if cap is None else f"{caps.describe(cap)} per GPU"
