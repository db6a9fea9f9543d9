"""One run's settings, and the policies by name (one more policy = one more entry).

Every default is the product's as shipped (``defaults.py`` reads its options); the baselines
(``proactive`` releases, ``round-robin`` placement or servers, no moves, no rebalance, releases
that copy everything) are named settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..policy import PolicyConfig
from . import defaults
from .hub_policy import GPUShareHub
from .policies import Cull, Exclusive, GPUShare, Policy, Static
from .transfer import PRESETS, TransferModel


@dataclass(frozen=True)
class Settings:
    gpus: int = 8  # per node
    gpu_gib: float = 80.0
    nodes: int = 1
    transfer: TransferModel = PRESETS["driver"]
    config: PolicyConfig = field(default_factory=PolicyConfig)  # the product's defaults
    poll_interval: float = 2.0
    cull_after: float = 3600.0
    cull_interval: float = 300.0  # jupyter_server's default
    delay_bound: float = 1.0  # s: p99 cell delay allowed for a run to "serve"
    slowdown_bound: float = 1.1  # p99 stretch of GPU cells from sharing SMs allowed to "serve"
    restore_mode: str = "eager"  # eager | lazy (engine.RESTORE_MODES)
    placement: str = "room"  # the product's rule | round-robin (engine.PLACEMENTS)
    servers: str = "rule"  # the machine a user's server runs on: rule | round-robin
    max_users_per_gpu: int = 12
    seed: int = 0
    bin_seconds: float = 600.0
    ahead_lead: float = 0.0  # s between a person's first activity and their cell (0: none seen)
    ahead_share: float = 1.0  # of cells, the share with activity the lab sees before them
    ahead_grace: float = defaults.AHEAD_GRACE  # s a kernel restored ahead waits for its cell
    release_policy: str = defaults.RELEASE_POLICY  # needs | proactive (policies.RELEASE_POLICIES)
    long_idle: float = defaults.LONG_IDLE  # s: under ``needs``, released however much room
    move_after: float = defaults.MOVE_AFTER  # s a restore waits for its own GPUs (0: never)
    rebalance: bool = defaults.REBALANCE  # idle kernels move off contended GPUs
    rebalance_idle: float = defaults.REBALANCE_IDLE  # s idle before a kernel may be moved
    rebalance_per_hour: int = defaults.REBALANCE_PER_HOUR  # moves per kernel per hour, at most
    rebalance_before_cell: bool = defaults.REBALANCE_BEFORE_CELL  # a heavy cell moves off a busy GPU first
    load_window: float = defaults.LOAD_WINDOW  # s of SM history a GPU's load is judged over
    release_copies: str = "changed"  # changed | all (engine.RELEASE_COPIES)
    precopy_after: float = defaults.PRECOPY_AFTER  # s idle before a pre-copy (0: never)
    node_daemon: bool = False  # servers of a machine share their placements through it

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.nodes


POLICIES: dict[str, Callable[[Settings], Policy]] = {
    "exclusive": lambda s: Exclusive(),
    "static": lambda s: Static(),
    "cull": lambda s: Cull(s.cull_after, s.cull_interval),
    "gpushare": lambda s: GPUShare(s.config, s.poll_interval, s.seed, **_release(s)),
    "gpushare-hub": lambda s: GPUShareHub(s.config, s.poll_interval, s.seed, **_release(s)),
}


def _release(s: Settings) -> dict:
    return {"release_policy": s.release_policy, "long_idle": s.long_idle,
            "ahead_grace": s.ahead_grace, "move_after": s.move_after,
            "rebalance": s.rebalance, "rebalance_idle": s.rebalance_idle,
            "rebalance_per_hour": s.rebalance_per_hour,
            "rebalance_before_cell": s.rebalance_before_cell, "node_daemon": s.node_daemon}
