"""One run's settings, and the policies by name (one more policy = one more entry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..policy import PolicyConfig
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
    placement: str = "round-robin"  # round-robin | load-aware (engine.PLACEMENTS)
    max_users_per_gpu: int = 12
    seed: int = 0
    bin_seconds: float = 600.0
    ahead_lead: float = 0.0  # s between a person's first activity and their cell (0: none seen)
    ahead_share: float = 1.0  # of cells, the share with activity the lab sees before them
    ahead_grace: float = 300.0  # s a kernel restored ahead waits for its cell (the product's)
    release_policy: str = "proactive"  # proactive | needs (policies.RELEASE_POLICIES)
    long_idle: float = 7200.0  # s: under ``needs``, released however much room there is
    move_after: float = 30.0  # s a restore waits for its own GPUs before others (0: never)

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
            "ahead_grace": s.ahead_grace, "move_after": s.move_after}
