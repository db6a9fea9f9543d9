"""Kernels over their memory cap, as the node sees them: checked after every poll.

A framework the agent capped stays under its cap by itself (its allocation past it fails);
what the agent could not limit (raw CUDA, a kernel without the agent, a framework already
initialised) is watched here: the node's reading of the kernel on each GPU against its cap.
A kernel newly over its cap is logged and its agent told (the person sees it in the cell
that runs then, or the next one); every capped kernel's cap and whether it is over are
metrics; status and the panel show ``over_cap`` (server/views.py); the policy releases
kernels over their cap first when a GPU needs room (``Candidate.over_cap``).

A kernel seen before the admin's cap was known (the hub service had not answered yet when it
started) gets it at the first poll that knows it, and its agent applies it.
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
            if st is not None and st.cap_ceiling is None:
                late = self.controller.default_cap()  # known only now (the hub answered)
                if late is not None:
                    st.cap_ceiling = late
                    self.retell(kernel_id)
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
