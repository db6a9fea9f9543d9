"""The names of a kernel's gpushare states, shared by the server, the kernel agent and the
magics (and spelled the same in the REST API, the events and the lab panel).

``active`` (resident, recently used) -> ``idle`` (resident, idle for a while) -> ``releasing``
-> ``released`` (GPU state held in host memory, GPU memory freed) -> ``restoring`` -> ``active``.
``failed``: a release or restore went wrong; the state is held (a restore brings it back) and
the reason is shown. ``untracked``: no GPU memory, no local process, or nothing to release with.
"""

from __future__ import annotations

ACTIVE = "active"
IDLE = "idle"
RELEASING = "releasing"
RELEASED = "released"
RESTORING = "restoring"
FAILED = "failed"
UNTRACKED = "untracked"

ALL = (ACTIVE, IDLE, RELEASING, RELEASED, RESTORING, FAILED, UNTRACKED)
#: the kernel's GPU state is not (all) on the GPU: cells must wait for a restore
HELD = (RELEASING, RELEASED, RESTORING, FAILED)
#: nothing is held: cells run at once (the GPU state, if any, is on the GPU)
NOT_HELD = (ACTIVE, IDLE, UNTRACKED)
#: the GPU state is on the GPU and the kernel holds GPU memory
RESIDENT = (ACTIVE, IDLE)
