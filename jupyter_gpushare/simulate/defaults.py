"""The product's defaults, read from its own options (never copied), so that the simulator
models the product as shipped unless told otherwise.

An option the product does not have (yet) falls back to the value named here, which is
what the simulator then uses and says.
"""

from __future__ import annotations

from typing import Any

from ..core.options import RestoreOptions
from ..node.options import NodeOptions
from ..policy.options import ReleaseOptions


def _default(cls: type, name: str, fallback: Any) -> Any:
    trait = cls.class_traits().get(name)  # type: ignore[attr-defined]
    return fallback if trait is None else trait.default_value


#: "needs" or "proactive" (policy/options.py)
RELEASE_POLICY: str = _default(ReleaseOptions, "release_policy", "needs")
#: s: under "needs", an idle kernel is released anyway after this long
LONG_IDLE: float = _default(ReleaseOptions, "long_idle", 7200.0)
#: SM % at or below which a kernel counts as idle, and as not computing on a GPU
IDLE_UTILIZATION: float = _default(ReleaseOptions, "idle_utilization", 5.0)
#: s a restore waits for its own GPUs before it goes onto others (0: never)
MOVE_AFTER: float = _default(RestoreOptions, "restore_move_after", 30.0)
#: s a kernel restored ahead of a cell waits for it
AHEAD_GRACE: float = _default(RestoreOptions, "ahead_grace", 300.0)
#: bytes: the least room a new kernel is expected to need (its CUDA context)
MIN_ROOM: int = _default(RestoreOptions, "context_bytes", 512 << 20)
#: s of SM history a GPU's load is the mean of
LOAD_WINDOW: float = _default(NodeOptions, "load_window", 120.0)
#: s a kernel sits idle before it copies what changed to host in the background (0: never)
PRECOPY_AFTER: float = _default(RestoreOptions, "precopy_after", 60.0)


#: whether idle kernels are moved off GPUs whose SMs are contended
REBALANCE: bool = _default(RestoreOptions, "rebalance", True)
#: s a resident kernel must have been idle before rebalance may move it
REBALANCE_IDLE: float = _default(RestoreOptions, "rebalance_idle", 120.0)
#: whether a heavy kernel's cell that would share a busy GPU moves the kernel first
REBALANCE_BEFORE_CELL: bool = _default(RestoreOptions, "rebalance_before_cell", False)
#: moves per kernel per hour, at most
REBALANCE_PER_HOUR: int = _default(RestoreOptions, "rebalance_max_per_hour", 2)


def window_of(rebalance_idle: float, load_window: float) -> float:
    """s over which rebalance judges a GPU's load and the kernels computing there: the
    product's rebalancer's window for these options (``core.rebalance.window_of``)."""
    try:
        from ..core.rebalance import window_of as product
    except ImportError:  # a product without a rebalancer
        return max(load_window, 5.0 * rebalance_idle)
    return product(rebalance_idle, load_window)


#: s over which rebalance judges a GPU's load and the kernels computing there, by default
REBALANCE_WINDOW: float = window_of(REBALANCE_IDLE, LOAD_WINDOW)
